"""One rank of nccl_check, start to verdict: audit -> join -> process group -> health -> sweep -> finder -> verdict.

Every step that needs other ranks runs under the watchdog; rank 0 gathers results over a gloo control group (the
measured operations run on the job's backend) and prints each section as soon as it is complete, so a run that
hangs later still shows everything before the hang.
"""

from __future__ import annotations

import datetime
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, TextIO

import torch
import torch.distributed as dist

from hpcdist.diagnostics import audit, finder, report
from hpcdist.diagnostics.collectives import OPS, group_table, message_sizes, sweep_op
from hpcdist.diagnostics.faults import Faults
from hpcdist.diagnostics.health import device_health
from hpcdist.diagnostics.names import DTYPE_NAMES
from hpcdist.diagnostics.rendezvous import JoinError, JoinResult, join
from hpcdist.diagnostics.verdict import Expectation, Verdict, bandwidth_checks
from hpcdist.diagnostics.watchdog import Hang, Watchdog
from hpcdist.env import DistEnv

__all__ = ["DTYPES", "Options", "apply_profile", "run_rank"]

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}
# Findings about one node's hardware: leaving the node out of the next job is the fix.
_NODE_FAULTS = ("gpu_missing", "no_network")


@dataclass(frozen=True)
class Options:
    """What to run; the CLI maps its flags 1:1 onto these fields."""

    ops: tuple[str, ...] = OPS
    min_bytes: int = 8
    max_bytes: int = 16 << 20
    step_factor: int = 2
    iters: int = 20
    warmup: int = 5
    dtype: str = "float32"
    timeout_s: float = 120.0
    join_timeout_s: float = 300.0
    sweep: bool = True
    finder: bool = True
    finder_bytes: int = 4 << 20
    finder_iters: int = 5
    finder_warmup: int = 1
    slow_threshold: float = 0.7
    expect: Expectation = field(default_factory=Expectation)
    requeue_signal: str = "USR2"
    json_path: str | None = None
    plot_path: str | None = None


def apply_profile(name: str | None, env: DistEnv) -> tuple[str, list[str]] | None:
    """Resolve an NCCL profile (hpcdist.resources "nccl") into this task's environment, as ``hpcdist train`` does.

    So the check runs with the variables training will have. Imported lazily: the check itself needs only
    hpcdist.env, and a profile that fails to load is reported in the audit instead of stopping the diagnosis.
    """
    if not name or name == "none":
        return None
    try:
        from hpcdist.launch.nccl import apply_to_environ

        return name, apply_to_environ(name, master_addr=env.master_addr)
    except Exception as err:  # ConfigError, ImportError, OSError: the audit shows it
        return name, [f"could not apply the profile: {type(err).__name__}: {err}"]


def run_rank(
    env: DistEnv, opts: Options, *, profile: tuple[str, list[str]] | None = None, out: TextIO | None = None
) -> int:
    """Run the whole check as this rank; returns the exit code (0 PASS, 1 FAIL). Rank 0 prints the report."""
    return _Run(env, opts, profile, out or sys.stdout).main()


class _Run:
    def __init__(self, env: DistEnv, opts: Options, profile: tuple[str, list[str]] | None, out: TextIO) -> None:
        self.env, self.opts, self.profile, self.out = env, opts, profile, out
        self.faults = Faults.from_environ()
        self.verdict = Verdict()
        self.hosts: list[str] = [env.hostname]
        self.doc: dict[str, Any] = {
            "tool": "nccl_check",
            "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "options": {**asdict(opts), "ops": list(opts.ops)},
            "faults": self.faults.describe(),
            "sweep": [],
            "hang": None,
        }
        self.wd: Watchdog | None = None
        self.ctrl: dist.ProcessGroup | None = None
        self.node_group: dist.ProcessGroup | None = None

    # ------------------------------------------------------------------------------------------- output

    @property
    def main_rank(self) -> bool:
        return self.env.rank == 0

    def emit(self, text: str) -> None:
        print(text, file=self.out, flush=True)

    def finish(self) -> int:
        """Verdict text and JSON (rank 0, or the rank reporting a hang); the exit code."""
        self.doc["verdict"] = self.verdict
        self.emit(report.verdict_text(self.verdict))
        if self.opts.json_path:
            report.write_json(self.doc, self.opts.json_path)
        if self.opts.plot_path:
            from hpcdist.diagnostics.plot import write_diagnostics_plot
            from hpcdist.report.plots import MissingMatplotlib

            try:
                self.emit(f"# plot: {write_diagnostics_plot(self.doc, self.opts.plot_path)}")
            except MissingMatplotlib as e:  # the check itself passed or failed on its own; only the picture is missing
                self.emit(f"# plot: not written: {e}")
        return 0 if self.verdict.passed else 1

    def on_hang(self, hang: Hang) -> None:
        """Called on the one rank that reports a hang (usually rank 0), from the watchdog."""
        self.doc["hang"] = hang
        culprits = hang.culprit_ranks
        who = ", ".join(f"rank {r} ({self.hosts[r]})" for r in culprits) or "no single rank (see above)"
        verb = "failed" if hang.error else "hung"
        self.verdict.fail(f"step '{hang.step}' {verb}: {who}", [self.hosts[r] for r in culprits])
        self.emit(report.hang_text(hang))
        self.finish()

    # --------------------------------------------------------------------------------------------- main

    def main(self) -> int:
        env = self.env
        self.faults.hang(env.rank, "join")
        record = audit.collect_local(env, profile=self.profile)
        if env.world_size == 1:
            return self.single(record)
        try:
            joined = join(env, record, self.opts.join_timeout_s)
        except JoinError as err:
            print(f"nccl_check: {err}", file=sys.stderr, flush=True)
            return 1
        self.hosts = [h or "?" for h in joined.hosts]
        if self.main_rank:
            self.audit(joined)
            if joined.missing:
                return self.missing(joined)
        self.wd = Watchdog(joined.store, env.rank, joined.hosts, self.opts.timeout_s, self.on_hang).start()
        try:
            self.connect(joined.store)
            self.health()
            if self.opts.sweep:
                self.sweep()
            if self.opts.finder:
                self.find_slow()
            with self.wd.step("verdict"):
                passed = [self.verdict.passed]
                dist.broadcast_object_list(passed, src=0, group=self.ctrl)
            code = self.finish() if self.main_rank else (0 if passed[0] else 1)
        finally:
            self.wd.stop()
        dist.destroy_process_group()
        return code

    def layout(self) -> dict[str, Any]:
        env = self.env
        return {
            "world_size": env.world_size,
            "hosts": self.hosts,
            "backend": env.backend,
            "device_kind": torch.device(env.device).type,
            "launcher": env.launcher,
            "job_id": env.job_id,
            "master": f"{env.master_addr}:{env.master_port}",
        }

    def audit(self, joined: JoinResult) -> None:
        records = [r for r in joined.records if r]
        expected_hosts = len({joined.expected_host(r, self.env.local_world_size) for r in range(self.env.world_size)})
        found = audit.findings(
            records, backend=self.env.backend, requeue_signal=self.opts.requeue_signal, expected_hosts=expected_hosts
        )
        self.doc["layout"] = self.layout()
        self.doc["audit"] = {"records": records, "findings": found}
        self.emit(report.header_text(self.doc["layout"], self.doc["options"], self.doc["faults"]))
        self.emit("#\n" + report.audit_text(records, found) + "\n#")
        for f in found:
            if f.severity == "error":
                self.verdict.fail(f"[{f.code}] {f.message}", f.hosts if f.code in _NODE_FAULTS else ())

    def missing(self, joined: JoinResult) -> int:
        missing: list[dict[str, Any]] = [
            {"rank": r, "host": joined.expected_host(r, self.env.local_world_size)} for r in joined.missing
        ]
        self.doc["join"] = {"missing": missing, "waited_s": joined.waited_s}
        self.emit(report.missing_text(missing, joined.waited_s))
        ranks = report.rank_ranges(joined.missing)
        self.verdict.fail(f"rank(s) {ranks} never joined", [m["host"] for m in missing if " " not in m["host"]])
        return self.finish()

    def single(self, record: dict[str, Any]) -> int:
        self.doc["layout"] = self.layout()
        found = audit.findings([record], backend=self.env.backend, requeue_signal=self.opts.requeue_signal)
        self.doc["audit"] = {"records": [record], "findings": found}
        self.emit(report.header_text(self.doc["layout"], self.doc["options"], self.doc["faults"]))
        self.emit("#\n" + report.audit_text([record], found) + "\n#")
        for f in found:
            if f.severity == "error":
                self.verdict.fail(f"[{f.code}] {f.message}")
        result = device_health(self.env.torch_device())
        self.doc["health"] = [result]
        self.emit(report.health_text([result], self.hosts) + "\n#")
        if not result["ok"]:
            self.verdict.fail(
                f"device of rank 0 ({self.env.hostname}) is broken: {result['error']}", [self.env.hostname]
            )
        self.verdict.notes.append("one process: nothing to communicate with; use --nproc N, srun or torchrun")
        return self.finish()

    # ------------------------------------------------------------------------------------ distributed parts

    def step(self, name: str) -> Any:
        assert self.wd is not None
        return self.wd.step(name)

    def gather(self, name: str, value: Any) -> list[Any]:
        """Every rank's ``value`` on every rank, over the gloo control group."""
        out: list[Any] = [None] * self.env.world_size
        with self.step(f"gather {name}"):
            dist.all_gather_object(out, value, group=self.ctrl)
        return out

    def barrier(self, name: str) -> None:
        """monitored_barrier names the ranks that do not arrive (on rank 0); the watchdog is the backstop."""
        with self.step(f"monitored_barrier before {name}"):
            timeout = datetime.timedelta(seconds=self.opts.timeout_s)
            dist.monitored_barrier(group=self.ctrl, timeout=timeout, wait_all_ranks=True)

    def connect(self, store: dist.Store) -> None:
        env = self.env
        with self.step(f"init_process_group ({env.backend})"):
            if env.device.startswith("cuda"):
                torch.cuda.set_device(env.torch_device())
            dist.init_process_group(
                backend=env.backend,
                store=dist.PrefixStore("pg", store),
                rank=env.rank,
                world_size=env.world_size,
                # longer than the watchdog's, so a stuck collective is reported by us, not torn down by the backend
                timeout=datetime.timedelta(seconds=self.opts.timeout_s + 60),
            )
        with self.step("create groups"):
            # monitored_barrier and object gathers need gloo; with NCCL measured, they get a group of their own
            self.ctrl = dist.group.WORLD if env.backend == "gloo" else dist.new_group(backend="gloo")
            members = self.members()
            if len(members) > 1:
                for ranks in members.values():  # every rank creates every group, in the same order
                    group = dist.new_group(ranks)
                    if env.rank in ranks:
                        self.node_group = group

    def members(self) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for rank, host in enumerate(self.hosts):
            out.setdefault(host, []).append(rank)
        return out

    def health(self) -> None:
        with self.step("device health"):
            mine = device_health(self.env.torch_device())
        results = self.gather("device health", mine)
        if self.main_rank:
            self.doc["health"] = results
            self.emit(report.health_text(results, self.hosts) + "\n#")
            for rank, r in enumerate(results):
                if not r["ok"]:
                    self.verdict.fail(
                        f"device of rank {rank} ({self.hosts[rank]}) is broken: {r['error']}", [self.hosts[rank]]
                    )

    def scopes(self) -> list[tuple[str, dist.ProcessGroup, dict[str, list[int]]]]:
        members = self.members()
        world = dist.group.WORLD
        assert world is not None  # the process group exists by now
        if len(members) == 1:
            return [("intra-node", world, members)]
        sizes = {len(r) for r in members.values()}
        scopes = []
        if len(sizes) == 1 and sizes.pop() > 1 and self.node_group is not None:
            scopes.append(("intra-node", self.node_group, members))
        elif self.main_rank:
            self.verdict.notes.append("intra-node sweep skipped: nodes run different numbers of ranks, or one each")
        scopes.append(("inter-node", world, {"all hosts": list(range(self.env.world_size))}))
        return scopes

    def sweep(self) -> None:
        opts, env = self.opts, self.env
        sizes = message_sizes(opts.min_bytes, opts.max_bytes, opts.step_factor)
        dtype = DTYPES[opts.dtype]
        self.barrier("the sweep")
        self.faults.hang(env.rank, "sweep")
        for scope, group, groups in self.scopes():
            for op in opts.ops:
                local = sweep_op(
                    op,
                    group,
                    sizes,
                    dtype=dtype,
                    device=env.torch_device(),
                    iters=opts.iters,
                    warmup=opts.warmup,
                    rank=env.rank,
                    faults=self.faults,
                    step=self.scoped(scope),
                )
                per_rank = self.gather(f"{scope} {op}", local)
                if self.main_rank:
                    self.table(op, scope, groups, per_rank, dtype)
        if self.main_rank:
            bandwidth_checks(self.verdict, opts.expect, self.doc["sweep"])

    def scoped(self, scope: str) -> Callable[[str], Any]:
        return lambda name: self.step(f"{scope} {name}")

    def table(self, op: str, scope: str, groups: dict[str, list[int]], per_rank: list[Any], dtype: torch.dtype) -> None:
        by_host = {host: group_table(op, per_rank, ranks, dtype) for host, ranks in groups.items()}
        rows = next(iter(by_host.values())) if len(by_host) == 1 else _worst_rows(by_host)
        n = len(next(iter(groups.values())))
        describe = (
            f"{n} ranks on {next(iter(groups))}"
            if len(groups) == 1 and scope == "intra-node"
            else f"{len(groups)} nodes x {n} ranks, each node separately at once"
            if scope == "intra-node"
            else f"{self.env.world_size} ranks on {len(self.members())} hosts"
        )
        table = {"op": op, "scope": scope, "describe": describe, "rows": rows, "by_host": by_host}
        self.doc["sweep"].append(table)
        self.emit(report.sweep_text(table) + "\n#")
        wrong: dict[int, int] = {}
        for row in rows:
            for placement in ("out", "in"):
                for rank, count in row.get(placement, {}).get("wrong_by_rank", {}).items():
                    wrong[int(rank)] = wrong.get(int(rank), 0) + count
        if wrong:
            who = ", ".join(f"{c} on rank {r} ({self.hosts[r]})" for r, c in sorted(wrong.items()))
            self.verdict.fail(f"{op} ({scope}): wrong elements: {who}", [self.hosts[r] for r in wrong])

    def find_slow(self) -> None:
        opts = self.opts
        plan = finder.host_plan(self.hosts)
        if not plan:
            return
        with self.step("finder setup"):
            dist.barrier(group=self.ctrl)
        local = finder.measure(
            plan,
            rank=self.env.rank,
            nbytes=opts.finder_bytes,
            iters=opts.finder_iters,
            warmup=opts.finder_warmup,
            device=self.env.torch_device(),
            faults=self.faults,
            step=self.step,
        )
        per_rank = self.gather("finder", local)
        if not self.main_rank:
            return
        nbytes = max(opts.finder_bytes // 4, 1) * 4
        rank_pairs = finder.rank_pair_bandwidth(per_rank, nbytes)
        rank_out, rank_scores = finder.rank_outliers(rank_pairs, self.hosts, opts.slow_threshold)
        links = finder.host_link_bandwidth(per_rank, self.hosts, nbytes)
        host_out, host_scores, ambiguous = finder.host_outliers(links, opts.slow_threshold)
        outliers = rank_out + host_out
        result = {
            "bytes": nbytes,
            "iters": opts.finder_iters,
            "warmup": opts.finder_warmup,
            "threshold": opts.slow_threshold,
            "hosts": self.hosts,
            "rank_scores": {str(r): s for r, s in rank_scores.items()},
            "rank_pairs": rank_pairs,
            "host_scores": host_scores,
            "links": links,
            "outliers": outliers,
            "ambiguous": ambiguous,
            "exclude": finder.exclude_flag([o.host for o in outliers]),
            "transfers": per_rank,
        }
        self.doc["finder"] = result
        self.emit(report.finder_text(result) + "\n#")
        for o in outliers:
            self.verdict.fail(f"slow {o.kind} {o.name}: {o.detail}", [o.host])


def _worst_rows(by_host: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per size, the slowest node's numbers (what a job spanning them would see), with #wrong summed over nodes."""
    hosts = list(by_host)
    rows = []
    for i, base in enumerate(by_host[hosts[0]]):
        row = {k: v for k, v in base.items() if k not in ("out", "in")}
        row["ranks"] = [r for h in hosts for r in by_host[h][i]["ranks"]]
        total = {h: sum(by_host[h][i][p]["time_us"] for p in ("out", "in") if p in base) for h in hosts}
        row["worst_host"] = max(hosts, key=lambda h: total[h])
        for p in ("out", "in"):
            if p in base:
                res = dict(by_host[row["worst_host"]][i][p])
                res["wrong"] = sum(by_host[h][i][p]["wrong"] for h in hosts)
                res["wrong_by_rank"] = {r: w for h in hosts for r, w in by_host[h][i][p]["wrong_by_rank"].items()}
                res["time_us_by_rank"] = {r: t for h in hosts for r, t in by_host[h][i][p]["time_us_by_rank"].items()}
                row[p] = res
        rows.append(row)
    return rows
