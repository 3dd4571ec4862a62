"""`hpcdist report RUN_DIR`: one self-contained HTML page (every PNG embedded as base64) plus the PNGs themselves.

The page opens from a mail attachment or a copied file on a laptop with nothing else: no script, no stylesheet
or image fetched from anywhere. Tables are written here with the standard library; only the figures need
matplotlib (hpcdist.report.plots).
"""

from __future__ import annotations

import base64
import datetime as _dt
import html
import os
from pathlib import Path
from typing import Any

from hpcdist.checkpoint.cadence import every_minutes
from hpcdist.fault.goodput import RECOVERY_PARTS
from hpcdist.report.prediction import predict_run
from hpcdist.report.rundata import RunData

__all__ = ["render_page", "write_report"]

_STYLE = """body{font-family:system-ui,sans-serif;margin:2em;max-width:1200px;color:#222}
table{border-collapse:collapse;margin:.5em 0 1.5em}td,th{border:1px solid #ccc;padding:3px 8px;text-align:left;
font-size:13px}th{background:#f3f3f3}img{max-width:100%}pre{background:#f7f7f7;padding:1em;font-size:12px;
overflow:auto}.bad{color:#b00}.none{color:#888;font-style:italic}"""


def _when(t: Any) -> str:
    """A record's wall time as a local date; "?" for none, or for a value that is no time (a damaged record)."""
    if not isinstance(t, (int, float)) or isinstance(t, bool):
        return "?"
    try:
        return _dt.datetime.fromtimestamp(t).isoformat(sep=" ", timespec="seconds")
    except (OverflowError, OSError, ValueError):
        return "?"


def _table(header: list[str], rows: list[list[Any]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _summary(data: RunData) -> str:
    last = data.train[-1] if data.train else {}
    best = min((r["loss"] for r in data.eval if isinstance(r.get("loss"), (int, float))), default=None)
    g = data.goodput
    rows = [
        ["last logged step", last.get("step", "none yet")],
        ["tokens seen", f"{int(last['tokens_seen']):,}" if isinstance(last.get("tokens_seen"), (int, float)) else "?"],
        ["last train loss", f"{last['loss']:.4f}" if isinstance(last.get("loss"), (int, float)) else "?"],
        ["best eval loss", f"{best:.4f}" if best is not None else "no evaluation yet"],
        ["attempts", len(data.attempts)],
        ["goodput", f"{100 * g['goodput']:.1f}% of {g['total_s']:.1f} s" if g else "no goodput ledger"],
        ["failures recorded", sum(1 for f in data.failures if f.get("kind") != "straggler")],
        ["newest shared checkpoint", data.checkpoints.get("shared_step", "none")],
    ]
    if "local_step" in data.checkpoints:  # the node-local tier (checkpoint.local)
        copies = "with peer copies" if data.checkpoints.get("local_copies") else "no peer copies"
        rows.append(["newest node-local step", f"{data.checkpoints['local_step']} ({copies})"])
    if data.summary:
        rows.append(["run_summary.json", ", ".join(f"{k}={v}" for k, v in data.summary.items() if k != "time")])
    return _table(["", ""], rows)


def _attempts(data: RunData) -> str:
    if not data.attempts:
        return '<p class="none">no goodput.json: the run has not started its training loop yet</p>'
    keys = list(data.attempts[0].seconds)
    rows = [
        [
            f"attempt {a.number}",
            _when(a.start),
            _when(a.end),
            f"{a.first_step}-{a.last_step}" if a.last_step is not None else f"from {a.first_step}",
            a.outcome,
            *(f"{a.seconds[k]:.1f}" for k in keys),
        ]
        for a in data.attempts
    ]
    table = _table(["attempt", "start", "end (or last seen)", "steps", "outcome", *(f"{k} s" for k in keys)], rows)
    return table + _recoveries(data)


def _recoveries(data: RunData) -> str:
    """Recovery after each failure or requeue: from the failure to the next completed step, split (goodput.json)."""
    recs = [(a.number, a.recovery) for a in data.attempts if a.recovery]
    if not recs:
        return ""
    parts = list(RECOVERY_PARTS)

    def sec(value: Any) -> str:
        return f"{value:.1f}" if isinstance(value, (int, float)) else ""

    rows = [[f"attempt {n}", r.get("path", ""), sec(r.get("total")), *(sec(r.get(k)) for k in parts)] for n, r in recs]
    header = ["recovery", "path", "total s", *(f"{k.replace('_', ' ')} s" for k in parts)]
    return _table(header, rows)


def _percent(x: float) -> str:
    return f"{100 * x:.2f}%"


def _goodput_prediction(data: RunData) -> str:
    """The run's measured goodput beside the goodput model's prediction from the run's measured inputs."""
    g = data.goodput
    if not g or not g.get("total_s"):
        return '<p class="none">no goodput.json: nothing measured yet</p>'
    total = g["total_s"]
    restart = g.get("restore", 0.0) + g.get("startup", 0.0) + g.get("queue_wait", 0.0)
    rows = [
        [
            "measured (goodput.json)",
            _percent(g["goodput"]),
            _percent(g.get("checkpoint_save", 0.0) / total),
            _percent(g.get("lost", 0.0) / total),
            _percent(restart / total),
            "",
        ]
    ]
    result = predict_run(data)
    if isinstance(result, str):
        return _table(["", "goodput", "checkpoint", "recomputed", "recovery", "shared interval"], rows) + (
            f'<p class="none">{html.escape(result)}</p>'
        )
    inp = result.inputs
    for label, p in (
        ("predicted at the run's cadence", result.at_run_cadence),
        ("predicted, recommended cadence", result.recommended),
    ):
        minutes = every_minutes(p.shared_interval_s, inp["shared_save_s"])
        rows.append(
            [
                label,
                _percent(p.goodput),
                _percent(p.checkpoint),
                _percent(p.recompute),
                _percent(p.recovery),
                f"{minutes:,.1f} min",
            ]
        )
    rec = inp["recovery"]
    local = (
        f", node-local save stall {inp['local_save_s']:.2f} s ({inp['local_saves']} saves)"
        if inp["local_saves"]
        else ""
    )
    text = (
        f"model inputs (hpcdist.checkpoint.cadence, measured by this run): step {inp['step_s']:.3f} s, shared save "
        f"stall {inp['shared_save_s']:.2f} s ({inp['shared_saves']} saves){local}, recovery {rec.total_s:.1f} s "
        f"({'measured mean' if inp['recovery_measured'] else 'assumed: no failure measured yet'}), {inp['nodes']} "
        f"node(s) at a node MTBF of {inp['node_mtbf_hours']:,.0f} h (cluster {inp['profile']}). The measured split "
        "counts restores, start-up and queue waits as recovery; the model leaves out the queue and the first start."
    )
    header = ["", "goodput", "checkpoint", "recomputed", "recovery", "shared interval"]
    return _table(header, rows) + f"<p>{html.escape(text)}</p>"


def _restarts(data: RunData) -> str:
    ledger = data.restarts
    out = []
    if ledger:
        attempts = ledger.get("attempts") or {}
        rows = [
            [
                f"job {ledger.get('job_id')} restart {k}",
                _when(a.get("start")),
                a.get("ended", ""),
                a.get("path", ""),
                a.get("ended", ""),
                a.get("requeued") or a.get("restarted") or "",
                ",".join(map(str, a["nodes"])) if isinstance(a.get("nodes"), list) else a.get("host", ""),
            ]
            for k, a in sorted(attempts.items(), key=lambda kv: int(kv[0]))
        ]
        out.append(
            _table(["SLURM attempt", "start", "started as", "ended", "then (requeued for / in-job)", "nodes"], rows)
        )
        if isinstance(ledger.get("gate_failed"), dict) and ledger["gate_failed"]:
            gate = "; ".join(f"{h}: {', '.join(map(str, r))}" for h, r in dict(ledger["gate_failed"]).items())
            out.append(f'<p class="bad">failed the health gate: {html.escape(gate)}</p>')
        if ledger.get("excluded"):
            out.append(f"<p>excluded nodes: {html.escape(', '.join(map(str, ledger['excluded'])))}</p>")
        if ledger.get("stopped"):
            out.append(f'<p class="bad">stopped: {html.escape(str(ledger["stopped"].get("reason")))}</p>')
    fails = data.failures
    if fails:
        rows = [
            [
                _when(f.get("time")),
                f.get("kind", ""),
                f.get("rank", ""),
                f.get("host", ""),
                f.get("step", ""),
                f.get("restart", ""),
                f.get("cause", ""),
            ]
            for f in fails
        ]
        out.append(_table(["time", "kind", "rank", "host", "step", "restart", "cause"], rows))
    return "".join(out) or '<p class="none">no restarts.json and no failures.jsonl: nothing failed</p>'


def _ranks(data: RunData) -> str:
    by_host = data.ranks_by_host()
    if not by_host:
        return '<p class="none">no ranks.json yet</p>'
    rows = [[host, len(ranks), ", ".join(map(str, ranks))] for host, ranks in by_host.items()]
    return _table(["host", "ranks", "rank ids"], rows)


def _image(path: Path | None, title: str) -> str:
    if path is None:
        return f'<p class="none">{html.escape(title)}: nothing recorded yet</p>'
    encoded = base64.b64encode(path.read_bytes()).decode("ascii")
    return f'<img alt="{html.escape(title)}" src="data:image/png;base64,{encoded}">'


def write_report(run_dir: str | os.PathLike[str], out: Path, images: Path) -> tuple[Path, dict[str, Path | None]]:
    """Write the page to ``out`` and the PNGs into ``images``; return both. Raises MissingMatplotlib without it."""
    from hpcdist.report import plots  # matplotlib is imported by the first figure, not here

    data = RunData.load(run_dir)
    pngs = plots.figures(data, images)
    page = render_page(run_dir, data, pngs)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page, encoding="utf-8")
    return out, pngs


def render_page(run_dir: str | os.PathLike[str], data: RunData, pngs: dict[str, Path | None]) -> str:
    """The page's HTML from the run's records and its figures (``pngs``: a figure's PNG, or None: not drawn)."""
    from hpcdist.report import plots

    sections = [
        f"<h1>hpcdist run report: {html.escape(str(Path(run_dir)))}</h1>",
        f"<p>written {_when(_dt.datetime.now().timestamp())}; the run's files as they were then (a running or "
        "crashed run shows what it had recorded)</p>",
        "<h2>Summary</h2>",
        _summary(data),
        "<h2>Attempts</h2>",
        _attempts(data),
        "<h2>Goodput: measured and predicted</h2>",
        _goodput_prediction(data),
    ]
    for name, (title, _) in plots.FIGURES.items():
        sections += [f"<h2>{html.escape(title)}</h2>", _image(pngs.get(name), title)]
        if name == "timeline":
            sections.append(_restarts(data))
    sections += [
        "<h2>Ranks by host</h2>",
        _ranks(data),
        "<h2>Resolved config</h2>",
        f"<pre>{html.escape(data.config_text) or 'no config.yaml yet'}</pre>",
    ]
    page = (
        f'<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>hpcdist report</title><style>{_STYLE}'
        f"</style></head><body>\n" + "\n".join(sections) + "\n</body></html>\n"
    )
    return page
