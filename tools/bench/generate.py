"""Generation speed on CPU: KV cache against re-running the whole sequence per token (``hpcdist generate --no-cache``).

For each preset (default ``tiny`` and ``125m``, randomly initialized: speed does not depend on the weights), the
same prompt of ``--prompt-tokens`` random ids is continued greedily by ``--new-tokens`` tokens with
``hpcdist.models.generation.generate``, with and without the cache, alternating (cache, no cache, no cache, cache,
...) for ``--repeats`` pairs so the machine's load drift hits both sides alike. Both sides must produce the same
tokens (exit 1 otherwise). Tokens/s counts new tokens over the whole call (prefill included); the ratio is cache /
no cache of the medians. The last line says how many cores other processes kept busy meanwhile.

    python tools/bench/generate.py                                   # tiny and 125m, ~2 min on a busy 2-core box
    python tools/bench/generate.py --presets tiny --new-tokens 128 --repeats 5
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", default="tiny,125m", help="comma-separated model presets (default tiny,125m)")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="cache / no-cache pairs per preset")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--json", type=Path, default=Path("runs/bench/generate.json"))
    return p


if __name__ == "__main__":
    # --help and a bad flag answer here, before torch (and hpcdist's trainer) is imported: seconds on a
    # busy node. main() parses again; that costs nothing.
    build_parser().parse_args()


import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hpcdist.models.args import ModelArgs, load_preset, num_params  # noqa: E402
from hpcdist.models.generation import generate  # noqa: E402
from hpcdist.models.llama import build_model  # noqa: E402
from tools.bench.overhead import CpuShare, machine, table  # noqa: E402


def bench_preset(preset: str, a: argparse.Namespace) -> dict[str, Any]:
    args = ModelArgs(**load_preset(preset))
    torch.manual_seed(0)
    model = build_model(args, device="cpu").eval()
    prompt = torch.randint(0, args.vocab_size, (a.prompt_tokens,), generator=torch.Generator().manual_seed(1)).tolist()
    times: dict[bool, list[float]] = {True: [], False: []}
    outputs: dict[bool, list[int]] = {}
    generate(model, prompt, max_new_tokens=2)  # warm-up (allocator, kernels)
    for i in range(a.repeats):
        for use_cache in (True, False) if i % 2 == 0 else (False, True):
            t0 = time.perf_counter()
            res = generate(model, prompt, max_new_tokens=a.new_tokens, use_cache=use_cache)
            times[use_cache].append(time.perf_counter() - t0)
            outputs[use_cache] = res.tokens
    if outputs[True] != outputs[False]:
        raise SystemExit(f"{preset}: the cached and uncached greedy outputs differ")
    med = {k: statistics.median(v) for k, v in times.items()}
    n = len(outputs[True])
    return {
        "preset": preset,
        "params": num_params(args),
        "new_tokens": n,
        "cache_tokens_per_s": n / med[True],
        "no_cache_tokens_per_s": n / med[False],
        "ratio": med[False] / med[True],
        "seconds": {"cache": times[True], "no_cache": times[False]},
    }


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    rows = [["preset", "params", "new tokens", "cache tok/s", "no cache tok/s", "cache / no cache"]]
    results = []
    with CpuShare() as load:
        for preset in a.presets.split(","):
            r = bench_preset(preset.strip(), a)
            results.append(r)
            speeds = [f"{r['cache_tokens_per_s']:.1f}", f"{r['no_cache_tokens_per_s']:.1f}", f"{r['ratio']:.2f}x"]
            print(
                f"{r['preset']}: cache {speeds[0]} tok/s, no cache {speeds[1]} tok/s ({speeds[2]})",
                file=sys.stderr,
                flush=True,
            )
            rows.append([r["preset"], f"{r['params'] / 1e6:.1f}M", str(r["new_tokens"]), *speeds])
    print(f"greedy generation, prompt {a.prompt_tokens} tokens, fp32, {torch.get_num_threads()} threads")
    print(table(rows))
    print(f"CPU used by other processes meanwhile: {load.others:.2f} cores of {machine()['cpu_count']}")
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(
        json.dumps(
            {
                "when": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                "machine": machine(),
                "args": vars(a) | {"json": str(a.json)},
                "other_processes_cores": load.others,
                "results": results,
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
