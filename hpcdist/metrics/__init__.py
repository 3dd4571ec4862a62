"""Observability: what a run measures and where it goes.

One room per concept, and one per-step entry point for the loop:

    observer.py    Observer: the loop's one observability collaborator; each step's record fans out from it to
                   the sinks, the profiler, goodput, evaluation and the straggler check
    throughput.py  tokens/s, MFU (peak FLOP/s per device), memory
    logger.py      the log line and rank 0's sinks: metrics.jsonl, TensorBoard, the trackers
    trackers.py    W&B and MLflow (rank 0)
    prometheus.py  Prometheus gauges and counters (each node's local rank 0)
    summary.py     the end-of-attempt summary block and run_summary.json (standard library only)
    profiling.py   logging.profile: torch.profiler traces and CUDA memory snapshots

This file imports nothing, so reading one room (``summary``) does not load torch.
"""
