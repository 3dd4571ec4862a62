"""DDP gradient communication hooks (torch's own: all-reduce, bf16/fp16 compression, PowerSGD), measured.

Every hook runs on a process group of its own (the same ranks as the default group), so the bytes it hands to
``dist.all_reduce`` can be told apart from every other collective: ``CommMeter`` counts them at runtime (the tensors
actually passed: PowerSGD's P and Q matrices and its uncompressed rank-1 tensors, the bf16 copy of a bucket), and
times each bucket from the hook's call to its future's completion (GPU buckets with CUDA timing events, see
``mark``). The counting wrapper of ``dist.all_reduce`` is
installed only while a metered backward runs (``CommHook.counting``, entered by DDPStrategy.forward_backward: DDP
waits for every bucket's future, PowerSGD's chained collectives included, before backward returns) and removed
after it, so no other code of the process ever runs through it. Those are the ``comm_bytes_per_step`` and
``comm_share`` metrics. Bytes are each rank's payload per all-reduce; a ring all-reduce moves 2(n-1)/n times that
over each rank's link.

PowerSGD keeps per-rank state (error feedback differs on every rank, the P/Q memories, its iteration counter and
numpy RNG): ``powersgd_state_dict`` turns it into plain tensors and numbers for the checkpoint's per-rank file.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, cast

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import debugging_hooks, default_hooks, powerSGD_hook

from hpcdist.base.logging_utils import get_logger

log = get_logger(__name__)

Hook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]


Mark = float | torch.cuda.Event
"""A point in time of a bucket's communication: host seconds (CPU buckets), or a CUDA event (GPU buckets)."""


def mark(device: torch.device) -> Mark:
    """Now, for a bucket on ``device``. On a GPU the host's clock says nothing about communication: NCCL enqueues
    its kernels and returns, and its futures run their callbacks at once, so a host interval is the enqueueing
    (about 0). A timing event recorded on the current stream of ``device`` instead marks when the GPU gets there:
    in the hook, the stream on which the bucket's gradients are produced (the collective waits for it); in the
    future's callback, the stream torch gives callbacks, which waits for the collective's end. On CPU (gloo) the
    collective runs by the time its future completes: the host clock is the measure."""
    if device.type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record(torch.cuda.current_stream(device))
    return event


class CommMeter:
    """Bytes passed to all_reduce on one process group, and the seconds during which a bucket was in flight."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self._lock = threading.Lock()  # future callbacks run on the backend's threads
        self.bytes = 0
        self._spans: list[tuple[float, float]] = []

    def add_bytes(self, n: int) -> None:
        with self._lock:
            self.bytes += n

    def add_span(self, start: Mark, end: Mark) -> None:
        """One bucket in flight from ``start`` to ``end`` (two :func:`mark` of one device)."""
        with self._lock:
            self._spans.append((start, end))

    def take(self) -> tuple[int, float]:
        """(bytes, busy seconds) since the last call. Busy = the union of the buckets' in-flight intervals: buckets
        queue behind each other on the group, so their sum would count the waiting twice. GPU spans are read here,
        once their events are complete (a wait for the last bucket's collective, long done when the step is over)."""
        with self._lock:
            n, marks = self.bytes, self._spans
            self.bytes, self._spans = 0, []
        spans = sorted(_seconds(marks))
        busy, end = 0.0, float("-inf")
        for s, e in spans:
            if e > end:
                busy += e - max(s, end)
                end = e
        return n, busy


def _seconds(spans: list[tuple[Mark, Mark]]) -> list[tuple[float, float]]:
    """Spans of marks as seconds on one time line: host seconds as they are, events relative to the first event."""
    events = [m for span in spans for m in span if not isinstance(m, float)]
    if not events:
        return cast(list[tuple[float, float]], spans)
    for event in events:
        event.synchronize()
    origin = events[0]
    return [
        (s, e)
        if isinstance(s, float) and isinstance(e, float)
        else (origin.elapsed_time(s) / 1e3, origin.elapsed_time(e) / 1e3)
        for s, e in spans
    ]


_COUNTING_LOCK = threading.Lock()
_COUNTING: list[CommMeter] = []  # the meters whose window is open (one per metered backward in progress)
_INSTALLED: list[tuple[Callable[..., Any], Callable[..., Any]]] = []  # (torch's all_reduce, our wrapper) while open


@contextlib.contextmanager
def counting(meter: CommMeter) -> Iterator[None]:
    """While open, ``dist.all_reduce`` calls on ``meter``'s group add their bytes to it. The hooks call it through
    the module (``dist.all_reduce``), also from the callbacks PowerSGD chains on futures, so the module attribute is
    what is wrapped; the first window installs the wrapper and the last one to close restores torch's function."""
    with _COUNTING_LOCK:
        if not _COUNTING:
            _INSTALLED.append(_install())
        _COUNTING.append(meter)
    try:
        yield
    finally:
        with _COUNTING_LOCK:
            _COUNTING.remove(meter)
            if not _COUNTING:
                original, wrapper = _INSTALLED.pop()
                if dist.all_reduce is wrapper:  # someone who wrapped it after us keeps theirs (ours passes through)
                    dist.all_reduce = original


def _install() -> tuple[Callable[..., Any], Callable[..., Any]]:
    original = dist.all_reduce

    @functools.wraps(original)
    def all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        group = kwargs.get("group", args[1] if len(args) > 1 else None)  # all_reduce(tensor, op, group, async_op)
        if group is not None:
            for meter in tuple(_COUNTING):  # a copy: a window may close on another thread meanwhile
                if meter.group is group:
                    meter.add_bytes(tensor.numel() * tensor.element_size())
        return original(tensor, *args, **kwargs)

    dist.all_reduce = all_reduce
    return original, all_reduce


def timed(hook: Hook, meter: CommMeter) -> Hook:
    """The hook, with each bucket's call-to-completion interval recorded."""

    def wrapper(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        device = bucket.buffer().device
        start = mark(device)

        def done(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            meter.add_span(start, mark(device))
            return fut.value()

        return hook(state, bucket).then(done)

    return wrapper


def serialized(hook: Hook) -> Hook:
    """The hook, each bucket started only once the previous bucket's future is done.

    PowerSGD issues its second and third all-reduce (P, then Q) from callbacks on the first one's future. With
    several buckets in flight those callbacks race, and two ranks can issue the same group's collectives in
    different orders: gloo pairs them by issue order, so the job hangs (seen: 125m preset, 2 ranks, first compressed
    step). Chaining the buckets makes the order the same on every rank; the price is no overlap between buckets'
    compression (each still overlaps the rest of backward)."""
    last: list[torch.futures.Future[torch.Tensor] | None] = [None]

    def wrapper(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        prev = last[0]
        if prev is None or prev.done():
            fut = hook(state, bucket)
        else:
            fut = torch.futures.Future()

            def relay(f: torch.futures.Future[torch.Tensor]) -> None:
                try:
                    fut.set_result(f.value())
                except BaseException as e:  # the collective failed: DDP's wait raises it
                    fut.set_exception(e)

            def start(_: torch.futures.Future[torch.Tensor]) -> None:
                try:
                    hook(state, bucket).add_done_callback(relay)
                except BaseException as e:
                    fut.set_exception(e)

            prev.add_done_callback(start)
        last[0] = fut
        return fut

    return wrapper


class CommHook:
    """One DDP model's registered hook: its meter and (PowerSGD) its state. ``warmup`` makes the bypass hook."""

    def __init__(self, name: str, *, powersgd: dict[str, Any] | None = None):
        self.name = name
        self.group = dist.new_group()  # collective: every rank builds it at the same point (model wrapping)
        self.meter = CommMeter(self.group)
        self.bypass = False  # True: buckets are returned untouched, nothing is sent (bucket-layout warm-up)
        self.powersgd: powerSGD_hook.PowerSGDState | None = None
        match name:
            case "allreduce":
                hook, state = default_hooks.allreduce_hook, self.group
            case "bf16":
                hook, state = default_hooks.bf16_compress_hook, self.group
            case "fp16":
                hook, state = default_hooks.fp16_compress_hook, self.group
            case "powersgd":
                p = powersgd or {}
                self.powersgd = powerSGD_hook.PowerSGDState(
                    process_group=self.group,
                    matrix_approximation_rank=p.get("rank", 4),
                    start_powerSGD_iter=p.get("start_iter", 100),
                    use_error_feedback=p.get("use_error_feedback", True),
                    warm_start=p.get("warm_start", True),
                )
                batched = p.get("batched", False)
                hook = serialized(powerSGD_hook.batched_powerSGD_hook if batched else powerSGD_hook.powerSGD_hook)
                state = self.powersgd
            case _:
                raise ValueError(f"parallel.ddp.comm_hook: unknown hook {name!r}")
        self._hook, self._state = timed(hook, self.meter), state

    def counting(self) -> contextlib.AbstractContextManager[None]:
        """The window in which this hook's all-reduce bytes are counted: around a backward that syncs gradients."""
        return counting(self.meter)

    def __call__(self, _: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        if self.bypass:
            return debugging_hooks.noop_hook(None, bucket)
        return self._hook(self._state, bucket)

    def as_function(self) -> Callable[..., Any]:
        """What DDP registers: it wants a function named by ``__name__`` whose parameter is called ``bucket`` and is
        not annotated with a string (this module's annotations are strings: ``from __future__ import annotations``)."""

        def hpcdist_comm_hook(state, bucket):
            return self(state, bucket)

        return hpcdist_comm_hook

    # ------------------------------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """This rank's hook state as plain tensors and numbers (loadable with ``torch.load(weights_only=True)``)."""
        s = self.powersgd
        if s is None:
            return {}
        kind, keys, pos, has_gauss, cached = s.rng.get_state()
        return {
            "hook": self.name,
            "iter": s.iter,
            "error": {int(k): v.detach().cpu().clone() for k, v in s.error_dict.items()},
            "p": {int(k): v.detach().cpu().clone() for k, v in s.p_memory_dict.items()},
            "q": {int(k): v.detach().cpu().clone() for k, v in s.q_memory_dict.items()},
            "rng": {
                "kind": str(kind),
                "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "cached_gaussian": float(cached),
            },
            "numel_before": int(s.total_numel_before_compression),
            "numel_after": int(s.total_numel_after_compression),
        }

    def load_state_dict(self, state: dict[str, Any], device: torch.device) -> None:
        s = self.powersgd
        if s is None or not state:
            return
        if state.get("hook") != self.name:
            log.warning(
                "the checkpoint's comm hook state is for %s, not %s: it starts fresh", state.get("hook"), self.name
            )
            return
        s.iter = int(state["iter"])
        s.error_dict = {int(k): v.to(device) for k, v in state["error"].items()}
        s.p_memory_dict = {int(k): v.to(device) for k, v in state["p"].items()}
        s.q_memory_dict = {int(k): v.to(device) for k, v in state["q"].items()}
        r = state["rng"]
        keys = r["keys"].numpy().astype(np.uint32)
        s.rng.set_state((r["kind"], keys, r["pos"], r["has_gauss"], r["cached_gaussian"]))
        s.total_numel_before_compression = int(state["numel_before"])
        s.total_numel_after_compression = int(state["numel_after"])


def register(ddp: nn.parallel.DistributedDataParallel, hook: CommHook, warmup_input: torch.Tensor) -> None:
    """Register ``hook`` on ``ddp``; with PowerSGD also settle DDP's bucket layout first.

    DDP puts every parameter into one bucket for its first backward and rebuilds the buckets in gradient-arrival
    order after it. PowerSGD keys its error feedback and P/Q memories by bucket index, so a resumed run, whose first
    step would again use the one-bucket layout, would apply the saved state to other buckets. One forward/backward
    with the bypass hook (nothing sent, gradients dropped) gives every run, fresh or resumed, the rebuilt layout
    before its first real step: the same layout the uninterrupted run uses from its second step on."""
    ddp.register_comm_hook(None, hook.as_function())
    if hook.powersgd is None:
        return
    hook.bypass = True
    try:
        ddp(warmup_input).float().sum().backward()
    finally:
        hook.bypass = False
        ddp.zero_grad(set_to_none=True)
