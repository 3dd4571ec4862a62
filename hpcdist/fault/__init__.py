"""Per-rank fault tolerance at run time: what every rank does so a failure is noticed, attributed and survived.

- ``hang``: the hang watchdog (heartbeats, stacks, exit 124) and the process-group timeouts behind it;
- ``failures``: failure records in <run.dir>/failures.jsonl (who failed, where, why);
- ``stop``: signal handlers that set a stop flag, and the all-reduce by which every rank agrees on it;
- ``goodput``: the run's wall time split into training, checkpoints, restarts (<run.dir>/goodput.json);
- ``stragglers``: slow-rank detection;
- ``nonfinite``: the NaN/Inf gradient-norm guard (``train.nonfinite``: stop before any save of that state, or skip
  the update);
- ``triage``: NaN triage (``train.nonfinite_triage``): re-run a non-finite step once on the same inputs and tell bad
  data (reproducible: name and skip the samples) from bad hardware (not reproducible: blame the host);
- ``rundir_lock``: one run per run directory (a flock on <run.dir>/run.lock held by rank 0);
- ``supervise``: the per-rank supervisor that records a death by signal (standard library only);
- ``health``: the health gate's protocol (its command line, the verdicts read back, the record of an unhealthy
  node); the checks are ``hpcdist.diagnostics.gate``;
- ``regroup``: survivors of a peer's death rebuild the default process group in-process on a rendezvous store that
  no rank hosts, and a warm spare takes the dead rank's number (the protocol, on torch's TCPStore);
- ``inprocess``: in-process recovery around the trainer: join through the store (or wait as a spare), and after a
  peer's death regroup and train on from the node-local snapshot in the same process.

Nothing here knows the scheduler: requeueing, the restart ledger and node exclusion are ``hpcdist.launch``'s, which
may import this package (never the other way round). The job's facts (id, restarts) come as ``DistEnv.job``, read by
the scheduler table (``hpcdist.schedulers``).

Deliberately empty: ``python -m hpcdist.fault.supervise`` starts once per rank and must import only the standard
library, so this package imports none of its modules.
"""
