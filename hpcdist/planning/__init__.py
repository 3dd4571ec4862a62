"""Planning before anything runs: per-GPU memory (memory.py), layouts ranked by a step-time model (layouts.py; the
formulas are in docs/PLANNER.md) and the dry run that applies the real parallel plan to a meta model (dryrun.py).
The per-rank path imports only ``layouts.resolve_auto`` (hpcdist.run hands it to ``rank_facts``), once per rank,
before the process group."""
