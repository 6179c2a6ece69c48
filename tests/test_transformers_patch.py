"""portable_ops.integrations.transformers.patch: a model's norms and RoPE run on portable_ops, its results
unchanged.

Tiny random-init models (tests/test_transformers_integration.py's configs), float32 on CPU, each against itself
before the patch: the logits and every gradient within the end-to-end tolerances, every norm and RoPE taken.
RoPE's patch replaces a modeling file's function for the whole process: each test puts it back (``restore_rope``).
"""

from __future__ import annotations

import copy
import sys

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


@pytest.fixture(autouse=True)
def restore_rope(monkeypatch):
    """Every modeling file's apply_rotary_pos_emb as it was, after the test."""
    for family in FAMILIES.values():
        module = sys.modules[family[0].__module__]
        monkeypatch.setattr(module, "apply_rotary_pos_emb", module.apply_rotary_pos_emb)


@pytest.fixture
def calls(monkeypatch):
    """The calls to portable_ops.rms_norm and portable_ops.rope, by name."""
    seen = []
    for name in ("rms_norm", "rope"):
        original = getattr(portable_ops, name)
        monkeypatch.setattr(portable_ops, name, lambda *a, _n=name, _f=original, **k: seen.append(_n) or _f(*a, **k))
    return seen


# gemma2: weights scaled as 1 + weight; qwen3: q and k normed per head too
@pytest.mark.parametrize("family, backend", [("llama", b) for b in usable_backends()]
                         + [("gemma2", "reference"), ("qwen3", "reference")])
def test_a_patched_model_matches_itself_unpatched(family, backend, calls):
    model, _ = models(family)
    for p in model.parameters():  # weights away from their init, which hides a missing (1 + w) or w
        p.data.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(3)) * 0.1)
    original = copy.deepcopy(model)
    ids = tokens(2, 7)
    theirs, their_grads = run(original, None, input_ids=ids)  # before the patch: RoPE's is the process's
    done = patch(model)
    norms = [n for n, m in original.named_modules() if type(m).__name__.endswith("RMSNorm")]
    assert sorted(done["rms_norm"]) == sorted(norms) and not done["left"] and not done["layer_norm"]
    assert done["rope"] == [FAMILIES[family][0].__module__]
    assert model.state_dict().keys() == original.state_dict().keys()
    calls.clear()
    mine, my_grads = run(model, backend, input_ids=ids)
    layers = model.config.num_hidden_layers
    assert sorted(calls) == sorted(["rms_norm"] * len(norms) + ["rope"] * layers)  # each on portable_ops, once
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
    assert patch(other, norms=False, rope=False) == {"rms_norm": [], "layer_norm": [], "rope": [], "left": {}}


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
    with pytest.raises(TypeError, match="rope must be a bool"):
        patch(torch.nn.Linear(2, 2), rope=1)


def test_a_modeling_files_other_rotation_is_left_with_the_reason(monkeypatch):
    model, _ = models("llama")
    module = sys.modules[type(model).__module__]
    monkeypatch.setattr(module, "apply_rotary_pos_emb", lambda q, k, cos, sin, unsqueeze_dim=1: (q, k))
    done = patch(model, norms=False)
    assert done["rope"] == [] and "another rotation" in done["left"][f"{module.__name__}.apply_rotary_pos_emb"]


def test_a_patched_model_compiles_with_no_more_graphs_than_before():
    model, _ = models("llama")
    ids = tokens(2, 12)
    before, logits = compiled_counts(model, input_ids=ids, labels=ids)
    assert patch(model)["rope"]
    after, patched_logits = compiled_counts(model, input_ids=ids, labels=ids)
    assert after == before and after[1] == 0
    torch.testing.assert_close(patched_logits, logits, atol=TOL.atol, rtol=TOL.rtol)
