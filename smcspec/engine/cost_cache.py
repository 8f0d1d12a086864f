"""A pair's profiled step costs on disk: the key they depend on (`cache_key`: the pair, its
dtype and weights' kernel, device, torch threads and machine) and one JSON file per key under
the cache root, written whole or not at all."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from smcspec.engine.costs import StepCosts
from smcspec.engine.loading import cache_root
from smcspec.engine.timing import cpu_model


def cache_key(llm) -> dict[str, Any]:
    """What the costs depend on: the pair, its dtype and device, the kernel quantized weights
    run on, the torch threads the passes run on, and the machine (the GPU's name on a GPU, else
    the CPU's model)."""
    device = torch.device(llm.target.device)
    gpu = device.type == "cuda"
    return {
        "target": llm.names[0],
        "draft": llm.names[1],
        "dtype": str(llm.dtype),
        "weights": weights_kind(str(llm.dtype), getattr(llm, "backend", "native")),
        "device": str(device),
        "torch_threads": torch.get_num_threads(),
        "machine": torch.cuda.get_device_name(device) if gpu else cpu_model(),
    }


def weights_kind(dtype: str, backend: str) -> str:
    """Which kernel int8 or int4 weights run on, which build of smcspec's and on which of the
    CPU's units (a profile of fbgemm's int8 does not price smcspec's kernel, nor one build of it
    another, nor its vector path its AMX tiles); the dtype itself otherwise."""
    if dtype not in ("int8", "int4"):
        return dtype
    if backend == "hf":  # transformers' modules, int8 on fbgemm
        return f"{dtype}, hf backend"
    from smcspec.models import cpu_linear, layers

    kind = layers.cache_kind(dtype)
    if "-b16-" not in kind:
        return kind
    return f"{kind} {cpu_linear.build_key()} {cpu_linear.matrix_engine()}"


def cache_path(key: Mapping[str, Any], cache_dir: str | Path | None = None) -> Path:
    digest = hashlib.sha256(json.dumps(dict(key), sort_keys=True).encode()).hexdigest()
    return cache_root(cache_dir) / "costs" / f"{digest[:20]}.json"


def save(costs: StepCosts, cache_dir: str | Path | None = None) -> Path:
    path = cache_path(costs.key, cache_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(costs.to_json(), indent=1))
    partial.replace(path)  # a reader never sees half a file
    return path


def load(key: Mapping[str, Any], cache_dir: str | Path | None = None) -> StepCosts | None:
    """The costs cached under `key`, or None (none cached, or a file unreadable: profiled anew)."""
    path = cache_path(key, cache_dir)
    try:
        costs = StepCosts.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return costs if costs.key == dict(key) else None
