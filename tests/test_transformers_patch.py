"""portable_ops.integrations.transformers.patch: a model's norms run on portable_ops, its results unchanged.

Tiny random-init models (tests/test_transformers_integration.py's configs), float32 on CPU, each against an
unpatched copy of itself: the logits and every gradient within the norm tolerances, every norm taken.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

import portable_ops  # noqa: E402
from portable_ops.conformance import usable_backends  # noqa: E402
from portable_ops.conformance.tolerances import GRADIENT_FACTOR, tolerance  # noqa: E402
from portable_ops.integrations.transformers import patch  # noqa: E402

from test_transformers_integration import BASE, FAMILIES, compiled_counts, models, run, tokens  # noqa: E402

# a whole model's logits and gradients: the end-to-end tolerance the integration tests use
TOL = tolerance("attention", torch.float32)
GRAD_TOL = TOL.scaled(GRADIENT_FACTOR)


@pytest.fixture
def norm_calls(monkeypatch):
    seen = []
    original = portable_ops.rms_norm
    monkeypatch.setattr(portable_ops, "rms_norm", lambda *a, **k: seen.append(a[0].shape[-1]) or original(*a, **k))
    return seen


# gemma2: weights scaled as 1 + weight; qwen3: q and k normed per head too
@pytest.mark.parametrize("family, backend", [("llama", b) for b in usable_backends()]
                         + [("gemma2", "reference"), ("qwen3", "reference")])
def test_a_patched_model_matches_itself_unpatched(family, backend, norm_calls):
    model, _ = models(family)
    for p in model.parameters():  # weights away from their init, which hides a missing (1 + w) or w
        p.data.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(3)) * 0.1)
    original = copy.deepcopy(model)
    done = patch(model)
    norms = [n for n, m in original.named_modules() if type(m).__name__.endswith("RMSNorm")]
    assert sorted(done["rms_norm"]) == sorted(norms) and not done["left"] and not done["layer_norm"]
    assert model.state_dict().keys() == original.state_dict().keys()
    ids = tokens(2, 7)
    theirs, their_grads = run(original, None, input_ids=ids)
    norm_calls.clear()
    mine, my_grads = run(model, backend, input_ids=ids)
    assert len(norm_calls) == len(norms)  # every norm ran on portable_ops, once
    torch.testing.assert_close(mine, theirs, atol=TOL.atol, rtol=TOL.rtol)
    for name, grad in their_grads.items():
        torch.testing.assert_close(my_grads[name], grad, atol=GRAD_TOL.atol, rtol=GRAD_TOL.rtol, msg=name)


def test_patching_twice_changes_nothing_more_and_leaves_other_models_alone():
    model, other = models("llama")
    first = patch(model)
    classes = {n: type(m) for n, m in model.named_modules()}
    assert patch(model) == first
    assert {n: type(m) for n, m in model.named_modules()} == classes
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    assert {type(m) for m in other.modules() if isinstance(m, LlamaRMSNorm)} == {LlamaRMSNorm}
    assert patch(other, norms=False) == {"rms_norm": [], "layer_norm": [], "left": {}}


def test_torchs_norms_become_portable_ops_modules_and_others_are_left_with_the_reason():
    class ScaledRMSNorm(torch.nn.Module):  # an RMSNorm by name that computes something else
        def __init__(self):
            super().__init__()
            self.weight, self.variance_epsilon = torch.nn.Parameter(torch.ones(8)), 1e-6

        def forward(self, x):
            return 2 * x

    class LayerNorm32(torch.nn.LayerNorm):
        def forward(self, x):
            return super().forward(x.float()).type_as(x)

    model = torch.nn.ModuleDict(dict(rms=torch.nn.RMSNorm(8), ln=torch.nn.LayerNorm(8), wide=torch.nn.LayerNorm((2, 8)),
                                     odd=ScaledRMSNorm(), sub=LayerNorm32(8)))
    done = patch(model)
    assert done["rms_norm"] == ["rms"] and done["layer_norm"] == ["ln"]
    assert type(model.rms) is portable_ops.nn.RMSNorm and type(model.ln) is portable_ops.nn.LayerNorm
    assert set(done["left"]) == {"wide", "odd", "sub"}
    assert "neither" in done["left"]["odd"] and "spans more" in done["left"]["wide"]
    x = torch.randn(3, 8)
    torch.testing.assert_close(model.ln(x), torch.nn.functional.layer_norm(x, (8,)))


def test_weights_on_the_meta_device_are_left_and_bad_arguments_refused():
    model_class, config_class, _ = FAMILIES["llama"]
    with torch.device("meta"):
        model = model_class(config_class(**BASE))
    assert all("meta" in why for why in patch(model)["left"].values())
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        patch("model")
    with pytest.raises(TypeError, match="norms must be a bool"):
        patch(torch.nn.Linear(2, 2), norms="yes")


def test_a_patched_model_compiles_with_no_more_graphs_than_before():
    model, _ = models("llama")
    ids = tokens(2, 12)
    before, logits = compiled_counts(model, input_ids=ids, labels=ids)
    patch(model)
    after, patched_logits = compiled_counts(model, input_ids=ids, labels=ids)
    assert after == before and after[1] == 0
    torch.testing.assert_close(patched_logits, logits, atol=TOL.atol, rtol=TOL.rtol)
