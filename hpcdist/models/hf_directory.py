"""The one reader and judge of a Hugging Face Llama directory: whatever hpcdist reads from one comes through here.

Such a directory is often another user's (a shared scratch space, a copied download), so every file in it is hostile
input (docs/SECURITY.md). :func:`open_hf_dir` checks, in this order and before any tensor is allocated:

* every file it opens (config.json, the index, each weight file, the tokenizer's) is an entry of the directory
  itself: an index entry is a plain file name (no ``/``, no ``..``, no absolute path), opened with ``O_NONBLOCK``
  (a FIFO opens at once instead of waiting for a writer forever) and ``O_NOFOLLOW``, then ``fstat``-ed: only a
  regular file is read. A symbolic link is followed only when it is yours or root's (the Hugging Face cache links
  ``snapshots/<rev>/model.safetensors`` to ``../../blobs/<sha>``); another user's link is refused;
* every read is bounded: config.json and the index by a size cap, a safetensors header by its 8-byte length, at most
  safetensors' own 100 MB limit, and never past the end of the file;
* config.json is parsed like the YAML's model section (:func:`hpcdist.models.hf_config.model_args_from_hf`: types,
  ranges, finite numbers, the same maxima);
* the memory the command will need for the model config.json describes is compared with what this machine (and its
  cgroup) has available;
* every tensor config.json implies is in the files with the shape it implies and a float dtype; a layer past
  ``num_hidden_layers`` is refused; each header's data regions are contiguous and inside the file (what safetensors
  itself checks), so a tensor's bytes are exactly its shape times its dtype's size.

Each problem is one HFConfigError (a ValueError: the CLI prints one line, exit 2) naming the file and the key.
Torch-free: the config checks run it when ``checkpoint.init_from`` names a Hugging Face directory, before any process
starts. :class:`hpcdist.hf.import_.HFWeights` turns the bytes :meth:`HFDirectory.read` returns into tensors. It
lives beside :mod:`hpcdist.models.hf_config` for the same reason: the config layer may import neither torch nor
``hpcdist.hf`` (which imports the checkpoint code, which imports the config layer).
"""

from __future__ import annotations

import json
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from hpcdist.models.args import ModelArgs, num_params
from hpcdist.models.hf_config import CONFIG_NAME, HFConfigError, fqn_names, fqn_to_hf, hf_shape, model_args_from_hf

__all__ = ["FLOAT_DTYPES", "HFDirectory", "Purpose", "TensorEntry", "available_memory", "open_hf_dir"]

SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model")
CONFIG_CAP = 1 << 20  # a Llama config.json is about 1 KB
INDEX_CAP = 16 << 20  # ~100 bytes per tensor: a 405B model's index (1,100 tensors) is about 100 KB
HEADER_CAP = 100_000_000  # safetensors' own limit for a header (its HeaderTooLarge)
TOKENIZER_CAP = 256 << 20  # Llama 3's tokenizer.json is 9 MB, Gemma's 34 MB
FLOAT_DTYPES = {"F32": 4, "BF16": 2, "F16": 2, "F64": 8}  # what the import converts to float32
_KINDS = (
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISCHR, "a device"),
    (stat.S_ISBLK, "a device"),
)
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
Purpose = Literal["import", "generate", "init_from"]


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file as its (checked) header describes it."""

    file: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    """Where its bytes start in ``file`` (header included)."""
    nbytes: int


@dataclass(frozen=True)
class HFDirectory:
    """A checked Hugging Face Llama directory: its ModelArgs and where each tensor those args imply lies."""

    path: Path
    args: ModelArgs
    tensors: dict[str, TensorEntry]
    """Hugging Face name -> entry, for exactly the tensors ``args`` implies."""

    def read(self, name: str) -> bytearray:
        """The raw bytes of tensor ``name`` (little-endian, its header's dtype), opened and bounded as when checked:
        a file swapped since (for a FIFO, a link, a shorter file) is refused, never waited on or read past."""
        entry = self.tensors[name]
        fd, size = _open_member(self.path, entry.file, what="weights")
        try:
            if entry.offset + entry.nbytes > size:
                raise HFConfigError(
                    f"{self.path / entry.file}: {name}: the file is {size:,} bytes now, shorter than "
                    "when it was checked: it changed while being read; copy the directory and retry"
                )
            return _pread_exact(fd, entry.offset, entry.nbytes, self.path / entry.file)
        finally:
            os.close(fd)


def open_hf_dir(path: str | Path, *, purpose: Purpose | None) -> HFDirectory:
    """Check the Hugging Face Llama directory ``path`` for ``purpose`` (what the memory check counts: ``generate``
    holds the whole model in float32, ``import`` and ``init_from`` one tensor at a time; None: no memory check, for
    the config check of ``checkpoint.init_from``, which may run on a login node while the memory that counts is the
    compute node's, checked again there) and say where its tensors are. Nothing is allocated from the files' word
    before it is checked. HFConfigError, one line."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise HFConfigError(f"{path}: not a directory")
    where = str(path / CONFIG_NAME)
    if not os.path.lexists(path / CONFIG_NAME):
        raise HFConfigError(f"{path}: no {CONFIG_NAME}: not a Hugging Face model directory")
    args = model_args_from_hf(_read_member_json(path, CONFIG_NAME, CONFIG_CAP), where=where)
    if purpose is not None:
        _check_host_memory(path, args, purpose)
    for name in TOKENIZER_FILES:  # read later by the tokenizers library by name: only regular, bounded files
        if os.path.lexists(path / name):
            os.close(_open_member(path, name, what="tokenizer", cap=TOKENIZER_CAP)[0])
    if os.path.lexists(path / INDEX):
        index = _read_member_json(path, INDEX, INDEX_CAP)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict):
            raise HFConfigError(f"{path / INDEX}: weight_map: expected a mapping of tensor names to file names")
        for name, file in weight_map.items():
            _check_entry_name(path, name, file)
        headers = {file: _read_header(path, file) for file in sorted(set(weight_map.values()))}
    elif os.path.lexists(path / SINGLE):
        headers = {SINGLE: _read_header(path, SINGLE)}
        weight_map = dict.fromkeys(headers[SINGLE], SINGLE)
    else:
        raise HFConfigError(f"{path}: no {SINGLE} or {INDEX} (only safetensors weights are read)")
    return HFDirectory(path, args, _match(path, args, weight_map, headers))


def _match(
    path: Path, args: ModelArgs, weight_map: dict[str, str], headers: dict[str, dict[str, TensorEntry]]
) -> dict[str, TensorEntry]:
    """Each tensor ``args`` implies, from the file the map names, with the shape and a dtype it must have."""
    problems: list[str] = []
    tensors: dict[str, TensorEntry] = {}
    for fqn in fqn_names(args):
        name, want = fqn_to_hf(fqn), hf_shape(fqn, args)
        file = weight_map.get(name)
        entry = headers[file].get(name) if file is not None else None
        if file is None:
            problems.append(f"{path}: the weights lack {name}, which {CONFIG_NAME} implies")
        elif entry is None:
            problems.append(f"{path / INDEX}: weight_map names {file} for {name}, which that file does not hold")
        elif entry.shape != want:
            problems.append(
                f"{path / file}: {name} has shape {list(entry.shape)} but {CONFIG_NAME} implies "
                f"{list(want)}: the weights and the config describe different models"
            )
        elif entry.dtype not in FLOAT_DTYPES:
            problems.append(
                f"{path / file}: {name} has dtype {entry.dtype}; hpcdist reads {', '.join(FLOAT_DTYPES)} weights"
            )
        else:
            tensors[name] = entry
    extra = sorted({int(m.group(1)) for n in weight_map if (m := _LAYER.match(n)) and int(m.group(1)) >= args.n_layers})
    if extra:
        problems.append(
            f"{path}: the weights hold layer {extra[0]} but {CONFIG_NAME} has num_hidden_layers="
            f"{args.n_layers}: the weights and the config describe different models"
        )
    if problems:
        more = f" (and {len(problems) - 1} more problem{'s' if len(problems) > 2 else ''})" if len(problems) > 1 else ""
        raise HFConfigError(problems[0] + more)
    return tensors


# ------------------------------------------------------------------------------------------------------- files
def _check_entry_name(path: Path, name: Any, file: Any) -> None:
    """An index entry names a file of the directory itself by its plain name (Hugging Face writes nothing else):
    not ``../x``, ``/etc/passwd`` or ``sub/x``, so the index cannot make hpcdist read another file as weights."""
    if not isinstance(name, str) or not isinstance(file, str):
        raise HFConfigError(
            f"{path / INDEX}: weight_map: {str(name)[:100]!r} -> {str(file)[:100]!r}: expected a "
            "tensor name and a file name (text)"
        )
    if file in ("", ".", "..") or "/" in file or "\0" in file or len(file.encode("utf-8", "replace")) > 255:
        raise HFConfigError(
            f"{path / INDEX}: weight_map: {name[:100]} -> {file[:100]!r}: not the name of a file in "
            f"{path}; an index names the directory's own files only"
        )


def _open_member(directory: Path, name: str, *, what: str, cap: int | None = None) -> tuple[int, int]:
    """(fd, size) of the regular file ``name`` of ``directory``; never blocks (a FIFO is refused, not waited on)."""
    path = directory / name
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise HFConfigError(f"{path}: no such file ({what})") from None
    except OSError as e:
        raise HFConfigError(f"{path}: cannot be read ({e.strerror})") from None
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    if stat.S_ISLNK(st.st_mode):
        if st.st_uid not in (os.getuid(), 0):
            raise HFConfigError(
                f"{path}: a symbolic link made by another user (uid {st.st_uid}); hpcdist follows "
                "only your own links: copy the file it points to into the directory"
            )
    else:
        flags |= getattr(os, "O_NOFOLLOW", 0)  # replaced by a link since the lstat: refused (ELOOP), not followed
    try:
        fd = os.open(path, flags)
    except OSError as e:
        raise HFConfigError(f"{path}: cannot be opened ({e.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = next((k for test, k in _KINDS if test(st.st_mode)), "a socket or other")
            raise HFConfigError(f"{path}: not a regular file ({kind}); the {what} must be a plain file")
        if cap is not None and st.st_size > cap:
            raise HFConfigError(f"{path}: {st.st_size:,} bytes, more than the {cap:,} a {what} file may have")
    except BaseException:
        os.close(fd)
        raise
    return fd, st.st_size


def _pread_exact(fd: int, offset: int, n: int, path: Path) -> bytearray:
    buf = bytearray(n)
    view, done = memoryview(buf), 0
    while done < n:
        try:
            got = os.preadv(fd, [view[done:]], offset + done)
        except OSError as e:
            raise HFConfigError(f"{path}: reading failed ({e.strerror})") from None
        if got == 0:
            raise HFConfigError(f"{path}: ends after {offset + done:,} bytes; {offset + n:,} expected (truncated)")
        done += got
    return buf


def _parse_json(raw: bytes | bytearray, where: Path, what: str) -> Any:
    try:
        return json.loads(bytes(raw).decode("utf-8"))
    except RecursionError:
        raise HFConfigError(f"{where}: {what} is nested too deeply to be a Hugging Face file") from None
    except ValueError as e:  # UnicodeDecodeError included; a 5,000-digit integer too (int's digit limit)
        raise HFConfigError(f"{where}: {what} is not readable JSON ({' '.join(str(e).split())[:200]})") from None


def _read_member_json(directory: Path, name: str, cap: int) -> Any:
    fd, size = _open_member(directory, name, what=name, cap=cap)
    try:
        return _parse_json(_pread_exact(fd, 0, size, directory / name), directory / name, "the file")
    finally:
        os.close(fd)


def _read_header(directory: Path, file: str) -> dict[str, TensorEntry]:
    """The tensors a safetensors file's header describes, checked as safetensors checks them (a bounded header; data
    regions contiguous from 0 to the end of the file) and each shape's size against its region. Only the header is
    read."""
    path = directory / file
    fd, size = _open_member(directory, file, what="weights")
    try:
        if size < 8:
            raise HFConfigError(f"{path}: {size} bytes: not a safetensors file (no header)")
        n = int.from_bytes(_pread_exact(fd, 0, 8, path), "little")
        if n > HEADER_CAP or 8 + n > size:
            raise HFConfigError(
                f"{path}: the header claims {n:,} bytes (the file has {size:,}, safetensors allows "
                f"{HEADER_CAP:,}): not a safetensors file, or a damaged one"
            )
        header = _parse_json(_pread_exact(fd, 8, n, path), path, "the safetensors header")
    finally:
        os.close(fd)
    if not isinstance(header, dict):
        raise HFConfigError(f"{path}: the safetensors header is not a JSON object")
    data_size = size - 8 - n
    entries: dict[str, TensorEntry] = {}
    regions: list[tuple[int, int, str]] = []
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        entry, begin, end = _entry(path, file, name, meta, data_size, 8 + n)
        entries[name] = entry
        regions.append((begin, end, name))
    at = 0
    for begin, end, name in sorted(regions):
        if begin != at:
            raise HFConfigError(
                f"{path}: {name}: its data starts at byte {begin:,} of the data section, expected "
                f"{at:,} (regions overlap or leave a gap): a damaged or forged file"
            )
        at = end
    if at != data_size:
        raise HFConfigError(
            f"{path}: the tensors cover {at:,} bytes of a {data_size:,}-byte data section: a truncated or damaged file"
        )
    return entries


_ANY_DTYPE = {
    **FLOAT_DTYPES,
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "I32": 4,
    "U32": 4,
    "I64": 8,
    "U64": 8,
}


def _entry(path: Path, file: str, name: str, meta: Any, data_size: int, start: int) -> tuple[TensorEntry, int, int]:
    where = f"{path}: {name[:200]}"
    if not isinstance(meta, dict):
        raise HFConfigError(f"{where}: expected a mapping with dtype, shape and data_offsets")
    dtype, shape, offsets = meta.get("dtype"), meta.get("shape"), meta.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in _ANY_DTYPE:
        raise HFConfigError(f"{where}: dtype {str(dtype)[:40]!r} is not a safetensors dtype")
    if not isinstance(shape, list) or len(shape) > 8 or not all(_natural(d) for d in shape):
        raise HFConfigError(f"{where}: shape {str(shape)[:80]}: expected a list of at most 8 non-negative integers")
    if not (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(_natural(o) for o in offsets)
        and offsets[0] <= offsets[1] <= data_size
    ):
        raise HFConfigError(
            f"{where}: data_offsets {str(offsets)[:80]} do not lie in the file's {data_size:,}-byte "
            "data section: a truncated or forged file"
        )
    numel = 1
    for d in shape:
        numel *= d
    begin, end = offsets
    if numel * _ANY_DTYPE[dtype] != end - begin:
        raise HFConfigError(
            f"{where}: shape {shape} of {dtype} is {numel * _ANY_DTYPE[dtype]:,} bytes but its data "
            f"region is {end - begin:,}: a forged or damaged header"
        )
    return TensorEntry(file, dtype, tuple(shape), start + begin, end - begin), begin, end


def _natural(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


# ------------------------------------------------------------------------------------------------------ memory
def available_memory() -> int | None:
    """Bytes this process can still allocate: /proc/meminfo's MemAvailable, lowered by the cgroup's limit less its
    usage (a SLURM job's memory is its cgroup's); None where neither is known."""
    found: list[int] = []
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
                    break
    except (OSError, ValueError, IndexError):
        pass
    for limit, usage in _cgroup_memory_files():
        try:
            top, used = Path(limit).read_text().strip(), Path(usage).read_text().strip()
            if top.isdigit() and used.isdigit() and int(top) < 1 << 60:  # "max" or v1's huge "unlimited" value
                found.append(max(0, int(top) - int(used)))
        except OSError:
            continue
    return min(found) if found else None


def _cgroup_memory_files() -> list[tuple[str, str]]:
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            base = f"/sys/fs/cgroup{parts[2].rstrip('/')}"
            out.append((f"{base}/memory.max", f"{base}/memory.current"))
        elif "memory" in parts[1].split(","):
            base = f"/sys/fs/cgroup/memory{parts[2].rstrip('/')}"
            out.append((f"{base}/memory.limit_in_bytes", f"{base}/memory.usage_in_bytes"))
    return out


def memory_need(args: ModelArgs, purpose: Purpose) -> tuple[int, str]:
    """(bytes, what they hold) the command will allocate for the model ``args``: generate builds the whole model in
    float32 and its RoPE table (cos, sin and their angles) and reads one tensor at a time into it; import and
    init_from hold one tensor as read, in float32 and permuted."""
    hd = args.head_dim
    largest = 4 * max(args.vocab_size * args.dim, args.ffn_dim * args.dim, args.n_heads * hd * args.dim)
    if purpose == "generate":
        params = num_params(args)
        rope = 4 * args.max_seq_len * hd * 2  # angles, then cos and sin stacked
        return 4 * params + rope + 2 * largest, f"the model in float32 ({params:,} parameters) and its RoPE table"
    return 3 * largest, "its largest tensor as read, in float32 and permuted"


def _check_host_memory(path: Path, args: ModelArgs, purpose: Purpose) -> None:
    need, what = memory_need(args, purpose)
    have = available_memory()
    if have is not None and need > have:
        raise HFConfigError(
            f"{path / CONFIG_NAME}: {purpose} needs {need / 1e9:,.1f} GB for {what}; {have / 1e9:,.1f}"
            " GB is available here: use a machine with more memory, or check config.json (hidden_"
            "size, intermediate_size, vocab_size, max_position_embeddings)"
        )
