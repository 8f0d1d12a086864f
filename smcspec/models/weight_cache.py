"""Quantized weights kept on disk, so that a model is quantized once, not at every load.

The cache holds every linear layer of the native model as quantized, one cache per `kind`:
"int4-b16-g<group>" and "int8-b16-g<group>" (`cpu_linear.PackedLinear`, smcspec's kernel:
`<name>.q4` [out / 16, in / 8, 64] or `<name>.q8` [out / 16, in / 4, 64], and `<name>.scales`
float16 [out / 16, in / group, 2, 16]), "int8" (`layers.Int8Linear`, fbgemm: the int8 matrix
`<name>.q` [out, in] and its per-channel scales `<name>.scale` [out]) or "int4-g<group>"
(`layers.AtenInt4Linear`, PyTorch's kernel: `<name>.packed` and `<name>.scales_zeros`
[in / group, out, 2]); the norms and embeddings stay in the source, which is read lazily. It
is a safetensors file, written layer by layer, next to the source weights (or, where that
folder is read-only, under the smcspec cache), with a stamp naming the cache format and, for
each source file, its name, size, modification time, inode, change time and SHA-256.

When the cache is trusted: hashing the source at every load would cost seconds per GB, so a
load reads only the files' metadata, and hashes only when the metadata cannot decide.

- Another format, or a source file's name, size or modification time differs: the source has
  changed; the cache is rebuilt, without reading the source.
- All of those match but the inode or the change time differs: the file may have been replaced
  in place by one of the same size and modification time (`cp -p`, `touch -r`, an archive
  extracted again; each of these sets the change time, which no user call can set back), or
  only moved, copied or `chmod`ed. The SHA-256 decides: the same bytes keep the cache (and the
  stamp takes the new metadata, so the hash runs once), other bytes rebuild it.
- Everything matches: the cache is read, with nothing hashed.

Cold (no cache): the float weights are read tensor by tensor and quantized layer by layer, so at
most one layer's float copy is held beside the quantized ones; the cache is then written. Warm:
the quantized tensors are read back one linear at a time, and only fbgemm's int8 is packed again.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import secrets
import struct
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch

FORMAT = 1  # bump when the cached tensors' meaning changes
_DTYPES = {torch.int8: "I8", torch.uint8: "U8", torch.float16: "F16", torch.float32: "F32"}
# (name, dtype, shape, a function that makes the tensor when it is written)
Entry = tuple[str, torch.dtype, tuple[int, ...], Callable[[], torch.Tensor]]
_CHANGED = ("name", "size", "mtime_ns")  # a difference here: the source changed
_REPLACED = ("inode", "ctime_ns")  # a difference here: maybe replaced; the SHA-256 decides


class LazyWeights:
    """A safetensors folder's tensors, read on access and never all at once: `pop` and `[]`
    open the file, take the one tensor out and close the file. safetensors hands the tensor out
    memory-mapped (measured with 0.8.0): its pages join the resident set as they are read and
    leave it with the tensor, so an embedding holds only the rows looked up."""

    def __init__(self, files: Iterable[Path]) -> None:
        from safetensors import safe_open

        self._where: dict[str, Path] = {}
        for f in files:
            with safe_open(str(f), framework="pt") as handle:
                self._where.update(dict.fromkeys(handle.keys(), f))

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(str(self._where[name]), framework="pt") as handle:
            return handle.get_tensor(name)

    def pop(self, name: str) -> torch.Tensor:
        tensor = self[name]
        del self._where[name]
        return tensor

    def keys(self) -> Iterator[str]:
        return iter(list(self._where))


def source_files(spec: Path) -> list[Path]:
    """The files a model is read from: a folder's *.safetensors but the cache beside them, or a
    .gguf file. (The cache once counted as a source of itself: its stamp named it, and every
    build hashed it.)"""
    if spec.suffix == ".gguf":
        return [spec]
    return [f for f in sorted(spec.glob("*.safetensors")) if not f.stem.startswith("smcspec-int")]


def stamp(files: list[Path], with_digest: bool) -> dict:
    """What identifies the source: each file's name, size, modification time, inode and change
    time, and (`with_digest`) its SHA-256, with the cache format."""
    entries = []
    for f in files:
        st = f.stat()
        entry = {"name": f.name, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
        entry |= {"inode": st.st_ino, "ctime_ns": st.st_ctime_ns}
        if with_digest:
            entry["sha256"] = _sha256(f)
        entries.append(entry)
    return {"format": FORMAT, "files": entries}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def _valid(saved: dict, files: list[Path]) -> dict | None:
    """The stamp under which a cache made with stamp `saved` holds for the source `files`, or
    None when it does not (the module docstring says when the SHA-256 is read)."""
    now = stamp(files, with_digest=False)
    if saved.get("format") != now["format"] or _fields(saved, _CHANGED) != _fields(now, _CHANGED):
        return None
    if _fields(saved, _REPLACED) == _fields(now, _REPLACED):
        return saved
    digests = [e.get("sha256") for e in saved["files"]]
    if digests != [_sha256(f) for f in files]:
        return None
    for entry, digest in zip(now["files"], digests, strict=True):
        entry["sha256"] = digest
    return now


def _fields(s: dict, names: tuple[str, ...]) -> list[tuple]:
    return [tuple(e.get(n) for n in names) for e in s.get("files", [])]


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """smcspec's cache folder: `cache_dir`, else $SMCSPEC_CACHE, else ~/.cache/smcspec."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("SMCSPEC_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "smcspec"


def location(spec: Path, kind: str, root: Path | None = None) -> Path:
    """Where the `kind` cache of `spec` lives: beside it when that folder is writable, else
    under `root` (default: `cache_root()`) in <kind>/<hash of its path>."""
    folder = spec.parent if spec.suffix == ".gguf" else spec
    name = f"{spec.stem}.{kind}" if spec.suffix == ".gguf" else f"smcspec-{kind}"
    if os.access(folder, os.W_OK):
        return folder / name
    key = hashlib.sha256(str(spec.resolve()).encode()).hexdigest()[:16]
    return cache_root(root) / kind / key / name


def suffixed(where: Path, suffix: str) -> Path:
    """A file of the cache at `where`: its name with `suffix` added (`with_suffix` would cut a
    .gguf stem's own dots: qwen2.5-coder... and gemma-3-270m.tokenizer alike)."""
    return where.with_name(where.name + suffix)


def load(spec: Path, kind: str, cache_root: Path | None = None) -> LazyWeights | None:
    """The cached `kind` tensors of `spec` (lazily read), or None when there is no valid
    cache."""
    where = location(spec, kind, cache_root)
    tensors, stamp_file = suffixed(where, ".safetensors"), suffixed(where, ".json")
    if not (tensors.is_file() and stamp_file.is_file()):
        return None
    try:
        saved = json.loads(stamp_file.read_text())
    except ValueError:
        return None
    if not isinstance(saved, dict):
        return None
    valid = _valid(saved, source_files(spec))
    if valid is None:
        return None
    if valid is not saved:
        # so that the next load need not hash again; if the folder is read-only, it will
        with contextlib.suppress(OSError):
            _write_stamp(stamp_file, valid)
    return LazyWeights([tensors])


def save(
    spec: Path, tensors: list[Entry], kind: str, cache_root: Path | None = None
) -> Path | None:
    """Write the `kind` tensors of `spec` and then its stamp; a half-written cache never has a
    stamp, so it is never read. Returns the file, or None when nowhere is writable."""
    where = location(spec, kind, cache_root)
    try:
        where.parent.mkdir(parents=True, exist_ok=True)
        target = suffixed(where, ".safetensors")
        # its own name per writer: two processes building the same cache at once each write a
        # whole file and replace the target with it, never one file between them
        partial = target.with_suffix(f".partial-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            write_safetensors(partial, tensors)
            os.replace(partial, target)
        finally:
            partial.unlink(missing_ok=True)
        _write_stamp(suffixed(where, ".json"), stamp(source_files(spec), with_digest=True))
    except OSError:
        return None
    return target


def _write_stamp(path: Path, value: dict) -> None:
    """Replace the stamp whole: a load never reads half of one (a refresh races other loads)."""
    write_whole(path, json.dumps(value, indent=1))


def write_whole(path: Path, text: str) -> None:
    """Replace `path` with `text` at once: a reader sees the old file or the new one, never half
    of one, and two writers at once each write a whole file."""
    partial = path.with_name(f"{path.name}.partial-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        partial.write_text(text)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def write_safetensors(
    path: Path, entries: list[Entry], metadata: dict[str, str] | None = None
) -> None:
    """A safetensors file written one tensor at a time: the header comes from the entries'
    dtypes and shapes, then each tensor is made, written and dropped, so that one tensor is held
    at a time. Entries sorted by name, with all tensors of one dtype, give the very bytes of
    safetensors' `save_file` (the same header, the same order)."""
    header: dict[str, dict] = {} if metadata is None else {"__metadata__": metadata}
    offset = 0
    for name, dtype, shape, _ in entries:
        size = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": _DTYPES[dtype], "shape": list(shape)}
        header[name]["data_offsets"] = [offset, offset + size]
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(text)))
        out.write(text)
        for name, dtype, shape, make in entries:
            t = make()
            assert t.dtype == dtype and tuple(t.shape) == tuple(shape), name
            out.write(t.contiguous().cpu().numpy().reshape(-1).data)  # no copy of the bytes
            del t


def give_back_freed() -> None:
    """Hand the C heap's free pages back to the system (glibc's `malloc_trim`) after a one-time
    job that made and dropped many temporaries (a conversion, a quantization): glibc keeps
    freed blocks below its mmap threshold, which it raises after the first large free, so
    their pages stay resident and the process's peak later stands on them. Nothing elsewhere."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    with contextlib.suppress(OSError, AttributeError, TypeError):
        ctypes.CDLL(name).malloc_trim(0)
