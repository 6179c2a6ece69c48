"""The shared conformance suite, parametrised over every backend: one test body for all of them.

A backend unusable on this machine is skipped with its reason; a case the backend
declines is reported as a fallback (skipped with the reason, and a non-zero exit
from the CLI), never as a pass. A long case on the CPU is skipped as not run unless
PORTABLE_OPS_CONFORMANCE_LONG=1 (tests/test_conformance_long.py checks its machinery at smaller sizes).
"""

import pytest
import torch

from portable_ops import dispatch
from portable_ops.conformance import CASES, run_case, usable_backends
from portable_ops.conformance.runner import placement, unusable_reason

USABLE = usable_backends()


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("backend", dispatch.BACKEND_NAMES)
def test_case(backend, case):
    if backend not in USABLE:
        pytest.skip(f"{backend} is not usable here: {unusable_reason(backend)}")
    row = run_case(case, backend)
    if row.status == "fallback":
        pytest.skip(f"FALLBACK (not a pass): {row.detail}")
    if row.status == "not run":
        pytest.skip(f"NOT RUN (not a pass): {row.detail}")
    assert row.status == "pass", row.detail


def test_a_backends_cases_run_on_the_first_device_type_it_declares_that_is_present(monkeypatch, fake_backend):
    """Where a backend's device is present its cases run there, not on CPU tensors; elsewhere on the CPU. (nki's
    "neuron": tests/test_nki_torch_ops.py, in a process of its own, as naming PrivateUse1 "neuron" can't be undone.)"""
    fake_backend("nki", devices=("cpu", "mps"))
    monkeypatch.setattr(dispatch, "device_present", lambda kind: kind == "mps")
    assert placement("nki").device == torch.device("mps")
    assert placement("reference").device == torch.device("cpu")
    monkeypatch.setattr(dispatch, "device_present", lambda kind: False)
    assert placement("nki").device == torch.device("cpu")

