"""Prometheus metrics of a training job (``logging.prometheus``), from each node's local rank 0.

Site monitoring scrapes nodes, not jobs: so every node's local rank 0 exports, with ``node`` and ``job`` labels,
either over HTTP (``port``: prometheus_client's server thread, /metrics, on ``addr``: 127.0.0.1 unless opened to
other hosts, since the server has no authentication) or into a file for node_exporter's textfile
collector (``textfile``, rewritten atomically at every log step). Names follow the Prometheus conventions: counters
end in ``_total``, units are in the name (``_seconds``, ``_bytes``), rates are left to PromQL
(``rate(hpcdist_tokens_total[5m])``) with the trainer's own windowed rates as gauges beside them.

    hpcdist_steps_total, hpcdist_samples_total, hpcdist_tokens_total       counters (this process's lifetime)
    hpcdist_step_duration_seconds                                          histogram of optimizer-step wall time
    hpcdist_tokens_per_second, hpcdist_samples_per_second                  the log line's windowed throughput
    hpcdist_loss, hpcdist_grad_norm, hpcdist_mfu_ratio                      at the last log step
    hpcdist_comm_share_ratio                                               when the run measures it
    hpcdist_memory_bytes{local_rank=...}                                   every local rank of the node (straggler
                                                                           checks gather it) and this rank's own
    hpcdist_restarts_total                                                 SLURM restarts of the job so far

The package is the optional ``prometheus`` extra (``pip install 'hpcdist[prometheus]'``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from hpcdist.base.logging_utils import get_logger

__all__ = ["PrometheusExporter"]

log = get_logger(__name__)

# step-time buckets from 10 ms (tiny CPU runs) to 10 min (a 13B step with a checkpoint inside)
_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 150, 600)


class PrometheusExporter:
    """A no-op unless ``enabled`` (local rank 0) and a port or textfile is configured."""

    def __init__(self, cfg: Any, *, enabled: bool, node: int, job: str, restarts: int) -> None:
        p = cfg.logging.prometheus
        self.active = enabled and bool(p.port or p.textfile)
        self._server: tuple[Any, Any] | None = None  # (the HTTP server, its thread) while serving
        if not self.active:
            return
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = r = CollectorRegistry()
        self.textfile = p.textfile.replace("{node}", str(node)) if p.textfile else None
        labels = {"node": str(node), "job": job}
        names = list(labels)

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, names, registry=r).labels(**labels)

        def gauge(name: str, doc: str) -> Any:
            return Gauge(name, doc, names, registry=r).labels(**labels)

        self.steps = counter("hpcdist_steps", "Optimizer steps completed by this process")
        self.samples = counter("hpcdist_samples", "Samples trained on (all ranks of the job)")
        self.tokens = counter("hpcdist_tokens", "Tokens trained on (all ranks of the job)")
        self.restarts = counter(
            "hpcdist_restarts", "Restarts of the job before this attempt (the scheduler's restart count)"
        )
        self.restarts.inc(restarts)
        self.step_time = Histogram(
            "hpcdist_step_duration_seconds", "Optimizer-step wall time", names, buckets=_BUCKETS, registry=r
        ).labels(**labels)
        self.gauges = {
            "tokens_per_s": gauge("hpcdist_tokens_per_second", "Job tokens/s over the trainer's window"),
            "samples_per_s": gauge("hpcdist_samples_per_second", "Job samples/s over the trainer's window"),
            "loss": gauge("hpcdist_loss", "Training loss at the last log step"),
            "grad_norm": gauge("hpcdist_grad_norm", "Gradient norm at the last log step"),
            "mfu": gauge("hpcdist_mfu_ratio", "Model FLOPs utilisation at the last log step (0-1)"),
            "comm_share": gauge("hpcdist_comm_share_ratio", "Share of step time in communication, when measured"),
        }
        self.memory = Gauge(
            "hpcdist_memory_bytes",
            "Memory per local rank (CUDA reserved, else resident set)",
            [*names, "local_rank"],
            registry=r,
        )
        self._labels = labels
        if p.port:
            from prometheus_client import start_http_server

            try:  # a daemon thread, shut down by close() (a process that goes on must not keep the port and thread)
                # logging.prometheus.addr: 127.0.0.1 unless the user opens it to other hosts (no authentication)
                self._server = start_http_server(p.port, addr=p.addr, registry=r)
            except OSError as e:  # the port is taken (another job on this node): monitoring must not stop training
                log.warning(
                    "Prometheus: cannot serve on %s port %d (%s); no metrics from node %d", p.addr, p.port, e, node
                )
                self.active = False
                return
            everyone = p.addr in ("0.0.0.0", "::")
            log.info(
                "Prometheus metrics on %s port %d (/metrics) from node %d%s",
                p.addr,
                p.port,
                node,
                ": readable by anyone who reaches this node" if everyone else "",
            )
        self.flush()

    def step(self, seconds: float, *, samples: int, tokens: int) -> None:
        if not self.active:
            return
        self.steps.inc()
        self.samples.inc(samples)
        self.tokens.inc(tokens)
        self.step_time.observe(seconds)

    def log(self, m: Mapping[str, Any], *, samples_per_token: float, local_memory: Sequence[float] = ()) -> None:
        """At a log step: the gauges from the log line's metrics; memory per local rank in GiB."""
        if not self.active:
            return
        if "tokens_per_s" in m:
            m = {**m, "samples_per_s": m["tokens_per_s"] * samples_per_token}
        for key, g in self.gauges.items():
            value = m.get(key)
            if isinstance(value, (int, float)) and value == value:  # NaN loss: keep the last finite value
                g.set(value)
        for local_rank, gib in enumerate(local_memory):
            self.memory.labels(**self._labels, local_rank=str(local_rank)).set(gib * 2**30)
        self.flush()

    def close(self) -> None:
        """Stop serving (the end of train(), normal or raised): the port is free and the server's thread gone for
        whatever this process does next (another Trainer on the same port, a fork). Safe to call more than once."""
        if self._server is not None:
            server, thread = self._server
            self._server = None
            server.shutdown()
            server.server_close()
            thread.join()

    def flush(self) -> None:
        """Textfile mode: rewrite the .prom file (prometheus_client writes a temporary and renames it)."""
        if self.active and self.textfile:
            from prometheus_client import write_to_textfile

            os.makedirs(os.path.dirname(os.path.abspath(self.textfile)), exist_ok=True)
            write_to_textfile(self.textfile, self.registry)
