"""docs/adding-an-op.md's steps, checked for every row of portable_ops/ops.py's table: a half-added op fails
here, naming the step it lacks."""

import pathlib
import re

import pytest
import torch

import portable_ops
from portable_ops import dispatch
from portable_ops.conformance import CASES, tolerance
from portable_ops.conformance.runner import RUNNERS
from portable_ops.ops import OPS, declined_reason, families, public_ops

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs"


@pytest.mark.parametrize("op", OPS)
def test_the_row_is_whole(op):
    spec = OPS[op]
    assert spec.public in public_ops() and spec.family in families()
    if spec.backward is not None:
        assert OPS[spec.backward].public == spec.public, "a backward is its forward's public op's"


@pytest.mark.parametrize("op", OPS)
def test_step_2_the_reference_defines_it(op):
    assert op in dispatch.get_backend("reference").ops


@pytest.mark.parametrize("name", public_ops())
def test_step_4_the_public_function_is_exported(name):
    """In the package's ``__all__``, or in a module of it there (``functional.adam``)."""
    exported = name in portable_ops.__all__ or any(callable(getattr(getattr(portable_ops, module), name, None))
                                                   for module in portable_ops.__all__)
    assert exported, f"portable_ops exports no {name}"


@pytest.mark.parametrize("name", public_ops())
def test_step_5_explain_takes_it_by_name(name):
    with pytest.raises(TypeError, match=rf"explain\({name}, \.\.\.\): missing"):
        portable_ops.explain(name)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("backend", dispatch.BACKEND_NAMES)
def test_step_6_every_backend_implements_it_or_declines_it(backend, op):
    loaded = dispatch.get_backend(backend)
    if loaded is None or dispatch.unavailable_reason(backend):
        pytest.skip(f"{backend} is not available here: {dispatch.unavailable_reason(backend)}")
    assert (op in loaded.ops) != (op in loaded.declined)


@pytest.mark.parametrize("family", families())
def test_step_7_its_family_has_cases_a_runner_and_tolerances(family):
    dtypes = {case.dtype for case in CASES if case.op == family}
    assert dtypes, f"no case of {family} in conformance/cases.py"
    assert family in RUNNERS
    for dtype in dtypes:
        assert tolerance(family, dtype).rtol > 0


@pytest.mark.parametrize("op", OPS)
def test_step_9_the_backend_guide_gives_its_call(op):
    assert f"| `{op}` |" in (DOCS / "adding-a-backend.md").read_text()


@pytest.mark.parametrize("name", public_ops())
def test_step_9_the_api_doc_names_it(name):
    assert re.search(rf"`(\w+\.)?{name}\b", (DOCS / "api.md").read_text())


def test_a_declined_op_reads_as_a_user_would_say_it():
    reason = declined_reason("paged_attention", "nki")
    assert reason == "attention over a paged KV cache (paged_attention): not in the nki kernels yet"
    assert not re.search(r"issue \d+|#\d+", " ".join(declined_reason(op, "nki") for op in OPS))


def test_an_unknown_op_is_refused_by_tolerance_and_explain():
    with pytest.raises(ValueError, match="no tolerances for 'softmax'"):
        tolerance("softmax", torch.float32)
    with pytest.raises(ValueError, match="unknown op 'softmax'"):
        portable_ops.explain("softmax")
