"""Gradient compression: PowerSGD against the uncompressed all-reduce, on real gloo ranks, in one invocation.

Part 1, convergence and communication share: the demo (configs/demo.yaml: tiny preset, this interpreter's standard
library as data, 200 steps by default) on ``--world`` (4) ranks, once with ``parallel.ddp.comm_hook=allreduce`` (fp32,
the same math as DDP's built-in all-reduce, measured through the hook) and once per PowerSGD setting: every pair of
``--rank`` x ``--start-iter`` (comma-separated lists; error feedback, warm start). Same data, same seed, one fp32 run
shared by all settings (or taken from an earlier ``--json`` with ``--baseline``). Reported per setting: the final
evaluation loss (the demo's held-out batches at the last step) and the mean training loss of the last 5 log steps,
their relative gaps to fp32 (goal: within 3%), the mean ``comm_bytes_per_step`` / ``comm_share`` the trainer logged
after PowerSGD's warm-up, and the 1-minute load when the run started. ``--seed-noise N`` adds an fp32 run with
``run.seed=N``: the gap a different seed alone makes, the yardstick for the others.

Part 2, bytes on the wire for the 125m preset: 2 ranks, ``--big-steps`` steps at a tiny sequence length (bytes per
step depend on the parameter shapes only), fp32 all-reduce vs PowerSGD at each ``--rank``: the bytes each rank handed
to all_reduce in the last step (counted at runtime by wrapping ``dist.all_reduce`` on the hook's own process group; a
ring all-reduce moves 2(n-1)/n times that per link). Goal: >= 10x less at rank 4.

    python tools/bench/compression.py                       # ~10 min on an idle 2-core CPU
    python tools/bench/compression.py --steps 60 --skip-big
    python tools/bench/compression.py --rank 8,12 --start-iter 50,100 --skip-big

Prints two tables and writes ``--json`` (default runs/bench/compression.json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: hpcdist, tests.dist.harness


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--rank", type=_ints, default=[4], help="parallel.ddp.powersgd.rank, comma-separated: 4,8,16")
    p.add_argument("--start-iter", type=_ints, default=[10], help="parallel.ddp.powersgd.start_iter, comma-separated")
    p.add_argument("--baseline", type=Path, help="reuse the fp32 run of an earlier --json (same --world, --steps)")
    p.add_argument("--seed-noise", type=int, help="also run fp32 with this run.seed: the gap seeds alone make")
    p.add_argument("--big-steps", type=int, default=3, help="125m steps (PowerSGD compresses from step 3)")
    p.add_argument("--skip-big", action="store_true")
    p.add_argument("--skip-convergence", action="store_true")
    p.add_argument("--json", type=Path, default=Path("runs/bench/compression.json"))
    return p


if __name__ == "__main__":
    # --help and a bad flag answer here, before torch (and hpcdist's trainer) is imported: seconds on a
    # busy node. main() parses again; that costs nothing.
    build_parser().parse_args()


from hpcdist import config as config_mod  # noqa: E402
from hpcdist.base.rundir import RunDir  # noqa: E402
from hpcdist.config import JobConfig  # noqa: E402
from hpcdist.env import DistEnv  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def _train(env: DistEnv, cfg: JobConfig) -> dict[int, float]:
    from hpcdist.trainer import Trainer

    result = Trainer(cfg, env).train()
    return result.eval_losses


def run(world: int, cfg: JobConfig) -> tuple[dict[int, float], list[dict[str, Any]]]:
    from tests.dist.harness import run_ranks

    evals = run_ranks(world, _train, cfg, timeout=3600)[0]
    metrics = [json.loads(line) for line in RunDir(cfg.run.dir).metrics.read_text().splitlines()]
    return evals, metrics


def hook_overrides(hook: str, rank: int = 4, start_iter: int = 10) -> list[str]:
    if hook != "powersgd":
        return [f"parallel.ddp.comm_hook={hook}"]
    return [
        "parallel.ddp.comm_hook=powersgd",
        f"parallel.ddp.powersgd.rank={rank}",
        f"parallel.ddp.powersgd.start_iter={start_iter}",
    ]


def settings(a: argparse.Namespace) -> list[tuple[int, int]]:
    """(rank, start_iter) for every PowerSGD run: the cross product of --rank and --start-iter."""
    return [(r, s) for r in a.rank for s in a.start_iter]


def demo_run(a: argparse.Namespace, tmp: Path, name: str, overrides: list[str], start: int) -> dict[str, Any]:
    cfg = config_mod.load(
        str(REPO / "configs" / "demo.yaml"),
        [
            f"run.dir={tmp / name}",
            f"data.path={tmp / 'data'}",
            f"train.steps={a.steps}",
            f"train.eval_every_steps={a.steps}",
            "checkpoint.every_steps=0",
            "checkpoint.save_final=false",
            "logging.tensorboard=false",
            "logging.straggler_every_steps=0",
            *overrides,
        ],
    )
    load = os.getloadavg()[0]
    print(f"  {name}: {a.steps} steps on {a.world} ranks (1-min load {load:.2f}) ...", flush=True)
    evals, metrics = run(a.world, cfg)
    logged = [m for m in metrics if "loss" in m and "lr" in m]
    after = [m for m in logged if m["step"] > start and "comm_share" in m]  # after PowerSGD's warm-up
    return {
        "eval_loss": evals[max(evals)],
        "last5_train_loss": statistics.mean(m["loss"] for m in logged[-5:]),
        "comm_bytes_per_step": statistics.mean(m["comm_bytes_per_step"] for m in after),
        "comm_share": statistics.mean(m["comm_share"] for m in after),
        "step_time_s": statistics.median(m["step_time_s"] for m in after),
        "losses": {m["step"]: m["loss"] for m in logged},
        "load": load,
    }


def baseline(a: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """The fp32 all-reduce run, or the one saved by an earlier invocation (--baseline JSON) with the same world
    size and steps: the demo's data and seed are fixed, so it is the same run (gloo's fp32 sums are deterministic)."""
    if a.baseline is None:
        return demo_run(a, tmp, "allreduce", hook_overrides("allreduce"), max(s for _, s in settings(a)))
    saved = json.loads(a.baseline.read_text())
    for key in ("world", "steps"):
        if saved["args"][key] != getattr(a, key):
            sys.exit(
                f"--baseline {a.baseline}: it ran with {key}={saved['args'][key]}, this run asks for "
                f"{getattr(a, key)}; drop --baseline or match --{key}"
            )
    print(f"  allreduce: reused from {a.baseline}", flush=True)
    return saved["convergence"]["allreduce"]


def convergence(a: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    # with --baseline the saved fp32 run is read after the PowerSGD runs: an invocation running beside the one
    # that writes it can start at once
    ref = baseline(a, tmp) if a.baseline is None else None
    runs = {
        f"r{r}-s{s}": demo_run(a, tmp, f"powersgd-r{r}-s{s}", hook_overrides("powersgd", r, s), s)
        | {"rank": r, "start_iter": s}
        for r, s in settings(a)
    }
    if a.seed_noise is not None:  # the yardstick: how far an uncompressed run with another seed lands
        name = f"allreduce-seed{a.seed_noise}"
        over = [*hook_overrides("allreduce"), f"run.seed={a.seed_noise}"]
        runs[name] = demo_run(a, tmp, name, over, 10) | {"rank": None, "start_iter": None, "seed": a.seed_noise}
    ref = ref or baseline(a, tmp)
    for comp in runs.values():
        comp["eval_gap"] = (comp["eval_loss"] - ref["eval_loss"]) / ref["eval_loss"]
        comp["train_gap"] = (comp["last5_train_loss"] - ref["last5_train_loss"]) / ref["last5_train_loss"]
        comp["ratio"] = ref["comm_bytes_per_step"] / comp["comm_bytes_per_step"]
    return {"allreduce": ref, "powersgd": runs}


def big(a: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    runs = [("allreduce", 0)] + [("powersgd", r) for r in a.rank]
    for hook, rank in runs:
        name = hook if hook == "allreduce" else f"powersgd-r{rank}"
        cfg = config_mod.load(
            None,
            [
                "model.preset=125m",
                "data.source=synthetic",
                "data.synthetic_samples=64",
                "data.seq_len=16",
                f"run.dir={tmp / ('big-' + name)}",
                f"train.steps={a.big_steps}",
                "train.global_batch_size=2",
                "train.micro_batch_size=1",
                "checkpoint.every_steps=0",
                "checkpoint.save_final=false",
                "logging.every_steps=1",
                "logging.tensorboard=false",
                "logging.straggler_every_steps=0",
                "train.eval_every_steps=0",
                "data.val_fraction=0",
                "optim.warmup_steps=1",
                *hook_overrides(hook, rank, 2),
            ],
        )
        print(f"  125m {name}: {a.big_steps} steps on 2 ranks ...", flush=True)
        _, metrics = run(2, cfg)
        out[name] = {"bytes_per_step": [m["comm_bytes_per_step"] for m in metrics if "comm_bytes_per_step" in m]}
    for rank in a.rank:
        out[f"powersgd-r{rank}"]["ratio"] = (
            out["allreduce"]["bytes_per_step"][-1] / out[f"powersgd-r{rank}"]["bytes_per_step"][-1]
        )
    return out


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    print(f"{os.cpu_count()} CPU core(s), 1-min load {os.getloadavg()[0]:.2f} at the start", flush=True)
    result: dict[str, Any] = {
        "load_start": os.getloadavg()[0],
        "args": vars(a) | {"json": str(a.json), "baseline": str(a.baseline)},
    }
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        if not a.skip_convergence:
            c = result["convergence"] = convergence(a, tmp)
            ref = c["allreduce"]
            rows = [
                [
                    "",
                    "comm MB/step",
                    "bytes ratio",
                    "eval loss",
                    "eval gap",
                    "train loss (last 5 logs)",
                    "train gap",
                    "comm share",
                    "step s",
                    "load",
                ],
                [
                    "fp32 all-reduce",
                    f"{ref['comm_bytes_per_step'] / 1e6:.3f}",
                    "1x",
                    f"{ref['eval_loss']:.4f}",
                    "",
                    f"{ref['last5_train_loss']:.4f}",
                    "",
                    f"{100 * ref['comm_share']:.1f}%",
                    f"{ref['step_time_s']:.3f}",
                    f"{ref.get('load', float('nan')):.1f}",
                ],
            ]
            for h in c["powersgd"].values():
                ok = max(abs(h["eval_gap"]), abs(h["train_gap"])) <= 0.03 and h["ratio"] >= 10
                verdict = "PASS" if ok else "MISS"
                label = f"PowerSGD rank {h['rank']} start_iter {h['start_iter']}"
                if h["rank"] is None:
                    label, verdict = f"fp32 all-reduce, run.seed={h['seed']}", "(seed noise)"
                rows.append(
                    [
                        label,
                        f"{h['comm_bytes_per_step'] / 1e6:.3f}",
                        f"{h['ratio']:.1f}x",
                        f"{h['eval_loss']:.4f}",
                        f"{100 * h['eval_gap']:+.2f}%",
                        f"{h['last5_train_loss']:.4f}",
                        f"{100 * h['train_gap']:+.2f}% {verdict}",
                        f"{100 * h['comm_share']:.1f}%",
                        f"{h['step_time_s']:.3f}",
                        f"{h['load']:.1f}",
                    ]
                )
            print(f"\ndemo, {a.world} ranks, {a.steps} steps (goal: both gaps within 3% at >= 10x fewer bytes):")
            print(_table(rows))
        if not a.skip_big:
            b = result["big"] = big(a, tmp)
            fp32 = b["allreduce"]["bytes_per_step"][-1]
            rows = [
                ["125m, 2 ranks", "bytes/step/rank (last step)", "ratio"],
                ["fp32 all-reduce", f"{fp32 / 1e6:.2f} MB", "1x"],
            ]
            for rank in a.rank:
                h = b[f"powersgd-r{rank}"]
                rows.append(
                    [
                        f"PowerSGD rank {rank}",
                        f"{h['bytes_per_step'][-1] / 1e6:.3f} MB",
                        f"{h['ratio']:.1f}x {'PASS' if h['ratio'] >= 10 else 'MISS'}",
                    ]
                )
            print("\n125m, 2 ranks, bytes handed to all_reduce per step per rank (goal >= 10x):")
            print(_table(rows))
    result["load_end"] = os.getloadavg()[0]
    print(f"1-min load {result['load_end']:.2f} at the end")
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(result, indent=1))
    print(f"json: {a.json}")
    return 0


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows)


if __name__ == "__main__":
    sys.exit(main())
