"""Human-readable sections (nccl-tests' table layout, '#' comment lines) and the JSON document."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

from hpcdist.base.atomic import atomic_write
from hpcdist.diagnostics.audit import Finding, distinct, field
from hpcdist.diagnostics.finder import Outlier
from hpcdist.diagnostics.verdict import Verdict
from hpcdist.diagnostics.watchdog import Hang

__all__ = [
    "audit_text",
    "finder_text",
    "hang_text",
    "header_text",
    "health_text",
    "human_bytes",
    "missing_text",
    "rank_ranges",
    "sweep_text",
    "verdict_text",
    "write_json",
]


def rank_ranges(ranks: Sequence[int]) -> str:
    """[0, 1, 2, 3, 6, 7] -> "0-3,6-7"."""
    out: list[str] = []
    run: list[int] = []
    for r in sorted(ranks):
        if run and r != run[-1] + 1:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = []
        run.append(r)
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def human_bytes(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def hosts_summary(hosts: Sequence[str | None]) -> str:
    by_host: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        by_host.setdefault(host if host and host != "?" else "not joined", []).append(rank)
    return ", ".join(f"{h}: ranks {rank_ranges(r)}" for h, r in by_host.items())


def header_text(layout: dict[str, Any], options: dict[str, Any], faults: list[str]) -> str:
    n_hosts = len({h for h in layout["hosts"] if h and h != "?"})
    lines = [
        f"# nccl_check: {layout['world_size']} rank(s) on {n_hosts} host(s) ({hosts_summary(layout['hosts'])}), "
        f"backend {layout['backend']}, device {layout['device_kind']}, launcher {layout['launcher']}"
        + (f", job {layout['job_id']}" if layout.get("job_id") else ""),
        f"# sizes {human_bytes(options['min_bytes'])} - {human_bytes(options['max_bytes'])} "
        f"(x{options['step_factor']}), {options['iters']} iters after {options['warmup']} warm-up, "
        f"{options['dtype']}, ops {','.join(options['ops'])}; step timeout {options['timeout_s']:g} s",
    ]
    lines += [f"# TEST-ONLY FAULT ACTIVE: {f}" for f in faults]
    return "\n".join(lines)


def _shown(value: Any) -> str:
    if value is None:
        return "(unset)"
    if isinstance(value, str):
        return value if value else '""'
    return json.dumps(value)


def _iface_line(rec: dict[str, Any]) -> str:
    parts = []
    for i in rec["interfaces"]:
        speed = f" {i['speed_mbps']}Mb/s" if i["speed_mbps"] else ""
        parts.append(f"{i['name']} {i['state']} {i['ipv4'] or '-'} mtu {i['mtu']}{speed}")
    return "; ".join(parts) or "none"


def _ib_line(rec: dict[str, Any]) -> str:
    ports = [
        f"{p['hca']}/{p['port']} {p['state'].split(':')[-1].strip()} {p['rate']} {p['link_layer']}" for p in rec["ib"]
    ]
    return "; ".join(ports) or "none"


def audit_text(records: list[dict[str, Any]], findings: list[Finding]) -> str:
    """Every field once per distinct value, with the ranks (or hosts) that have it; then the findings."""
    hosts_of = {r["rank"]: r["hostname"] for r in records}
    # node-wide facts: the first rank of each host speaks for it
    node_recs = list({r["hostname"]: r for r in reversed(records)}.values())[::-1]

    def where(ranks: list[int], node: bool = False) -> str:
        hosts = sorted({hosts_of[r] for r in ranks})
        if len(ranks) == (len(node_recs) if node else len(records)):
            return "all hosts" if node else "all ranks"
        return f"host(s) {', '.join(hosts)}" if node else f"ranks {rank_ranges(ranks)} ({', '.join(hosts)})"

    rows: list[tuple[str, str, str]] = []

    def row(label: str, get: Callable[[dict[str, Any]], Any], node: bool = False, blank: str = "(unset)") -> None:
        for value, ranks in distinct(node_recs if node else records, get):
            rows.append((label, blank if value is None else _shown(value), where(ranks, node)))
            label = ""

    row("hostname", field("hostname"))
    for key in ("python", "torch", "cuda", "nccl", "driver", "hpcdist"):
        row(key, field("versions", key), blank="-")
    row("device", field("device"))
    row("gpus visible", lambda r: f"{r['gpus']['count']} {', '.join(sorted(set(r['gpus']['names'])))}".strip())
    row("nccl profile", field("profile", "name"), blank="none")
    names = sorted({name for r in records for name in r["env"]})
    for name in names:
        row(name, field("env", name))
    row("interfaces", _iface_line, node=True)
    row("infiniband", _ib_line, node=True)
    width = max(len(r[0]) for r in rows)
    vwidth = min(max(len(r[1]) for r in rows), 60)
    lines = ["# Environment (each value once, with the ranks that have it)"]
    lines += [f"#   {label:<{width}}  {value:<{vwidth}}  {who}" for label, value, who in rows]
    for value, ranks in distinct(node_recs, lambda r: r["topo"]):
        if value:
            lines.append(f"#   nvidia-smi topo -m on {where(ranks, node=True)}:")
            lines += [f"#     {line}" for line in value.splitlines()]
    for value, ranks in distinct(records, lambda r: (r["profile"] or {}).get("lines")):
        for line in value or []:
            lines.append(f"#   profile ({where(ranks)}): {line}")
    lines.append("#")
    lines.append("# Findings" + ("" if findings else ": none"))
    for f in findings:
        lines.append(f"#   {f.severity.upper():<7} [{f.code}] {f.message}")
        if f.fix:
            lines.append(f"#           fix: {f.fix}")
    return "\n".join(lines)


def missing_text(missing: list[dict[str, Any]], waited_s: float) -> str:
    lines = [f"# RENDEZVOUS: {len(missing)} rank(s) did not join within {waited_s:.0f} s:"]
    lines += [f"#   rank {m['rank']} (expected on {m['host']})" for m in missing]
    return "\n".join(lines)


def health_text(results: list[dict[str, Any]], hosts: Sequence[str]) -> str:
    lines = ["# Device health (allocate 64 MiB, 256x256 matmul vs a float64 CPU reference)"]
    lines.append(f"#   {'rank':>4}  {'host':<16} {'device':<8} {'name':<28} {'status':<6} {'max rel err':>11}")
    for rank, r in enumerate(results):
        err = f"{r['max_rel_err']:.2e}" if r["max_rel_err"] is not None else "-"
        status = "OK" if r["ok"] else "BROKEN"
        lines.append(f"#   {rank:>4}  {hosts[rank]:<16} {r['device']:<8} {r['name'][:28]:<28} {status:<6} {err:>11}")
        if r["error"]:
            lines.append(f"#         {r['error']}")
    return "\n".join(lines)


def _cells(res: dict[str, Any] | None) -> list[str]:
    if res is None:
        return ["N/A"] * 4
    return [f"{res['time_us']:.1f}", f"{res['algbw']:.2f}", f"{res['busbw']:.2f}", str(res["wrong"])]


def sweep_text(table: dict[str, Any]) -> str:
    """One operation on one scope, laid out like nccl-tests' output."""
    multi = len(table["by_host"]) > 1 and table["scope"] == "intra-node"
    extra = "  slowest" if multi else ""
    head = [
        f"# {table['op']}, {table['scope']}: {table['describe']}",
        f"# {'':>50}{'out-of-place':^32}  {'in-place':^32}",
        f"# {'size':>12} {'count':>13} {'type':>9} {'redop':>6} {'root':>5} "
        f"{'time':>8} {'algbw':>7} {'busbw':>7} {'#wrong':>7}  "
        f"{'time':>8} {'algbw':>7} {'busbw':>7} {'#wrong':>7}{extra}",
        f"# {'(B)':>12} {'(elements)':>13} {'':>9} {'':>6} {'':>5} {'(us)':>8} {'(GB/s)':>7} {'(GB/s)':>7} {'':>7}  "
        f"{'(us)':>8} {'(GB/s)':>7} {'(GB/s)':>7}",
    ]
    lines = list(head)
    for row in table["rows"]:
        out, inp = _cells(row.get("out")), _cells(row.get("in"))
        slow = f"  {row.get('worst_host', '')}" if multi else ""
        lines.append(
            f"  {row['size']:>12} {row['count']:>13} {row['type']:>9} {row['redop']:>6} {row['root']:>5} "
            f"{out[0]:>8} {out[1]:>7} {out[2]:>7} {out[3]:>7}  {inp[0]:>8} {inp[1]:>7} {inp[2]:>7} {inp[3]:>7}{slow}"
        )
    busbw = [row[p]["busbw"] for row in table["rows"] for p in ("out", "in") if p in row]
    finite = [b for b in busbw if math.isfinite(b)]
    lines.append(f"# Avg bus bandwidth    : {sum(finite) / max(len(finite), 1):.3f} GB/s")
    return "\n".join(lines)


def finder_text(finder: dict[str, Any]) -> str:
    lines = [
        f"# Slow node / link finder: {human_bytes(finder['bytes'])} per transfer, {finder['iters']} timed after "
        f"{finder['warmup']} warm-up; outlier below {finder['threshold']:g} x the typical value"
    ]
    if finder["rank_scores"]:
        lines.append("#   ranks, exchanging with their node mates (slowest first):")
        ranked = sorted(finder["rank_scores"].items(), key=lambda kv: kv[1])
        for rank, score in ranked:
            lines.append(f"#     rank {rank:>4}  {finder['hosts'][int(rank)]:<16} {score:10.3f} GB/s")
    if finder["host_scores"]:
        lines.append("#   hosts, all local ranks sending to / receiving from each other host (slowest first):")
        ranked = sorted(finder["host_scores"].items(), key=lambda kv: min(kv[1]["rx"], kv[1]["tx"]))
        for host, s in ranked:
            lines.append(f"#     {host:<16} rx {s['rx']:10.3f} GB/s  tx {s['tx']:10.3f} GB/s")
        for (src, dst), bw in sorted(finder["links"].items(), key=lambda kv: kv[1]):
            lines.append(f"#     link {src} -> {dst}: {bw:.3f} GB/s")
    if not finder["rank_scores"] and not finder["host_scores"]:
        lines.append("#   nothing to compare (one rank per host and one host)")
    outliers: list[Outlier] = finder["outliers"]
    lines.append("#   outliers: " + ("none" if not outliers else ""))
    lines += [f"#     SLOW {o.kind} {o.name}: {o.detail}" for o in outliers]
    if finder["ambiguous"]:
        lines.append(
            "#     (two hosts: a slow direction could also be the sender's uplink; a third node would tell them apart)"
        )
    if finder["exclude"]:
        lines.append(f"#   suggested: {finder['exclude']}")
    return "\n".join(lines)


def hang_text(hang: Hang) -> str:
    return "\n".join(["# HANG / TIMEOUT:", *(f"#   {line}" for line in hang.lines())])


def verdict_text(verdict: Verdict) -> str:
    lines = [f"# Verdict: {'PASS' if verdict.passed else 'FAIL'}"]
    lines += [f"#   FAIL: {r}" for r in verdict.reasons]
    lines += [f"#   note: {n}" for n in verdict.notes]
    if verdict.exclude:
        lines.append(f"#   suggested for the next job: --exclude={','.join(verdict.exclude)}")
    return "\n".join(lines)


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {
            (k if isinstance(k, str) else "->".join(map(str, k)) if isinstance(k, tuple) else str(k)): _jsonable(v)
            for k, v in obj.items()
        }
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if hasattr(obj, "__dataclass_fields__"):
        return _jsonable(asdict(obj))
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def write_json(document: dict[str, Any], path: str) -> None:
    """Write the whole report; '-' means stdout. Atomic for files, so a reader never sees half a document."""
    text = json.dumps(_jsonable(document), indent=1, sort_keys=False)
    if path == "-":
        print(text, flush=True)
        return
    atomic_write(path, text + "\n")
