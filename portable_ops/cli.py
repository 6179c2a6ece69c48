"""Argument checks the command lines share (``python -m portable_ops.conformance``, ``.bench``, the
examples): an argument that would make a run fail is refused before the run starts, with a message
for ``parser.error`` (exit 2), instead of a traceback, or a failure after minutes of work."""

from __future__ import annotations

import argparse
import os
import pathlib

import torch


def device(text: str) -> torch.device:
    """The device called ``text``, once an empty tensor was made there: ValueError if torch can't parse
    the name or this machine has no such device."""
    try:
        parsed = torch.device(text)
    except RuntimeError:
        raise ValueError(f"--device {text!r} is not a device name (cpu, cuda, cuda:1, neuron, ...)") from None
    if parsed.type == "meta":
        raise ValueError(f"--device {text!r}: meta tensors hold no values to check; name a device that computes")
    try:
        torch.empty(0, device=parsed)
    except Exception as exc:  # torch raises RuntimeError, AssertionError ... by device type
        raise ValueError(f"--device {text!r}: no such device here ({type(exc).__name__}: {exc})") from None
    return parsed


def positive_int(text: str) -> int:
    """``text`` as a whole number >= 1, for argparse's ``type=``: its ArgumentTypeError otherwise."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


def writable_file(option: str, path: str) -> pathlib.Path:
    """``path``, if a file can be written there: ValueError naming ``option`` if its folder is missing or
    read-only, or ``path`` is a folder."""
    if not path:
        raise ValueError(f"{option} needs a file name, got an empty string")
    file = pathlib.Path(path)
    folder = file.parent
    if file.is_dir():
        raise ValueError(f"{option} {path!r} is a folder; give a file name")
    if not folder.is_dir():
        raise ValueError(f"{option} {path!r}: folder {str(folder)!r} does not exist")
    if not os.access(folder, os.W_OK):
        raise ValueError(f"{option} {path!r}: folder {str(folder)!r} is not writable")
    return file


def writable_folder(option: str, path: str) -> pathlib.Path:
    """``path``, if it is a writable folder or one can be made there (its nearest existing ancestor is a
    writable folder): ValueError naming ``option`` otherwise."""
    folder = pathlib.Path(path)
    existing = next(p for p in (folder, *folder.absolute().parents) if p.exists())
    if not existing.is_dir():
        raise ValueError(f"{option} {path!r}: {str(existing)!r} is a file, not a folder")
    if not os.access(existing, os.W_OK):
        raise ValueError(f"{option} {path!r}: {str(existing)!r} is not writable")
    return folder
