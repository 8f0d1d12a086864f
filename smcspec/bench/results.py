"""Append-only JSON-lines result files. Each line is one finished measurement with a `key`; a
rerun skips keys already present, so an interrupted run resumes and keeps what it has."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class ResultLog:
    def __init__(self, path: str | Path, header: dict[str, Any]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.done = self.existing(self.path)
        if not self.path.exists() or self.path.stat().st_size == 0:
            self._write({"kind": "header", **header})

    @staticmethod
    def existing(path: str | Path) -> set[str]:
        """The keys a result file holds already."""
        return {r["key"] for r in read(path) if "key" in r}

    def has(self, key: str) -> bool:
        return key in self.done

    def add(self, key: str, record: dict[str, Any]) -> None:
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
