"""CUDA on a CPU-only torch, far enough to run the project's CUDA branches: the fake-CUDA tier's one harness.

A CPU build of torch has no CUDA runtime, so every ``if tensor.is_cuda`` branch, every ``torch.cuda.*`` call and
every NCCL group would otherwise only ever run on a GPU. :class:`FakeCuda` stands in for the runtime:

* ``device="cuda[:i]"`` tensors are :class:`CudaLike`: a wrapper subclass whose ``device`` is ``cuda:i`` and which
  holds real CPU data, so values are computed and a copy to the CPU hands the bytes back (a writer that refuses a
  CUDA tensor refuses this one too; DCP's own writer saves it);
* an op mixing devices raises as CUDA does ("Expected all tensors to be on the same device"), 0-dim CPU scalars
  allowed except in fused optimizer kernels (``_fused_*``), which read every tensor argument as a device pointer;
* random ops on ``cuda`` draw from a per-device generator that ``torch.manual_seed`` / ``torch.cuda.manual_seed*``
  seed, a stream of numbers different from the CPU generator's (as CUDA's Philox is);
* the runtime's thread state as CUDA keeps it: a current device per thread (0 in a new thread), streams, events,
  ``torch.cuda.stream`` through torch's own StreamContext; every device a thread made current or allocated on is
  recorded (:attr:`FakeCuda.contexts`): a thread that touches device 0 on a rank bound to device 3 opens a context
  there on a real node;
* pinned host memory (``pin_memory()`` / ``pin_memory=True``) is recorded, and ``is_pinned()`` answers from it;
* memory: live bytes and the peak per device (``torch.cuda.memory_allocated`` / ``max_memory_allocated``).

What cannot run: autograd. Its engine asks the C++ CUDA device guard, which a CPU build lacks (the process aborts),
so gradients are off while the harness is installed (in every thread it starts too): tests run forward passes and
give gradients by hand.

:func:`fake_nccl` registers ``fakenccl``, torch's fake process group for ``cuda`` tensors only: a CPU tensor on such a
group raises torch's own "No backend type associated with device type cpu", as on an NCCL-only group, and
``cpu:gloo,cuda:fakenccl`` takes both as torch's mixed backend string does; :meth:`FakeCuda.nccl_is_fake` turns the
``nccl`` of the code's own backend strings into ``fakenccl``.
"""

from __future__ import annotations

import contextlib
import itertools
import pickle
import threading
import traceback
import types
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch._dynamo  # imported before the patches: with CUDA "available" it imports CUDA-only names
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

__all__ = ["CudaLike", "FakeCuda", "cuda_like", "fake_nccl", "fake_ranks", "install"]

GiB = 1 << 30
# the fake generator's seed offset: any fixed value makes its numbers differ from the CPU generator's for one seed
_CUDA_SEED_OFFSET = 0x5DEECE66D


def _device_of(x: Any) -> torch.device | None:
    if isinstance(x, CudaLike):
        return x.device
    if isinstance(x, torch.Tensor):
        return x.device
    return None


class CudaLike(torch.Tensor):
    """A tensor on ``cuda:i`` holding real CPU data (``_data``); see the module docstring."""

    _data: torch.Tensor
    _fc: FakeCuda

    @staticmethod
    def __new__(cls, data: torch.Tensor, device: torch.device, fc: FakeCuda) -> CudaLike:
        r = torch.Tensor._make_wrapper_subclass(
            cls,
            data.size(),
            strides=data.stride(),
            storage_offset=data.storage_offset(),
            dtype=data.dtype,
            layout=data.layout,
            device=device,
            requires_grad=data.requires_grad,
        )
        r._data = data
        r._fc = fc
        fc._track(r, data, device)
        return r

    def __repr__(self) -> str:  # type: ignore[override]
        return f"CudaLike({self._data!r}, device='{self.device}')"

    def __deepcopy__(self, memo: dict) -> CudaLike:  # a copy on the same device, as a CUDA tensor's
        return CudaLike(self._data.clone(), self.device, self._fc)

    def __reduce_ex__(self, protocol: Any) -> Any:  # a pickle would otherwise write the wrapper's empty storage
        raise TypeError("a CUDA tensor cannot be pickled without a CUDA runtime")

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        fc = _ACTIVE
        assert fc is not None, "CudaLike used outside FakeCuda"
        return fc._dispatch(func, args, kwargs)


def cuda_like(t: torch.Tensor, device: int | str | torch.device = 0) -> CudaLike:
    """``t``'s values on a fake CUDA device (the active :class:`FakeCuda`)."""
    assert _ACTIVE is not None, "cuda_like needs an installed FakeCuda"
    return CudaLike(t.detach().clone(), _ACTIVE._device(device), _ACTIVE)


class _FakeStream:
    """torch.cuda.Stream's surface: work queued on it is already done (the data is on the CPU)."""

    _ids = itertools.count(1)

    def __init__(
        self,
        device: Any = None,
        priority: int = 0,
        stream_id: int | None = None,
        device_index: int | None = None,
        device_type: int | None = None,
        **_: Any,
    ) -> None:
        fc = _ACTIVE
        assert fc is not None
        if device_index is None:
            device_index = fc._device(device).index
            fc._touch(device_index)  # a new stream lives in its device's context
        self.device_index = device_index
        self.device = torch.device("cuda", device_index)
        self.stream_id = next(self._ids) if stream_id is None else stream_id
        self.device_type = 1
        self.priority = priority

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> Any:
        event = event or _FakeEvent()
        event.record(self)
        return event

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    @property
    def cuda_stream(self) -> int:
        return self.stream_id

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _FakeStream) and (other.stream_id, other.device_index) == (
            self.stream_id,
            self.device_index,
        )

    def __hash__(self) -> int:
        return hash((self.stream_id, self.device_index))

    def __repr__(self) -> str:
        return f"<fake torch.cuda.Stream device=cuda:{self.device_index} id={self.stream_id}>"


class _FakeEvent:
    """torch.cuda.Event's surface; ``elapsed_time`` is the host time between the two records, in ms."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self.enable_timing = enable_timing
        self._t: float | None = None
        self.stream: Any = None

    def record(self, stream: Any = None) -> None:
        import time

        self._t = time.perf_counter()
        self.stream = stream

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: _FakeEvent) -> float:
        if self._t is None or end._t is None:
            raise RuntimeError("elapsed_time of an event that was not recorded")
        return (end._t - self._t) * 1000.0


class _Factories(TorchFunctionMode):
    """Calls that make a tensor on ``cuda`` from no CUDA tensor: factories with ``device=``, ``Tensor.to/cuda``, and
    the pinned-memory calls (which a CPU build refuses)."""

    def __init__(self, fc: FakeCuda) -> None:
        super().__init__()
        self.fc = fc

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        fc = self.fc
        method = getattr(func, "__name__", "") if args and isinstance(args[0], torch.Tensor) else ""
        if method == "pin_memory":
            return fc._pin(args[0])
        if method == "is_pinned":
            return fc.is_pinned(args[0])
        if method == "data_ptr" and isinstance(args[0], CudaLike):  # a device address, as a real tensor has one
            return args[0]._data.data_ptr()
        if method == "copy_" and any(isinstance(a, CudaLike) for a in args[:2]):
            # the binding takes a C++ device guard too; a copy between devices is what CUDA allows
            dst, src = args[0], args[1]
            (dst._data if isinstance(dst, CudaLike) else dst).copy_(src._data if isinstance(src, CudaLike) else src)
            return dst
        if method in ("__getitem__", "__setitem__") and isinstance(args[0], CudaLike):
            # torch's indexing binding takes a C++ device guard, which a CPU build has not for CUDA: index the data
            # (a view of it, so writes still reach the tensor) and check the devices as an indexing kernel would
            idx = tree_map(lambda x: x._data if isinstance(x, CudaLike) else x, args[1])
            if method == "__getitem__":
                return CudaLike(args[0]._data[idx], args[0].device, fc)
            value = args[2]
            if isinstance(value, torch.Tensor) and not isinstance(value, CudaLike) and value.dim() > 0:
                fc._check_devices("index_put_", (args[0], value), {})
            args[0]._data[idx] = value._data if isinstance(value, CudaLike) else value
            return None
        to_host = kwargs.get("device") is not None and torch.device(kwargs["device"]).type == "cpu"
        if method.startswith("new_") and isinstance(args[0], CudaLike) and to_host:
            # a CPU tensor made from a CUDA one's dtype (nn.init.trunc_normal_'s bounds): the binding would take a
            # device guard for the CUDA self
            return func(args[0]._data, *args[1:], **kwargs)
        self_plain = bool(args) and isinstance(args[0], torch.Tensor) and not isinstance(args[0], CudaLike)
        if func is torch.Tensor.cuda and self_plain:
            dev = args[1] if len(args) > 1 else kwargs.get("device")
            return CudaLike(args[0].detach().clone(), fc._device(dev), fc)
        if func is torch.Tensor.to and self_plain:
            device, dtype, _non_blocking, _fmt = torch._C._nn._parse_to(*args[1:], **kwargs)
            if device is not None and torch.device(device).type == "cuda":
                data = args[0].detach().to(dtype=dtype) if dtype is not None else args[0].detach()
                return CudaLike(data.clone(), fc._device(device), fc)
            return func(*args, **kwargs)
        dev = kwargs.get("device")
        pin = bool(kwargs.pop("pin_memory", False))
        if dev is not None and torch.device(dev).type == "cuda":
            kwargs["device"] = "cpu"
            target = fc._device(dev)
            out = fc._with_generator(func, args, kwargs, target)
            return tree_map(lambda x: _on_device(x, target, fc) if isinstance(x, torch.Tensor) else x, out)
        out = func(*args, **kwargs)
        if pin and isinstance(out, torch.Tensor):
            fc._mark_pinned(out)
        return out


class FakeCuda:
    """The fake CUDA runtime of one test; :func:`install` puts it in place (the ``fake_cuda`` fixture)."""

    def __init__(
        self,
        devices: int = 8,
        *,
        capability: tuple[int, int] = (8, 0),
        name: str = "NVIDIA A100-SXM4-80GB",
        memory: int = 80 * GiB,
    ) -> None:
        self.devices = devices
        self.capability = capability
        self.name = name
        self.memory = memory
        self._local = threading.local()
        self._lock = threading.Lock()
        self.contexts: dict[str, set[int]] = defaultdict(set)  # thread name -> devices it made current or used
        self._pinned: dict[int, weakref.ref] = {}  # id -> the pinned tensor (tensors do not hash by value)
        self._storages: dict[int, list[int]] = {}  # storage address -> [bytes, device, live wrappers]
        self._allocated: dict[int, int] = defaultdict(int)
        self._peak: dict[int, int] = defaultdict(int)
        self._generators: dict[int, torch.Generator] = {}
        self._seed = 67280421310721
        self.registered: dict[int, int] = {}  # cudaHostRegister'ed host ranges: address -> bytes
        self.ops: list[str] = []  # op names that ran on a fake CUDA tensor (tests look for fused kernels)

    # -- the runtime's thread state -------------------------------------------------------------------------------

    @property
    def current(self) -> int:
        return getattr(self._local, "device", 0)

    def _set_current(self, index: int, *, touch: bool = True) -> None:
        if not 0 <= index < self.devices:
            raise RuntimeError(f"CUDA error: invalid device ordinal (device {index} of {self.devices})")
        self._local.device = index
        if touch:
            self._touch(index)

    def _touch(self, index: int) -> None:
        with self._lock:
            self.contexts[threading.current_thread().name].add(index)

    def devices_used(self) -> set[int]:
        """Every device any thread made current or allocated on."""
        with self._lock:
            return set().union(*self.contexts.values()) if self.contexts else set()

    def _device(self, dev: Any) -> torch.device:
        if dev is None:
            return torch.device("cuda", self.current)
        d = torch.device("cuda", dev) if isinstance(dev, int) else torch.device(dev)
        if d.type != "cuda":
            raise ValueError(f"not a CUDA device: {d}")
        if d.index is None:
            d = torch.device("cuda", self.current)
        if not 0 <= d.index < self.devices:
            raise RuntimeError(f"CUDA error: invalid device ordinal (device {d.index} of {self.devices})")
        return d

    # -- memory ---------------------------------------------------------------------------------------------------

    def _track(self, wrapper: CudaLike, data: torch.Tensor, device: torch.device) -> None:
        try:
            storage = data.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        key, size, index = storage.data_ptr(), storage.nbytes(), device.index
        self._touch(index)
        with self._lock:
            entry = self._storages.get(key)
            if entry is None:
                entry = self._storages[key] = [size, index, 0]
                self._allocated[index] += size
                self._peak[index] = max(self._peak[index], self._allocated[index])
            entry[2] += 1
        weakref.finalize(wrapper, self._release, key)

    def _release(self, key: int) -> None:
        with self._lock:
            entry = self._storages.get(key)
            if entry is None:
                return
            entry[2] -= 1
            if entry[2] == 0:
                del self._storages[key]
                self._allocated[entry[1]] -= entry[0]

    def allocated(self, device: Any = None) -> int:
        return self._allocated[self._device(device).index]

    def peak(self, device: Any = None) -> int:
        return self._peak[self._device(device).index]

    def reset_peak(self, device: Any = None) -> None:
        index = self._device(device).index
        self._peak[index] = self._allocated[index]

    # -- pinned memory ----------------------------------------------------------------------------------------------

    def _pin(self, t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, CudaLike):
            raise RuntimeError("cannot pin 'torch.cuda.FloatTensor' only dense CPU tensors can be pinned")
        if self.is_pinned(t):
            return t
        out = t.clone()
        self._mark_pinned(out)
        return out

    def _mark_pinned(self, t: torch.Tensor) -> None:
        key = id(t)
        self._pinned[key] = weakref.ref(t, lambda _: self._pinned.pop(key, None))

    def is_pinned(self, t: torch.Tensor) -> bool:
        """Pinned by the caching host allocator (``pin_memory``) or inside a range given to ``cudaHostRegister``."""
        if isinstance(t, CudaLike):
            return False
        ref = self._pinned.get(id(t))
        if ref is not None and ref() is t:
            return True
        ptr = t.data_ptr()
        return any(start <= ptr < start + size for start, size in self.registered.items()) if t.numel() else False

    def _cudart(self) -> Any:
        """torch.cuda.cudart()'s host-memory registration (what torch's _pin_memory_utils calls)."""
        fc = self

        class _Cudart:
            @staticmethod
            def cudaHostRegister(ptr: int, size: int, flags: int) -> int:
                fc.registered[int(ptr)] = int(size)
                return 0

            @staticmethod
            def cudaHostUnregister(ptr: int) -> int:
                return 0 if fc.registered.pop(int(ptr), None) is not None else 712  # cudaErrorHostMemoryNotRegistered

        return _Cudart()

    # -- random numbers ---------------------------------------------------------------------------------------------

    def seed_all(self, seed: int) -> None:
        self._seed = int(seed)
        self._generators.clear()

    def generator(self, index: int) -> torch.Generator:
        gen = self._generators.get(index)
        if gen is None:
            gen = self._generators[index] = torch.Generator().manual_seed((self._seed + _CUDA_SEED_OFFSET) % 2**63)
        return gen

    def _with_generator(self, func: Any, args: tuple, kwargs: dict, device: torch.device) -> Any:
        if _is_random(func) and kwargs.get("generator") is None:
            kwargs = {**kwargs, "generator": self.generator(device.index)}
        return func(*args, **kwargs)

    # -- dispatch ---------------------------------------------------------------------------------------------------

    def _dispatch(self, func: Any, args: tuple, kwargs: dict) -> Any:
        name = func.__name__
        self.ops.append(name)
        aten = torch.ops.aten
        if func in (aten.copy_.default,):
            dst, src = args[0], args[1]
            inner_dst = dst._data if isinstance(dst, CudaLike) else dst
            inner_src = src._data if isinstance(src, CudaLike) else src
            inner_dst.copy_(inner_src, **{k: v for k, v in kwargs.items() if k != "non_blocking"})
            return dst
        if func in (aten._to_copy.default,):
            src = args[0]
            target = kwargs.get("device")
            k = {k: v for k, v in kwargs.items() if k not in ("device", "non_blocking", "pin_memory")}
            out = aten._to_copy.default(src._data if isinstance(src, CudaLike) else src, **k)
            if target is not None and torch.device(target).type == "cpu":
                if kwargs.get("pin_memory"):
                    self._mark_pinned(out)
                return out
            dev = self._device(target) if target is not None else src.device
            return CudaLike(out, dev, self)
        if func in (aten.is_pinned.default,):
            return False
        if func.namespace == "c10d":  # collectives: the group's backend for the tensors' device type takes them
            with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.Python)):
                return func(*args, **kwargs)
        self._check_devices(name, args, kwargs)
        device = next(d for d in (_first_cuda(args), _first_cuda(kwargs)) if d is not None)
        wrappers: dict[int, CudaLike] = {}

        def unwrap(x: Any) -> Any:
            if isinstance(x, CudaLike):
                wrappers[id(x._data)] = x
                return x._data
            if isinstance(x, torch.device) and x.type == "cuda":
                return torch.device("cpu")
            return x

        a, k = tree_map(unwrap, args), tree_map(unwrap, kwargs)
        if k.get("device") is not None:  # an explicit device: the output goes there
            target = torch.device(kwargs["device"])
            k["device"] = torch.device("cpu")
            if target.type != "cuda":  # the CPU or meta (DeepSpeed's shape-only copies): no fake tensor
                k["device"] = target
                return func(*a, **k)
            device = self._device(target)
        seeded = torch.Tag.nondeterministic_seeded in func.tags and k.get("generator") is None
        if seeded and any(arg.name == "generator" for arg in func._schema.arguments):
            k["generator"] = self.generator(device.index)
        out = func(*a, **k)

        def wrap(x: Any) -> Any:
            if isinstance(x, torch.Tensor) and not isinstance(x, CudaLike):
                known = wrappers.get(id(x))
                return known if known is not None else CudaLike(x, device, self)
            return x

        return tree_map(wrap, out)

    def _check_devices(self, name: str, args: tuple, kwargs: dict) -> None:
        strict = name.startswith(("_fused_", "_foreach_"))  # every tensor argument is read on the device
        seen: set[str] = set()

        def visit(x: Any) -> Any:
            if isinstance(x, torch.Tensor) and (isinstance(x, CudaLike) or strict or x.dim() > 0):
                seen.add(str(x.device))
            return x

        tree_map(visit, (args, kwargs))
        if len(seen) > 1:
            a, b = sorted(seen)[:2]
            raise RuntimeError(
                f"Expected all tensors to be on the same device, but found at least two devices, {a} and {b}! "
                f"(fake CUDA: {name})"
            )

    # -- installing -------------------------------------------------------------------------------------------------

    def nccl_is_fake(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """The code's ``nccl`` backend strings mean ``fakenccl`` (init_process_group and new_group)."""
        fake_nccl()
        init, new_group = dist.init_process_group, dist.new_group

        def fix(backend: Any) -> Any:
            return backend.replace("nccl", "fakenccl") if isinstance(backend, str) else backend

        def init_process_group(backend: Any = None, *args: Any, **kwargs: Any) -> Any:
            if "backend" in kwargs:
                kwargs["backend"] = fix(kwargs["backend"])
            return init(fix(backend), *args, **kwargs)

        def new_group_(*args: Any, **kwargs: Any) -> Any:
            if "backend" in kwargs:
                kwargs["backend"] = fix(kwargs["backend"])
            return new_group(*args, **kwargs)

        monkeypatch.setattr(dist, "init_process_group", init_process_group)
        monkeypatch.setattr(dist, "new_group", new_group_)


def _on_device(x: torch.Tensor, device: torch.device, fc: FakeCuda) -> torch.Tensor:
    """A factory's CPU result as the tensor on ``device`` it stands for: a DTensor keeps its mesh and placements
    around a CUDA local tensor (``to_empty`` of a model FSDP2 or TP sharded on meta)."""
    from torch.distributed.tensor import DTensor

    if isinstance(x, DTensor):
        local = CudaLike(x._local_tensor, device, fc)
        return DTensor.from_local(
            local, x.device_mesh, x.placements, run_check=False, shape=x.shape, stride=x.stride()
        ).requires_grad_(x.requires_grad)
    return CudaLike(x, device, fc)


def _first_cuda(tree: Any) -> torch.device | None:
    found: list[torch.device] = []

    def visit(x: Any) -> Any:
        if isinstance(x, CudaLike) and not found:
            found.append(x.device)
        return x

    tree_map(visit, tree)
    return found[0] if found else None


def _is_random(func: Any) -> bool:
    return func in (
        torch.rand,
        torch.randn,
        torch.randint,
        torch.randperm,
        torch.normal,
        torch.bernoulli,
        torch.multinomial,
        torch.rand_like,
        torch.randn_like,
        torch.randint_like,
    )


_ACTIVE: FakeCuda | None = None


def fake_nccl() -> None:
    """Register ``fakenccl``: torch's fake process group, for ``cuda`` tensors only (idempotent)."""
    if "fakenccl" in dist.Backend.backend_list:
        return
    from torch.testing._internal.distributed.fake_pg import _create_fake_pg  # what torch's own tests use

    dist.Backend.register_backend("fakenccl", _create_fake_pg, extended_api=True, devices=["cuda"])


@contextlib.contextmanager
def install(fc: FakeCuda, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeCuda]:
    """Put ``fc`` in place of torch's CUDA runtime until the block ends."""
    global _ACTIVE
    assert _ACTIVE is None, "one FakeCuda at a time"
    cuda = torch.cuda
    C = torch._C

    def set_stream(stream_id: int, device_index: int, device_type: int) -> None:
        fc._set_current(device_index)  # torch's setStream makes the stream's device current, as CUDA does
        streams = getattr(fc._local, "streams", None) or {}
        streams[device_index] = stream_id
        fc._local.streams = streams

    def get_stream(index: int | None) -> tuple[int, int, int]:
        index = fc.current if index is None or index < 0 else index
        return ((getattr(fc._local, "streams", None) or {}).get(index, 0), index, 1)

    def exchange(index: int) -> int:
        prev = fc.current
        if index >= 0 and index != prev:
            fc._set_current(index)
        return prev

    def maybe_exchange(index: int) -> int:  # restores without opening a context where none is
        prev = fc.current
        if index >= 0:
            fc._set_current(index, touch=False)
        return prev

    props = types.SimpleNamespace(
        name=fc.name,
        total_memory=fc.memory,
        major=fc.capability[0],
        minor=fc.capability[1],
        multi_processor_count=108,
    )
    patches: dict[Any, dict[str, Any]] = {
        C: {
            "_cuda_setDevice": lambda i: fc._set_current(int(i)),
            "_cuda_getDevice": lambda: fc.current,
            "_cuda_getDeviceCount": lambda: fc.devices,
            "_cuda_getCurrentStream": get_stream,
            "_cuda_getDefaultStream": lambda i: (0, fc.current if i is None or i < 0 else i, 1),
            "_cuda_setStream": set_stream,
            "_cuda_exchangeDevice": exchange,
            "_cuda_maybeExchangeDevice": maybe_exchange,
            "_cuda_synchronize": lambda: None,
        },
        cuda: {
            "is_available": lambda: True,
            "is_initialized": lambda: True,
            "_lazy_init": lambda: None,
            "_exchange_device": exchange,
            "_maybe_exchange_device": maybe_exchange,
            "device_count": lambda: fc.devices,
            "Stream": _FakeStream,
            "Event": _FakeEvent,
            "manual_seed_all": lambda seed: fc.seed_all(seed),
            "manual_seed": lambda seed: fc.seed_all(seed),
            "seed_all": lambda: None,
            "get_rng_state": lambda device="cuda": fc.generator(fc._device(device).index).get_state(),
            "set_rng_state": lambda state, device="cuda": fc.generator(fc._device(device).index).set_state(state),
            "get_rng_state_all": lambda: [fc.generator(i).get_state() for i in range(fc.devices)],
            "set_rng_state_all": lambda states: [fc.generator(i).set_state(s) for i, s in enumerate(states)],
            "memory_allocated": lambda device=None: fc.allocated(device),
            "max_memory_allocated": lambda device=None: fc.peak(device),
            "memory_reserved": lambda device=None: fc.allocated(device),
            "max_memory_reserved": lambda device=None: fc.peak(device),
            "reset_peak_memory_stats": lambda device=None: fc.reset_peak(device),
            "mem_get_info": lambda device=None: (fc.memory - fc.allocated(device), fc.memory),
            "empty_cache": lambda: None,
            "cudart": fc._cudart,
            "get_device_properties": lambda device=None: props,
            "get_device_capability": lambda device=None: fc.capability,
            "get_device_name": lambda device=None: fc.name,
            "is_bf16_supported": lambda including_emulation=True: fc.capability >= (8, 0),
        },
    }
    for obj, attrs in patches.items():
        for name, value in attrs.items():
            monkeypatch.setattr(obj, name, value, raising=False)
    # Module.to("cuda") would otherwise set ``param.data`` to the wrapper: a plain Parameter with CUDA keys and no
    # data, which no kernel takes; new Parameters around the wrappers are what a real move gives in effect
    monkeypatch.setattr(torch.__future__, "_overwrite_module_params_on_conversion", True)
    # ... but a move to where every tensor already is keeps the module's Parameters, as a real one does (an
    # optimizer built before DeepSpeed's engine moves the module must still hold the module's parameters)
    module_to = torch.nn.Module.to

    def to(self: torch.nn.Module, *args: Any, **kwargs: Any) -> torch.nn.Module:
        device, dtype, _non_blocking, fmt = torch._C._nn._parse_to(*args, **kwargs)
        if device is not None and dtype is None and fmt is None:
            target = fc._device(device) if torch.device(device).type == "cuda" else torch.device(device)
            tensors = [*self.parameters(), *self.buffers()]
            if tensors and all(t.device == target for t in tensors):
                return self
        return module_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "to", to)
    _ACTIVE = fc
    mode = _Factories(fc)
    # a torch function mode holds for the thread that entered it: threads started from here on enter it too (a
    # prefetch thread's .to("cuda"), a staging pool's factories)
    run = threading.Thread.run

    def run_in_mode(self: threading.Thread) -> None:
        with mode, torch.no_grad():
            run(self)

    monkeypatch.setattr(threading.Thread, "run", run_in_mode)
    try:
        # autograd would record any op on a CUDA tensor that requires grad (a Parameter's .cpu()), and its engine
        # aborts the process on a CUDA device in a CPU build: gradients stay off while the harness is in place
        with mode, torch.no_grad():
            yield fc
    finally:
        _ACTIVE = None


def _fake_rank(rank: int, world: int, port: int, fn: Callable[..., Any], q: Any) -> None:
    from hpcdist.env import destroy_process_group, from_environ
    from tests.dist.harness import rank_environ

    rank_environ(rank, world, port)
    monkeypatch = pytest.MonkeyPatch()
    try:
        with install(FakeCuda(8), monkeypatch) as fc:
            fc.nccl_is_fake(monkeypatch)
            try:
                q.put((rank, "ok", pickle.dumps(fn(from_environ(), fc))))
            finally:
                destroy_process_group()
    except BaseException:
        q.put((rank, "error", traceback.format_exc()))
    finally:
        monkeypatch.undo()


def fake_ranks(world: int, fn: Callable[[Any, FakeCuda], Any], *, timeout: float = 120) -> list[Any]:
    """``[fn(env, fc) for each rank]`` on ``world`` fork-started ranks of one fake 8-GPU node: each its own
    :class:`FakeCuda` with ``nccl`` meaning ``fakenccl`` and a torchrun environment, so ``from_environ`` gives it
    ``cuda:<rank>`` and the ``nccl`` backend, as on a GPU node; ``fn`` joins the process group itself. CPU tensors
    meet real gloo across the ranks; CUDA collectives are fakenccl's (they check devices and move no data). Raises
    with the failing rank's traceback."""
    from tests.dist.harness import fork_ranks

    return fork_ranks(world, _fake_rank, (fn,), timeout=timeout)
