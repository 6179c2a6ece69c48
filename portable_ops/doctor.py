"""``python -m portable_ops doctor``: hardware found, backends available, and why any is not."""

from __future__ import annotations

import importlib.util
import platform

import torch

from . import dispatch
from .ops import OPS


def _hardware() -> list[str]:
    lines = [f"python {platform.python_version()}, torch {torch.__version__}, {platform.machine()}"]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            lines.append(f"cuda:{i}: {props.name}, {props.total_memory / 2**30:.0f} GiB, "
                         f"compute capability {props.major}.{props.minor}")
    else:
        lines.append("cuda: none (" + ("torch is a CPU build" if torch.version.cuda is None
                                       else "no CUDA device visible") + ")")
    if importlib.util.find_spec("torch_neuronx") is None:
        lines.append("trainium: none (torch-neuronx not installed)")
    else:
        present = dispatch.device_present("neuron")
        lines.append("trainium: torch-neuronx installed, " + ("neuron device present" if present
                                                             else "no neuron device visible"))
    return lines


def _serves(backend: dispatch.Backend) -> str:
    """The device types it is the default for, each said present or not."""
    if dispatch.EVERY_DEVICE_TYPE in backend.devices:
        return "default for every device type no other backend serves"
    kinds = [f"{kind}{'' if dispatch.device_present(kind) else ' (none here)'}" for kind in backend.devices]
    return "default for " + (", ".join(kinds) or "no device type (runs when forced)")


def _on_cpu(backend: dispatch.Backend) -> str:
    reasons = backend.device_reasons(torch.device("cpu"))
    if reasons:
        return "not on CPU tensors: " + "; ".join(reasons)
    if backend.cpu_runner is not None and "cpu" not in backend.devices:
        return f"runs CPU tensors in {backend.cpu_runner} when forced"
    return "runs on CPU tensors"


def _ops(backend: dispatch.Backend) -> str:
    """The public ops it has kernels for (each of their dispatch ops), and those it declines."""
    by_public: dict[str, list[str]] = {}
    for op, spec in OPS.items():
        by_public.setdefault(spec.public, []).append(op)
    has = [name for name, ops in by_public.items() if all(op in backend.ops for op in ops)]
    declined = [name for name, ops in by_public.items() if any(op in backend.declined for op in ops)]
    return "ops: " + (", ".join(has) or "none") + (f"; not yet: {', '.join(declined)}" if declined else "")


def report() -> str:
    lines = ["hardware:"] + [f"  {line}" for line in _hardware()] + ["backends:"]
    for name in dispatch.BACKEND_NAMES:
        reason = dispatch.unavailable_reason(name)
        if reason is not None:
            lines.append(f"  {name:<10} unavailable: {reason}")
            continue
        backend = dispatch.get_backend(name)
        lines.append(f"  {name:<10} available ({backend.description}); {_serves(backend)}; {_on_cpu(backend)}")
        lines.append(f"  {'':<10} {_ops(backend)}")
    return "\n".join(lines)
