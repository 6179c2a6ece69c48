"""A transformers model's own modules run on portable_ops: ``patch(model)``.

``register()`` covers attention, which transformers looks up by name. The norms are modules of each model's own
class (``LlamaRMSNorm``, ``Gemma2RMSNorm``, ...), so :func:`patch` changes the instances inside one model: each
norm whose forward it recognises gets a subclass of its own class whose forward runs :func:`portable_ops.rms_norm`
or :func:`portable_ops.layer_norm`. Parameters, buffers, hooks and the state_dict stay as they were; other models
in the process are untouched. RoPE is a function of each model's modeling file (``apply_rotary_pos_emb``), looked
up by name when attention runs: where it computes transformers' rotate-half formula, the file's function is
replaced by one running :func:`portable_ops.rope` (the same function, for every model of that file in the
process). ``docs/integrations.md`` says what is recognised and how.
"""

from __future__ import annotations

import copy
import inspect
import sys

import torch
import torch.nn.functional as F

import portable_ops
import portable_ops.nn

# Each formula an RMSNorm class of transformers computes, as (name, float32 output of x given weight and eps):
# Llama's family scales by the weight, Gemma's by 1 + weight (its weights start at zero).
_RMS_FORMULAS = {
    "weight": lambda x, w, eps: F.rms_norm(x, (x.shape[-1],), w, eps),
    "1 + weight": lambda x, w, eps: F.rms_norm(x, (x.shape[-1],), 1 + w, eps),
}
# Where transformers' RMSNorm classes keep their epsilon
_EPS_ATTRIBUTES = ("variance_epsilon", "eps")


def _eps(module):
    for name in _EPS_ATTRIBUTES:
        value = getattr(module, name, None)
        if isinstance(value, float):
            return value
    return None


def _rms_weight_forward(self, hidden_states):
    out = portable_ops.rms_norm(hidden_states, self.weight, _eps(self))
    return out.to(torch.promote_types(hidden_states.dtype, self.weight.dtype))  # Llama's weight * x in x's dtype


def _rms_offset_weight_forward(self, hidden_states):
    return portable_ops.rms_norm(hidden_states, 1 + self.weight.float(), _eps(self)).type_as(hidden_states)


_RMS_FORWARDS = {"weight": _rms_weight_forward, "1 + weight": _rms_offset_weight_forward}


def _rms_formula(module):
    """The formula of :data:`_RMS_FORMULAS` that ``module``'s own forward computes, or why none is taken: its
    forward is run once on a few float32 rows of its weight's device and compared with each."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.nn.Parameter) or weight.dim() != 1:
        return None, "no 1-D weight parameter"
    if weight.device.type == "meta":
        return None, "its weight is on the meta device (patch after the weights are loaded)"
    if not _takes_x_alone(type(module).forward):
        return None, "its forward takes other arguments than the hidden states"
    eps = _eps(module)
    if eps is None:
        return None, f"no float epsilon in {' or '.join(_EPS_ATTRIBUTES)}"
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(4, weight.shape[0], generator=generator).to(weight.device)
    with torch.no_grad(), torch.autocast(weight.device.type, enabled=False):
        probe = _with_random_parameters(module, generator)
        theirs = type(module).forward(probe, x).float()
        for name, formula in _RMS_FORMULAS.items():
            if torch.allclose(theirs, formula(x, probe.weight.float(), eps), rtol=1e-3, atol=1e-5):
                return name, None
    return None, ("its forward computes neither x * rsqrt(mean(x^2) + eps) * weight nor * (1 + weight) (with "
                  "random values in its parameters)")


def _takes_x_alone(forward) -> bool:
    """Whether ``forward(self, x)`` is its whole signature: the patched forward takes x alone, so a call passing
    more (a residual, a gate) would fail or, with a default, differ."""
    parameters = list(inspect.signature(forward).parameters.values())[1:]
    return len(parameters) == 1 and parameters[0].kind in (inspect.Parameter.POSITIONAL_ONLY,
                                                           inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _with_random_parameters(module, generator):
    """A shallow copy of ``module`` whose own parameters hold random values: the probe then tells the formulas
    apart whatever the loaded values (a weight of ones, a bias of zeros that the formula would ignore)."""
    probe = copy.copy(module)
    probe._parameters = {name: None if p is None else torch.nn.Parameter(
        torch.randn(p.shape, generator=generator).to(p.device, p.dtype), requires_grad=False)
        for name, p in module._parameters.items()}
    return probe


_subclasses: dict[tuple[type, object], type] = {}


def _swap_forward(module, forward):
    """Give ``module`` a subclass of its class with ``forward`` (one subclass per class and forward)."""
    cls = type(module)
    key = (cls, forward)
    if key not in _subclasses:
        _subclasses[key] = type(cls.__name__, (cls,), {"forward": forward, "__module__": cls.__module__,
                                                        "__qualname__": cls.__qualname__})
    module.__class__ = _subclasses[key]


# torch's own norm modules -> portable_ops' drop-ins (subclasses with the same attributes)
_TORCH_NORMS = {torch.nn.RMSNorm: portable_ops.nn.RMSNorm, torch.nn.LayerNorm: portable_ops.nn.LayerNorm}


def _patched(module) -> bool:
    return type(module) in _subclasses.values() or type(module) in _TORCH_NORMS.values()


def _kind(module) -> str:
    return "layer_norm" if isinstance(module, torch.nn.LayerNorm) else "rms_norm"


def _transformers_rope(q, k, cos, sin):
    """transformers' ``apply_rotary_pos_emb`` (rotate-half, ``unsqueeze_dim=1``), written out."""
    def rotate_half(x):
        return torch.cat([-x[..., x.shape[-1] // 2:], x[..., :x.shape[-1] // 2]], dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def _portable_ops_rope(original):
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if unsqueeze_dim != 1 or q.dim() != 4 or cos.dim() not in (2, 3):  # a layout portable_ops.rope doesn't take
            return original(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
        return portable_ops.rope(q, k, cos, sin)
    apply_rotary_pos_emb.portable_ops_original = original
    return apply_rotary_pos_emb


def _rope_formula_matches(function) -> bool:
    """Whether ``function(q, k, cos, sin)`` computes transformers' rotate-half formula (run once on random float32
    inputs of the layout it is called with)."""
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 3, 5, 8, generator=g), torch.randn(2, 1, 5, 8, generator=g)
    cos, sin = torch.randn(2, 5, 8, generator=g), torch.randn(2, 5, 8, generator=g)
    try:
        with torch.no_grad():
            theirs = function(q, k, cos, sin)
    except Exception:  # another signature or layout: not the formula this replaces
        return False
    return all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(theirs, _transformers_rope(q, k, cos, sin)))


def _patch_rope(model, done) -> None:
    """Replace ``apply_rotary_pos_emb`` in the modeling files of ``model``'s modules where it is the formula."""
    files = dict.fromkeys(type(m).__module__ for m in model.modules())
    for name in files:
        module = sys.modules.get(name)
        function = getattr(module, "apply_rotary_pos_emb", None)
        if not callable(function):
            continue
        if getattr(function, "portable_ops_original", None) is not None:
            done["rope"].append(name)
        elif _rope_formula_matches(function):
            module.apply_rotary_pos_emb = _portable_ops_rope(function)
            done["rope"].append(name)
        else:
            done["left"][f"{name}.apply_rotary_pos_emb"] = "it computes another rotation than the rotate-half formula"


def patch(model: torch.nn.Module, *, norms: bool = True, rope: bool = True) -> dict:
    """Run ``model``'s norms and RoPE on portable_ops, in place, and return what was done: ``{"rms_norm": [module
    names], "layer_norm": [...], "rope": [modeling files], "left": {name: why}}``.

    Norms taken: ``torch.nn.RMSNorm`` and ``torch.nn.LayerNorm`` over the last dim (they become
    :mod:`portable_ops.nn`'s), and modules whose class name ends in ``RMSNorm`` whose forward computes
    transformers' RMSNorm (scaled by ``weight`` or by ``1 + weight``, checked by running it once). RoPE: each
    modeling file's ``apply_rotary_pos_emb`` that computes transformers' rotate-half formula (checked by running it
    once) is replaced, for every model of that file in the process (it computes the same function). Everything else
    is left as it is, with the reason. Patching twice changes nothing more. Call it after the weights are loaded and
    before ``torch.compile``."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    for argument, value in (("norms", norms), ("rope", rope)):
        if not isinstance(value, bool):
            raise TypeError(f"{argument} must be a bool, got {type(value).__name__}")
    done = {"rms_norm": [], "layer_norm": [], "rope": [], "left": {}}
    if rope:
        _patch_rope(model, done)
    if not norms:
        return done
    for name, module in model.named_modules():
        if _patched(module):
            done[_kind(module)].append(name)
        elif type(module) in _TORCH_NORMS:
            if len(module.normalized_shape) != 1:
                done["left"][name] = f"normalized_shape {tuple(module.normalized_shape)} spans more than the last dim"
                continue
            module.__class__ = _TORCH_NORMS[type(module)]
            done[_kind(module)].append(name)
        elif isinstance(module, tuple(_TORCH_NORMS)):
            done["left"][name] = f"{type(module).__qualname__} subclasses torch's norm with its own forward"
        elif type(module).__name__.endswith("RMSNorm"):
            formula, why = _rms_formula(module)
            if formula is None:
                done["left"][name] = why
                continue
            _swap_forward(module, _RMS_FORWARDS[formula])
            done["rms_norm"].append(name)
    return done
