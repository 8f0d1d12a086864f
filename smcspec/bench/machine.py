"""What a result was measured on: recorded in every result file."""

from __future__ import annotations

import dataclasses
import os
import platform
from pathlib import Path

import torch


def drain() -> None:
    """Wait for queued GPU work before reading a clock: CUDA calls return before their kernels
    run, so a clock read without it times the launches. A no-op without CUDA."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe(precision: str, device: str = "cpu") -> dict:
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "gpu": gpu,
        "device": device,
        "torch": torch.__version__,
        "precision": precision,
        "python": platform.python_version(),
    }


def one_line(machine: dict) -> str:
    gpu = f", GPU {machine['gpu']}" if machine.get("gpu") else ", no GPU"
    return (
        f"{machine['cpu']} ({machine['cores']} cores, {machine['torch_threads']} torch threads)"
        f"{gpu}, torch {machine['torch']}, {machine['precision']} on {machine['device']}"
    )


def run_header(llm, precision: str, plan) -> dict:
    """What every result file starts with: machine, models, and the plan's settings (its
    contenders named by their labels)."""
    settings = {f.name: getattr(plan, f.name) for f in dataclasses.fields(plan)}
    settings["methods"] = [c.label for c in settings.pop("contenders")]
    return {
        "machine": describe(precision),
        "models": {"target": llm.names[0], "draft": llm.names[1]},
        "plan": settings,
    }
