"""``python -m portable_ops doctor``: hardware found, backends available, and why any is not."""

from __future__ import annotations

import importlib.util
import platform

import torch

from .dispatch import BACKEND_NAMES, NATIVE_DEVICES, get_backend, unavailable_reason


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
    neuron = [m for m in ("torch_neuronx", "torch_xla") if importlib.util.find_spec(m) is not None]
    lines.append("trainium: " + (f"{', '.join(neuron)} installed" if neuron else "none (torch-neuronx not installed)"))
    return lines


def report() -> str:
    lines = ["hardware:"] + [f"  {line}" for line in _hardware()] + ["backends:"]
    for name in BACKEND_NAMES:
        reason = unavailable_reason(name)
        if reason is not None:
            lines.append(f"  {name:<10} unavailable: {reason}")
            continue
        backend = get_backend(name)
        default_for = ", ".join(NATIVE_DEVICES.get(name, ())) or "anything else"
        cpu = backend.device_reasons(torch.device("cpu"))
        on_cpu = "runs on CPU tensors" if not cpu else "not on CPU tensors: " + "; ".join(cpu)
        lines.append(f"  {name:<10} available ({backend.description}); default for {default_for}; {on_cpu}")
    return "\n".join(lines)
