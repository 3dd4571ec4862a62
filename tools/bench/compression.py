"""Gradient compression: PowerSGD against the uncompressed all-reduce, on real gloo ranks, in one invocation.

Part 1, convergence and communication share: the demo (configs/demo.yaml: tiny preset, this interpreter's standard
library as data, 200 steps by default) on ``--world`` (4) ranks, once with ``parallel.ddp.comm_hook=allreduce`` (fp32,
the same math as DDP's built-in all-reduce, measured through the hook) and once with ``powersgd`` (``--rank``,
start_iter 10, error feedback, warm start). Same data, same seed. Reported: the final evaluation loss (the demo's
held-out batches at the last step) and the mean training loss of the last 5 log steps, their relative gap (goal: within
3%), and the mean ``comm_bytes_per_step`` / ``comm_share`` the trainer logged after PowerSGD's warm-up.

Part 2, bytes on the wire for the 125m preset: 2 ranks, ``--big-steps`` steps at a tiny sequence length (bytes per
step depend on the parameter shapes only), fp32 all-reduce vs PowerSGD at ``--rank``: the bytes each rank handed to
all_reduce in the last step (counted at runtime by wrapping ``dist.all_reduce`` on the hook's own process group; a
ring all-reduce moves 2(n-1)/n times that per link). Goal: >= 10x less at rank 4.

    python tools/bench/compression.py                       # ~10 min on an idle 2-core CPU
    python tools/bench/compression.py --steps 60 --skip-big

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

from hpcdist import config as config_mod
from hpcdist.config import JobConfig
from hpcdist.env import DistEnv
from hpcdist.rundir import RunDir

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


def hook_overrides(hook: str, rank: int) -> list[str]:
    if hook != "powersgd":
        return [f"parallel.ddp.comm_hook={hook}"]
    return ["parallel.ddp.comm_hook=powersgd", f"parallel.ddp.powersgd.rank={rank}",
            "parallel.ddp.powersgd.start_iter=10"]  # fmt: skip


def convergence(a: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for hook in ("allreduce", "powersgd"):
        cfg = config_mod.load(str(REPO / "configs" / "demo.yaml"), [
            f"run.dir={tmp / hook}", f"data.path={tmp / 'data'}", f"train.steps={a.steps}",
            f"train.eval_every_steps={a.steps}", "checkpoint.every_steps=0", "checkpoint.save_final=false",
            "logging.tensorboard=false", "logging.straggler_every_steps=0", *hook_overrides(hook, a.rank),
        ])  # fmt: skip
        print(f"  {hook}: {a.steps} steps on {a.world} ranks ...", flush=True)
        evals, metrics = run(a.world, cfg)
        logged = [m for m in metrics if "loss" in m and "lr" in m]
        after = [m for m in logged if m["step"] > 10 and "comm_share" in m]  # after PowerSGD's warm-up
        out[hook] = {
            "eval_loss": evals[max(evals)], "last5_train_loss": statistics.mean(m["loss"] for m in logged[-5:]),
            "comm_bytes_per_step": statistics.mean(m["comm_bytes_per_step"] for m in after),
            "comm_share": statistics.mean(m["comm_share"] for m in after),
            "step_time_s": statistics.median(m["step_time_s"] for m in after),
            "losses": {m["step"]: m["loss"] for m in logged},
        }  # fmt: skip
    ref, comp = out["allreduce"], out["powersgd"]
    out["eval_gap"] = (comp["eval_loss"] - ref["eval_loss"]) / ref["eval_loss"]
    out["train_gap"] = (comp["last5_train_loss"] - ref["last5_train_loss"]) / ref["last5_train_loss"]
    out["ratio"] = ref["comm_bytes_per_step"] / comp["comm_bytes_per_step"]
    return out


def big(a: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for hook in ("allreduce", "powersgd"):
        cfg = config_mod.load(None, [
            "model.preset=125m", "data.source=synthetic", "data.synthetic_samples=64", "data.seq_len=16",
            f"run.dir={tmp / ('big-' + hook)}", f"train.steps={a.big_steps}", "train.global_batch_size=2",
            "train.micro_batch_size=1", "checkpoint.every_steps=0", "checkpoint.save_final=false",
            "logging.every_steps=1", "logging.tensorboard=false", "logging.straggler_every_steps=0",
            "train.eval_every_steps=0", "data.val_fraction=0", "optim.warmup_steps=1",
            *hook_overrides(hook, a.rank), "parallel.ddp.powersgd.start_iter=2",
        ])  # fmt: skip
        print(f"  125m {hook}: {a.big_steps} steps on 2 ranks ...", flush=True)
        _, metrics = run(2, cfg)
        per_step = [m["comm_bytes_per_step"] for m in metrics if "comm_bytes_per_step" in m]
        out[hook] = {"bytes_per_step": per_step}
    out["ratio"] = out["allreduce"]["bytes_per_step"][-1] / out["powersgd"]["bytes_per_step"][-1]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--rank", type=int, default=4, help="parallel.ddp.powersgd.rank")
    p.add_argument("--big-steps", type=int, default=3, help="125m steps (PowerSGD compresses from step 3)")
    p.add_argument("--skip-big", action="store_true")
    p.add_argument("--skip-convergence", action="store_true")
    p.add_argument("--json", type=Path, default=Path("runs/bench/compression.json"))
    a = p.parse_args(argv)
    print(f"{os.cpu_count()} CPU core(s), 1-min load {os.getloadavg()[0]:.2f} at the start", flush=True)
    result: dict[str, Any] = {"load_start": os.getloadavg()[0], "args": vars(a) | {"json": str(a.json)}}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        if not a.skip_convergence:
            c = result["convergence"] = convergence(a, tmp)
            rows = [["", "eval loss", "train loss (last 5 logs)", "comm MB/step", "comm share", "step s"]]
            for hook in ("allreduce", "powersgd"):
                h = c[hook]
                rows.append([hook, f"{h['eval_loss']:.4f}", f"{h['last5_train_loss']:.4f}",
                             f"{h['comm_bytes_per_step'] / 1e6:.3f}", f"{100 * h['comm_share']:.1f}%",
                             f"{h['step_time_s']:.3f}"])  # fmt: skip
            print(f"\ndemo, {a.world} ranks, {a.steps} steps, PowerSGD rank {a.rank}:")
            print(_table(rows))
            verdict = "PASS" if abs(c["eval_gap"]) <= 0.03 else "MISS"
            print(f"eval-loss gap {100 * c['eval_gap']:+.2f}% (goal within 3%: {verdict}), train-loss gap "
                  f"{100 * c['train_gap']:+.2f}%, bytes ratio {c['ratio']:.1f}x")  # fmt: skip
        if not a.skip_big:
            b = result["big"] = big(a, tmp)
            fp32, comp = b["allreduce"]["bytes_per_step"][-1], b["powersgd"]["bytes_per_step"][-1]
            print("\n125m, 2 ranks, bytes handed to all_reduce per step per rank (last step):")
            print(_table([["fp32 all-reduce", "PowerSGD rank " + str(a.rank), "ratio"],
                          [f"{fp32 / 1e6:.2f} MB", f"{comp / 1e6:.3f} MB", f"{b['ratio']:.1f}x"]]))  # fmt: skip
            print(f"goal >= 10x: {'PASS' if b['ratio'] >= 10 else 'MISS'}")
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
