"""The one locator of the YAML files shipped inside the package: model presets, cluster and NCCL profiles, and
the example job configs (``examples/``: byte copies of the checkout's ``configs/demo.yaml`` and ``train_13b.yaml``,
a test fails on drift) that ``hpcdist train demo`` names.

They live here, as package data, rather than under the checkout's ``configs/`` so that a wheel or a plain
``pip install .`` finds them too; ``configs/`` keeps only user-facing example jobs. Each kind is a directory
``hpcdist/resources/<kind>/<name>.yaml``. Torch-free and cheap: it only lists and opens files.
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import sys
import tempfile
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Literal, get_args

if TYPE_CHECKING:  # only the annotation needs it; importlib.resources.abc is 3.11+, importlib.abc's goes in 3.14
    if sys.version_info >= (3, 11):
        from importlib.resources.abc import Traversable
    else:
        from importlib.abc import Traversable

__all__ = ["KINDS", "Kind", "names", "path", "paths"]

Kind = Literal["models", "cluster", "nccl", "examples"]
"""models: ModelArgs presets (``model.preset``); cluster: ClusterConfig profiles; nccl: NCCL/GLOO env profiles;
examples: job configs a command may name instead of a path (``hpcdist train demo``)."""
KINDS: tuple[Kind, ...] = get_args(Kind)
SUFFIX = ".yaml"


@functools.cache
def _extract_dir() -> Path:
    """A private directory for files copied out of a zipped install, removed when this process exits."""
    root = Path(tempfile.mkdtemp(prefix="hpcdist-resources-"))
    owner = os.getpid()

    def remove() -> None:
        if os.getpid() == owner:  # a forked child that exits normally must not delete its parent's copies
            shutil.rmtree(root, ignore_errors=True)

    atexit.register(remove)
    return root


def _dir(kind: Kind) -> Traversable:
    if kind not in KINDS:
        raise ValueError(f"unknown resource kind {kind!r}: choose one of {', '.join(KINDS)}")
    return resources.files(__name__).joinpath(kind)


def names(kind: Kind) -> list[str]:
    """Names (file stems) of the shipped ``kind`` files, sorted; what a config may name instead of a path."""
    folder = _dir(kind)
    if not folder.is_dir():
        return []
    return sorted(f.name.removesuffix(SUFFIX) for f in folder.iterdir() if f.is_file() and f.name.endswith(SUFFIX))


def path(kind: Kind, name: str) -> Path:
    """Filesystem path of the shipped file ``name`` of ``kind``; KeyError (with the choices) when there is none."""
    if name not in names(kind):
        raise KeyError(f"no shipped {kind} file {name!r}: choose one of {', '.join(names(kind))}")
    entry = _dir(kind).joinpath(name + SUFFIX)
    if isinstance(entry, Path):  # the usual case: an unpacked install or a source checkout
        return entry
    # A zipped install: copy out under the same <kind>/<name>.yaml, since callers use the file name (a cluster's
    # default name is its file's stem); importlib.resources.as_file would pick a random one.
    out = _extract_dir() / kind / entry.name
    if not out.is_file():
        out.parent.mkdir(exist_ok=True)
        out.write_bytes(entry.read_bytes())
    return out


def paths(kind: Kind) -> list[Path]:
    """Paths of every shipped file of ``kind``, in ``names`` order."""
    return [path(kind, n) for n in names(kind)]
