"""The report's figures, drawn with matplotlib (an optional extra: ``pip install 'hpcdist[plot]'``).

Each function takes the run's records and returns a Figure, or None when the run has nothing to draw for it yet (a
run that has not logged a step has no loss curve): the page then says so instead of showing an empty frame.
"""

from __future__ import annotations

import datetime as _dt
from pathlib import Path
from typing import Any

from hpcdist.report.rundata import RunData

__all__ = ["GOODPUT_COLORS", "MissingMatplotlib", "figures", "import_pyplot", "save_png"]

# train / checkpoint / restore / startup / lost / queue / other, in the goodput ledger's order
GOODPUT_COLORS = {
    "train": "#2ca02c",
    "checkpoint_save": "#1f77b4",
    "restore": "#17becf",
    "startup": "#9467bd",
    "lost": "#d62728",
    "queue_wait": "#7f7f7f",
    "other": "#bcbd22",
}


class MissingMatplotlib(RuntimeError):
    """matplotlib is not installed; the message says how to install it."""


def import_pyplot() -> Any:
    """pyplot on the Agg backend (files only, no display on a login node), or MissingMatplotlib."""
    try:
        import matplotlib
    except ImportError:
        raise MissingMatplotlib(
            "matplotlib is not installed: pip install 'hpcdist[plot]' (or pip install 'matplotlib>=3.7')"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_png(fig: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=100, bbox_inches="tight")
    import_pyplot().close(fig)
    return path


def _xy(records: list[dict[str, Any]], x: str, y: str) -> tuple[list[float], list[float]]:
    pts = [(r[x], r[y]) for r in records if isinstance(r.get(x), (int, float)) and isinstance(r.get(y), (int, float))]
    return [p[0] for p in pts], [p[1] for p in pts]


def _attempt_lines(ax: Any, data: RunData) -> None:
    """A dashed line where each attempt after the first resumed (its first step)."""
    for a in data.attempts[1:]:
        ax.axvline(a.first_step, color="#999999", linestyle="--", linewidth=0.8)
        ax.annotate(
            f"attempt {a.number}",
            (a.first_step, 1),
            xycoords=("data", "axes fraction"),
            fontsize=7,
            rotation=90,
            va="top",
            ha="right",
            color="#666666",
        )


def loss(data: RunData) -> Any:
    if not data.train:
        return None
    plt = import_pyplot()
    fig, (by_step, by_tokens) = plt.subplots(1, 2, figsize=(11, 3.8))
    steps, train = _xy(data.train, "step", "loss")
    by_step.plot(steps, train, label="train")
    ev_steps, ev = _xy(data.eval, "step", "loss")
    if ev:
        by_step.plot(ev_steps, ev, "o-", label="eval")
    _attempt_lines(by_step, data)
    by_step.set(xlabel="step", ylabel="loss", title="loss vs step")
    tokens, train_t = _xy(data.train, "tokens_seen", "loss")
    by_tokens.plot(tokens, train_t, label="train")
    if ev and tokens:
        # eval records carry no token count: the train record of the same step has it
        seen = {r["step"]: r.get("tokens_seen") for r in data.train}
        pts = [(seen[s], v) for s, v in zip(ev_steps, ev, strict=True) if isinstance(seen.get(s), (int, float))]
        if pts:
            by_tokens.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label="eval")
    by_tokens.set(xlabel="tokens seen", ylabel="loss", title="loss vs tokens")
    for ax in (by_step, by_tokens):
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    return fig


def throughput(data: RunData) -> Any:
    steps, tps = _xy(data.train, "step", "tokens_per_s")
    if not tps:
        return None
    plt = import_pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
    left.plot(steps, tps)
    left.set(xlabel="step", ylabel="tokens/s (all ranks)", title="throughput")
    m_steps, m = _xy(data.train, "step", "mfu")
    right.plot(m_steps, [100 * v for v in m], color="#ff7f0e")
    right.set(xlabel="step", ylabel="MFU %", title="model FLOPs utilisation")
    for ax in (left, right):
        _attempt_lines(ax, data)
        ax.grid(alpha=0.3)
    return fig


def memory(data: RunData) -> Any:
    """Rank 0's memory per logged step (metrics.jsonl), and every rank's peak where the records have it."""
    keys = [k for k in ("mem_reserved_gib", "mem_alloc_gib", "mem_rss_gib") if any(k in r for r in data.train)]
    per_rank = [r for r in data.stragglers if isinstance(r.get("mem_gib_per_rank"), list)]
    if not keys and not per_rank:
        return None
    plt = import_pyplot()
    fig, axes = plt.subplots(1, 2 if per_rank else 1, figsize=(11 if per_rank else 6, 3.8), squeeze=False)
    ax = axes[0][0]
    for k in keys:
        steps, v = _xy(data.train, "step", k)
        ax.plot(steps, v, label=k.removeprefix("mem_").replace("_gib", "") + " (rank 0)")
    ax.set(xlabel="step", ylabel="GiB", title="memory (rank 0)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    if per_rank:
        last = per_rank[-1]["mem_gib_per_rank"]
        bar = axes[0][1]
        bar.bar(range(len(last)), last)
        bar.set(xlabel="rank", ylabel="GiB", title=f"memory per rank (step {per_rank[-1]['step']})")
    return fig


def goodput(data: RunData) -> Any:
    """One stacked bar per attempt (train / checkpoint / restore / startup / lost / other), queue wait before it."""
    if not data.attempts:
        return None
    plt = import_pyplot()
    fig, ax = plt.subplots(figsize=(7, 0.9 + 0.55 * len(data.attempts)))
    prev_end = None
    for a in data.attempts:
        parts = dict(a.seconds)
        parts["queue_wait"] = max(0.0, a.start - prev_end) if prev_end is not None else 0.0
        rest = max(0.0, (a.end - a.start) - sum(a.seconds.values()))
        parts["other" if a.clean else "lost"] += rest  # as goodput.summarize counts an unclean end
        prev_end = a.end
        left = 0.0
        for key in ("queue_wait", "startup", "restore", "train", "checkpoint_save", "lost", "other"):
            width = parts.get(key, 0.0)
            label = key.replace("_", " ") if width > 0 else None  # the legend keeps one entry per category
            ax.barh(a.number, width, left=left, color=GOODPUT_COLORS[key], label=label)
            left += width
    ax.invert_yaxis()
    ax.set_yticks([a.number for a in data.attempts], [f"attempt {a.number}" for a in data.attempts])
    g = data.goodput.get("goodput", 0.0)
    ax.set(xlabel="seconds", title=f"goodput {100 * g:.1f}% over {len(data.attempts)} attempt(s)")
    handles, labels = ax.get_legend_handles_labels()
    seen: dict[str, Any] = {}
    for h, lab in zip(handles, labels, strict=True):
        seen.setdefault(lab, h)
    ax.legend(seen.values(), seen.keys(), fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=7)
    return fig


def _time(t: float) -> Any:
    return _dt.datetime.fromtimestamp(t)


def timeline(data: RunData) -> Any:
    """Attempts as spans on a wall-clock axis, failures and stragglers as marks at their time."""
    if not data.attempts and not data.failures:
        return None
    plt = import_pyplot()
    fig, ax = plt.subplots(figsize=(11, 2.8))
    for a in data.attempts:
        color = "#2ca02c" if a.clean else "#d62728"
        ax.plot([_time(a.start), _time(a.end)], [1, 1], linewidth=8, color=color, solid_capstyle="butt")
        # a killed attempt may not have flushed its last step (goodput.json is written at most once a second)
        steps = f"{a.first_step}-{a.last_step}" if a.last_step is not None else f"from {a.first_step}"
        ax.annotate(f"attempt {a.number}: steps {steps}", (_time(a.start), 1.15), fontsize=7)
    kinds = sorted({str(f.get("kind")) for f in data.failures if isinstance(f.get("time"), (int, float))})
    markers = "xv^sDo*"
    for i, kind in enumerate(kinds):
        ts = [
            _time(f["time"])
            for f in data.failures
            if str(f.get("kind")) == kind and isinstance(f.get("time"), (int, float))
        ]
        ax.scatter(ts, [0.5] * len(ts), marker=markers[i % len(markers)], s=60, label=f"{kind} ({len(ts)})")
    ax.margins(x=0.1)  # room for the last attempt's label
    # the SLURM restart ledger: when each restart of the job started, and how it ended (requeued for what)
    ledger = data.restarts.get("attempts") if isinstance(data.restarts.get("attempts"), dict) else {}
    for key, entry in sorted(ledger.items(), key=lambda kv: int(kv[0]) if str(kv[0]).isdigit() else 0):
        if isinstance(entry, dict) and isinstance(entry.get("start"), (int, float)):
            ax.scatter([_time(entry["start"])], [0.75], marker="|", s=200, color="#333333")
            how = entry.get("requeued") or entry.get("ended") or ""
            ax.annotate(f"restart {key} {how}".strip(), (_time(entry["start"]), 0.8), fontsize=7)
    ax.set_yticks([1, 0.75, 0.5], ["attempts", "SLURM restarts", "failures"])
    ax.set_ylim(0.2, 1.4)
    ax.set(title="attempts and failures", xlabel="time")
    if kinds:
        ax.legend(fontsize=8, loc="lower right")
    fig.autofmt_xdate()
    return fig


def stragglers(data: RunData) -> Any:
    """The straggler checks' worst rank / median ratios over the run (1.0 = no rank slower than the others)."""
    if not data.stragglers:
        return None
    plt = import_pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.2))
    for key in ("data_ratio", "compute_ratio"):
        steps, v = _xy(data.stragglers, "step", key)
        ax.plot(steps, v, "o-", label=key.replace("_", " "))
    steps, n = _xy(data.stragglers, "step", "count")
    for s, c in zip(steps, n, strict=True):
        if c:
            ax.annotate(f"{int(c)} slow", (s, 1), fontsize=7, color="#d62728")
    ax.axhline(1.0, color="#999999", linewidth=0.8)
    ax.set(xlabel="step", ylabel="slowest / median", title="stragglers")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return fig


# file stem -> (title, figure function); the page shows them in this order
FIGURES = {
    "loss": ("Loss", loss),
    "throughput": ("Throughput and MFU", throughput),
    "memory": ("Memory", memory),
    "goodput": ("Goodput by attempt", goodput),
    "timeline": ("Attempts, restarts and failures", timeline),
    "stragglers": ("Stragglers", stragglers),
}


def figures(data: RunData, out_dir: Path) -> dict[str, Path | None]:
    """Draw every figure that has data into ``out_dir/<name>.png``; None for the ones without data."""
    out: dict[str, Path | None] = {}
    for name, (_, draw) in FIGURES.items():
        fig = draw(data)
        out[name] = save_png(fig, out_dir / f"{name}.png") if fig is not None else None
    return out
