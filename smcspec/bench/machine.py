"""What a result was measured on: recorded in every result file."""

from __future__ import annotations

import dataclasses
import os
import platform
import socket

import torch

from smcspec.engine.timing import cpu_model as cpu_model
from smcspec.engine.timing import drain as drain


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


def ran_on(machines: list[dict]) -> str:
    """Where a result file's records ran: its header's machine, then each one a resumed run moved
    to."""
    if not machines:
        return "machine not recorded"
    first, *later = machines
    return one_line(first) + "".join(f", resumed on {one_line(m)}" for m in later)


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


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a server this process starts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
