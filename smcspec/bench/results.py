"""Append-only JSON-lines result files. Each line is one finished measurement with a `key`; a
rerun skips keys already present, so an interrupted run resumes and keeps what it has. A run
resumed on another machine than the one the file last saw says so in a `resumed` line, so the
records after it are not credited to the header's machine."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class ResultLog:
    def __init__(self, path: str | Path, header: dict[str, Any]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        records = read(self.path)
        self.done = _keys(records)
        self.moved: dict[str, Any] | None = None  # written before the first record it explains
        if not self.path.exists() or self.path.stat().st_size == 0:
            self._write({"kind": "header", **header})
            return
        with self.path.open("rb+") as f:  # a line torn by a kill is ended, or the next record
            f.seek(-1, 2)  # would join it and be lost with it
            if f.read(1) != b"\n":
                f.write(b"\n")
        if "machine" in header and _machines(records)[-1:] != [header["machine"]]:
            self.moved = {"kind": "resumed", "machine": header["machine"], "after": len(self.done)}

    @staticmethod
    def existing(path: str | Path) -> set[str]:
        """The keys a result file holds already."""
        return _keys(read(path))

    def has(self, key: str) -> bool:
        return key in self.done

    def add(self, key: str, record: dict[str, Any]) -> None:
        if self.moved:
            self._write(self.moved)
            self.moved = None
        self._write({"key": key, **record})
        self.done.add(key)

    def _write(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()


def read(path: str | Path) -> list[dict[str, Any]]:
    """All complete records of a result file; a torn last line (killed mid-write) is ignored."""
    path = Path(path)
    if not path.exists():
        return []
    return list(_records(path))


def _records(path: Path) -> Iterator[dict[str, Any]]:
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            yield json.loads(line)
        except json.JSONDecodeError:
            continue


def measurements(path: str | Path) -> list[dict[str, Any]]:
    return [r for r in read(path) if "key" in r]


def header(path: str | Path) -> dict[str, Any]:
    return next((r for r in read(path) if r.get("kind") == "header"), {})


def provenance(path: str | Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A result file's header and the machines its records ran on, from one read."""
    records = read(path)
    return next((r for r in records if r.get("kind") == "header"), {}), _machines(records)


def machines(path: str | Path) -> list[dict[str, Any]]:
    """The machines a result file's records ran on, in order: its header's, then each one a
    resumed run moved to."""
    return _machines(read(path))


def _keys(records: list[dict[str, Any]]) -> set[str]:
    return {r["key"] for r in records if "key" in r}


def _machines(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        r["machine"] for r in records if r.get("kind") in ("header", "resumed") and "machine" in r
    ]
