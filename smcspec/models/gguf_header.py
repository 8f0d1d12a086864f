"""A GGUF file's header: its metadata and tensor table, read without touching the tensor data.

`Header` walks past the vocabulary's string arrays instead of building them: gguf's `GGUFReader`
makes a numpy view of every element of them, 7 s a file for Qwen2.5's 152k tokens and 151k
merges, and a cold start read each file three times."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

# GGUF's metadata value types: fixed-size scalars by struct format; 8 is a string, 9 an array
_SCALARS = dict(zip((0, 1, 2, 3, 4, 5, 6, 7, 10, 11, 12), "BbHhIif?Qqd", strict=True))
_STRING, _ARRAY = 8, 9
GGUF_VERSIONS = (2, 3)


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a GGUF file's table: its GGUF name, shape in torch order (ggml lists the
    innermost dimension first), quantization type, and where its bytes lie in the file."""

    name: str
    shape: tuple[int, ...]
    qtype: int  # gguf.GGMLQuantizationType
    offset: int  # of its first byte in the file
    nbytes: int


@dataclass(frozen=True)
class Header:
    """A GGUF file's metadata and tensor table, read without touching the tensor data. String
    arrays (the vocabulary, the merges) are walked past and kept as their length; scalars,
    strings and arrays of numbers are kept as values."""

    metadata: dict[str, Any]
    tensors: dict[str, TensorEntry]

    @classmethod
    def read(cls, path: str | Path) -> Header:
        """The header of the GGUF file at `path`; ValueError naming the file where it is none
        (no magic bytes, another version, cut short)."""
        try:
            return cls._read(path)
        except (struct.error, UnicodeDecodeError, KeyError) as err:
            raise ValueError(f"{path} is not a readable GGUF file ({err})") from None

    @classmethod
    def _read(cls, path: str | Path) -> Header:
        import gguf

        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise ValueError(f"{path} is not a GGUF file (no GGUF magic bytes)")
            version, tensor_count, kv_count = struct.unpack("<IQQ", f.read(20))
            if version not in GGUF_VERSIONS:
                raise ValueError(f"{path}: GGUF version {version} is not supported")
            metadata = {}
            for _ in range(kv_count):
                key = _string(f)
                (kind,) = struct.unpack("<I", f.read(4))
                metadata[key] = _value(f, kind)
            table = []
            for _ in range(tensor_count):
                name = _string(f)
                (dims,) = struct.unpack("<I", f.read(4))
                shape = struct.unpack(f"<{dims}Q", f.read(8 * dims))
                qtype, offset = struct.unpack("<IQ", f.read(12))
                table.append((name, tuple(int(d) for d in reversed(shape)), qtype, offset))
            align = int(metadata.get("general.alignment", 32))
            data_start = -(-f.tell() // align) * align
        tensors = {}
        for name, shape, qtype, offset in table:
            try:
                block, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
            except ValueError:
                raise ValueError(f"{path}: tensor {name} is of unknown ggml type {qtype}") from None
            count = int(np.prod(shape, dtype=np.int64))
            nbytes = count // block * block_bytes
            tensors[name] = TensorEntry(name, shape, qtype, data_start + offset, nbytes)
        return cls(metadata, tensors)

    def field(self, key: str, default=None):
        value = self.metadata.get(key)
        if value is None:
            if default is None:
                raise ValueError(f"GGUF file lacks {key}")
            return default
        return value


def _string(f: BinaryIO) -> str:
    (length,) = struct.unpack("<Q", f.read(8))
    raw = f.read(length)
    if len(raw) != length:
        raise struct.error(f"a string of {length} bytes cut short")
    return raw.decode("utf-8")


def _value(f: BinaryIO, kind: int):
    if kind in _SCALARS:
        fmt = "<" + _SCALARS[kind]
        return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]
    if kind == _STRING:
        return _string(f)
    if kind != _ARRAY:
        raise ValueError(f"GGUF metadata value of unknown type {kind}")
    item, count = struct.unpack("<IQ", f.read(12))
    if item in _SCALARS:
        fmt = f"<{count}{_SCALARS[item]}"
        return list(struct.unpack(fmt, f.read(struct.calcsize(fmt))))
    if item == _STRING:  # walked past: the vocabulary and merges, read by the tokenizer
        for _ in range(count):
            (length,) = struct.unpack("<Q", f.read(8))
            f.seek(length, 1)
        return count
    return [_value(f, item) for _ in range(count)]
