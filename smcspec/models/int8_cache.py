"""int8 weights kept on disk, so that a model is quantized once, not at every load.

The cache holds every linear layer of the native model as quantized (`layers.Int8Linear`): the
int8 matrix `<name>.q` [out, in] and its per-channel scales `<name>.scale` [out] (the norms and
embeddings stay in the source, which is read lazily). It is a safetensors file, written layer
by layer, next to the source weights (or, where that folder is read-only, under the smcspec
cache), with a stamp naming the source files (size, modification time, SHA-256) and the cache
format. A stamp that does not match the source, or a format from another version, means the
cache is rebuilt.

Cold (no cache): the float weights are read tensor by tensor and quantized layer by layer, so at
most one layer's float copy is held beside the int8 ones; the cache is then written. Warm: the
int8 tensors are read one linear at a time and packed.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import secrets
import struct
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch

from smcspec.models import defaults

FORMAT = 1  # bump when the cached tensors' meaning changes
_DTYPES = {torch.int8: "I8", torch.float32: "F32"}
# (name, dtype, shape, a function that makes the tensor when it is written)
Entry = tuple[str, torch.dtype, tuple[int, ...], Callable[[], torch.Tensor]]


class LazyWeights:
    """A safetensors folder's tensors, read on access and never all at once: `pop` and `[]`
    open the file, copy the one tensor out, and close it again (so no mapping stays behind)."""

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
    """The files a model is read from: a folder's *.safetensors, or a .gguf file."""
    return [spec] if spec.suffix == ".gguf" else sorted(spec.glob("*.safetensors"))


def stamp(files: list[Path], with_digest: bool) -> dict:
    """What identifies the source: each file's name, size and modification time, and (when
    building) its SHA-256, with the cache format."""
    entries = []
    for f in files:
        st = f.stat()
        entry = {"name": f.name, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
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


def _same(saved: dict, now: dict) -> bool:
    def key(s: dict) -> list:
        return [(e["name"], e["size"], e["mtime_ns"]) for e in s.get("files", [])]

    return saved.get("format") == now["format"] and key(saved) == key(now)


def location(spec: Path, cache_root: Path | None = None) -> Path:
    """Where the cache of `spec` lives: beside it when that folder is writable, else under
    `cache_root` (default: $SMCSPEC_CACHE or ~/.cache/smcspec) in int8/<hash of its path>."""
    folder = spec.parent if spec.suffix == ".gguf" else spec
    name = f"{spec.stem}.int8" if spec.suffix == ".gguf" else "smcspec-int8"
    if os.access(folder, os.W_OK):
        return folder / name
    key = hashlib.sha256(str(spec.resolve()).encode()).hexdigest()[:16]
    return defaults.cache_root(cache_root) / "int8" / key / name


def load(spec: Path, cache_root: Path | None = None) -> LazyWeights | None:
    """The cached int8 tensors of `spec` (lazily read), or None when there is no valid cache."""
    where = location(spec, cache_root)
    tensors, stamp_file = where.with_suffix(".safetensors"), where.with_suffix(".json")
    if not (tensors.is_file() and stamp_file.is_file()):
        return None
    try:
        saved = json.loads(stamp_file.read_text())
    except ValueError:
        return None
    if not _same(saved, stamp(source_files(spec), with_digest=False)):
        return None
    return LazyWeights([tensors])


def save(spec: Path, tensors: list[Entry], cache_root: Path | None = None) -> Path | None:
    """Write the int8 tensors of `spec` and then its stamp; a half-written cache never has a
    stamp, so it is never read. Returns the file, or None when nowhere is writable."""
    where = location(spec, cache_root)
    try:
        where.parent.mkdir(parents=True, exist_ok=True)
        target = where.with_suffix(".safetensors")
        # its own name per writer: two processes building the same cache at once each write a
        # whole file and replace the target with it, never one file between them
        partial = target.with_suffix(f".partial-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            _write(partial, tensors)
            os.replace(partial, target)
        finally:
            partial.unlink(missing_ok=True)
        now = stamp(source_files(spec), with_digest=True)
        where.with_suffix(".json").write_text(json.dumps(now, indent=1))
    except OSError:
        return None
    return target


def _write(path: Path, entries: list[Entry]) -> None:
    """A safetensors file written one tensor at a time: the header comes from the entries'
    dtypes and shapes, then each tensor is made, written and dropped."""
    header: dict[str, dict] = {}
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
            out.write(t.contiguous().cpu().numpy().tobytes())
