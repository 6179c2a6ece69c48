"""Hugging Face transformers in one call: ``attn_implementation=register()``.

    from portable_ops.integrations.transformers import register
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation=register())

:func:`register` adds an attention function to transformers' ``AttentionInterface`` and a mask function to its
``AttentionMaskInterface``, under one name. Like transformers' own for "flash_attention_2", the mask function
builds no 4-D mask: it hands every layer None for an unpadded batch, the 2-D padding mask for a padded one, and
for sequences transformers found packed (restarting position ids, no cache, no padding mask) its sequence index
per token. The attention function then runs :func:`portable_ops.attention` (no padding: causal, sliding window,
softcap, sinks, GQA, a value head dim of its own, decode from a KV cache) or unpads and runs
:func:`portable_ops.attention_varlen` (padding, packed sequences, ``cu_seq_lens_q/k``). What it can't map
exactly is refused with an error naming the argument. ``docs/integrations.md`` has the mapping, the refusals
and what was verified where.
"""

from __future__ import annotations

import re
import types
import weakref

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

import portable_ops

from .transformers_patch import patch  # noqa: F401  (the norms; attention goes through register())

SUPPORTED = "transformers >= 5.0"
CHECKED_WITH = "5.17.0"

# transformers' own implementations: registering over one would change it for every model in the process.
_RESERVED = ("eager", "sdpa", "flex_attention")

# Keyword arguments some models pass that change the attention's result and have no portable_ops meaning yet.
_UNMAPPED = {
    "position_bias": "an additive position bias (T5-style relative positions)",
    "block_indices": "block-sparse attention indices",
}


def _transformers():
    """transformers, checked to be a release this integration supports."""
    try:
        import transformers
    except ModuleNotFoundError as error:
        if error.name != "transformers":  # installed, but something it imports is not: that error says what
            raise
        raise ImportError(f"portable_ops.integrations.transformers needs {SUPPORTED} (checked with {CHECKED_WITH}), "
                          "which is not installed: pip install 'transformers>=5.0'") from error
    major = re.match(r"\d+", transformers.__version__)
    if major is None or int(major.group()) < 5:
        raise ImportError(f"transformers {transformers.__version__} is installed, but "
                          f"portable_ops.integrations.transformers supports {SUPPORTED} (checked with {CHECKED_WITH}): "
                          "the attention and mask interfaces it plugs into took their present form in 5.0")
    return transformers


def register(name: str = "portable_ops") -> str:
    """Register portable_ops' attention and mask functions with transformers under ``name`` and return the name,
    to pass as ``attn_implementation`` (``from_pretrained(..., attn_implementation=register())``, or
    ``model.set_attn_implementation(register())``). Calling it again is harmless."""
    global _masking_utils
    _transformers()
    from transformers import AttentionInterface, AttentionMaskInterface, masking_utils

    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}")
    if name in _RESERVED or "flash" in name or name.startswith("paged|"):
        raise ValueError(f"name {name!r} is taken by transformers or read by it as one of its own implementations "
                         "(it treats any name containing 'flash' as FlashAttention, 'paged|' as a paged cache); "
                         "choose another, such as 'portable_ops'")
    for interface, ours in ((AttentionInterface, attention_forward), (AttentionMaskInterface, build_mask)):
        registered = interface._global_mapping.get(name)
        if registered is not None and not _same_function(registered, ours):
            raise ValueError(f"name {name!r} is already registered with transformers' {interface.__name__} "
                             f"to {registered.__module__}.{registered.__qualname__}; choose another")
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, build_mask)
    _masking_utils = masking_utils
    return name


def _same_function(registered, ours) -> bool:
    """``registered`` is ``ours``, or ours from an earlier load of this module (``importlib.reload``, a notebook's
    autoreload), which register() replaces rather than refusing its name as another's."""
    return registered is ours or (getattr(registered, "__module__", None) == ours.__module__
                                  and getattr(registered, "__qualname__", None) == ours.__qualname__)


# transformers.masking_utils, once register() has run: imported inside a compiled call, it broke the graph on CUDA
_masking_utils = None


# ----------------------------------------------------------------------------- values read once per tensor

# tensor -> {what: (versions, weakrefs to the other tensors, value)}. transformers passes one mask and one
# position_ids tensor to every layer of a forward: what is read from them is read once, not once per layer.
_derived = WeakIdKeyDictionary()


def _once(what, compute, *tensors):
    """``compute(*tensors)``, remembered while these very tensors are unmodified (their version counters);
    inference tensors have none and are read every call. ``compute`` must not return views of ``tensors[0]``.
    Under ``torch.compile`` nothing is remembered: the graph computes it (the cache can't be traced)."""
    if torch.compiler.is_compiling():
        return compute(*tensors)
    tracked = not any(t.is_inference() for t in tensors)
    if tracked:
        versions = tuple(t._version for t in tensors)
        entry = _derived.get(tensors[0], {}).get(what)
        if entry is not None and entry[0] == versions and all(r() is t for r, t in zip(entry[1], tensors[1:])):
            return entry[2]
    value = compute(*tensors)
    if tracked:
        _derived.setdefault(tensors[0], {})[what] = (versions, tuple(weakref.ref(t) for t in tensors[1:]), value)
    return value


def _offsets(lengths):
    return F.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))


def _unpadding(mask):
    """A bool padding mask ``[B, L]`` as ``attention_varlen`` takes it: (flat indices of the valid tokens,
    cu_seqlens, the longest sequence, whether every token is valid, whether each row's valid tokens are
    contiguous)."""
    lengths = mask.sum(1, dtype=torch.int32)
    columns = torch.arange(mask.shape[1], device=mask.device)
    first = torch.where(mask, columns, mask.shape[1]).amin(1)
    last = torch.where(mask, columns, -1).amax(1)
    contiguous = bool(((last - first + 1 == lengths) | (lengths == 0)).all())
    return (mask.flatten().nonzero().flatten(), _offsets(lengths), int(lengths.max()), bool(mask.all()),
            contiguous)


def _packing(sequence_ids):
    """transformers' packed-sequence index per token ``[B, S]`` (one row's sequences numbered from 0) as
    (cu_seqlens over the ``B * S`` tokens, the longest sequence)."""
    starts = torch.ones_like(sequence_ids, dtype=torch.bool)
    starts[:, 1:] = sequence_ids[:, 1:] != sequence_ids[:, :-1]
    cu = torch.cat([starts.flatten().nonzero().flatten(), starts.new_tensor([starts.numel()], dtype=torch.long)])
    cu = cu.to(torch.int32)
    return cu, int(cu.diff().max())


_RESTARTS = ("portable_ops attention: position_ids restart inside a row (packed sequences) where portable_ops runs "
             "one sequence per row: with a cache (use_cache defaults to True) or an attention_mask transformers builds "
             "no packed-sequence mask (eager would attend across the sequences, FlashAttention would not), and under "
             "torch.compile the integration can't unpack inside the graph. Pass cu_seq_lens_q/k and max_length_q/k, "
             "or run eagerly with use_cache=False and no attention_mask")

_CU_DISAGREE = ("portable_ops attention: cu_seq_lens_q/k mark other sequences than the restarts of position_ids, "
                "from which transformers built its packed-sequence mask")


# Devices whose tensors are checked by an asynchronous assert instead of a host read (which would wait for them)
_ASYNC_CHECKED = ("cuda",)


# The longest message a device-side assert takes (CUDA refuses longer ones); the full text is in integrations.md
ASSERT_MESSAGE_LIMIT = 254


def _refuse_unless(ok, message):
    """Raise ``ValueError(message)`` unless the one-element bool tensor ``ok`` is true, without waiting for the
    device: checked inside the graph under compile and on the GPU stream on CUDA (a device-side assert there,
    with the message cut to what it takes)."""
    if torch.compiler.is_compiling() or ok.device.type in _ASYNC_CHECKED:
        torch._assert_async(ok, message[:ASSERT_MESSAGE_LIMIT])
    elif not ok:  # the CPU (no wait) and devices without an asynchronous assert
        raise ValueError(message)


def _no_restarts(position_ids):
    """Refuse position ids that restart inside a row (transformers' rule for packed sequences: a step other than
    +1)."""
    _refuse_unless((position_ids.diff(dim=-1) == 1).all(), _RESTARTS)


def _int32(cu):
    return cu if cu.dtype == torch.int32 else _once("int32", lambda t: t.to(torch.int32), cu)


# ----------------------------------------------------------------------------- the mask function

def _captured(function, name):
    """The value a nested function captured as ``name``; read only where needed (Dynamo can't read every closure)."""
    return function.__closure__[function.__code__.co_freevars.index(name)].cell_contents


def _mask_pieces(mask_function, pieces):
    """Add what a transformers mask function is made of (through ``and_masks``) to ``pieces``: "causal", and
    "packed" with transformers' sequence index per token; a sliding window passes (the attention function gets
    it as ``sliding_window``). Anything else is refused: dropping it would attend where eager does not."""
    masking_utils = _masking_utils
    if masking_utils is None:
        raise RuntimeError("portable_ops attention: its mask function (build_mask) ran before register(); call "
                           "portable_ops.integrations.transformers.register() first and pass the name it returns as "
                           "attn_implementation")
    if mask_function is masking_utils.causal_mask_function:
        pieces["causal"] = True
        return pieces
    # Not getattr with a default nor hasattr: under Dynamo both miss a nested function's __qualname__
    kind = mask_function.__qualname__ if isinstance(mask_function, types.FunctionType) else None
    if kind == "and_masks.<locals>.and_mask" and torch.compiler.is_compiling():
        # Dynamo can't read a closure: the parts are taken to be transformers' window and packing (docs say so)
        pieces["causal"] = True
    elif kind == "and_masks.<locals>.and_mask":
        for part in _captured(mask_function, "mask_functions"):
            _mask_pieces(part, pieces)
    elif kind == "sliding_window_overlay.<locals>.inner_mask":
        pass  # the attention function gets the window as sliding_window
    elif kind == "packed_sequence_mask_function.<locals>.inner_mask":
        pieces["packed"] = _captured(mask_function, "packed_sequence_mask")
    elif _from_another_import(mask_function, masking_utils):
        raise RuntimeError("portable_ops attention: mask_function comes from a transformers.masking_utils other than "
                           "the one register() imported (transformers was reloaded or imported again since); call "
                           "portable_ops.integrations.transformers.register() again")
    else:
        what = ("bidirectional (non-causal) attention" if mask_function is masking_utils.bidirectional_mask_function
                else f"{kind or repr(mask_function)} (an extra mask function: chunked attention, bidirectional blocks "
                   "or an or/and overlay)")
        raise NotImplementedError(
            f"portable_ops attention: transformers asked for a mask with {what} in mask_function; portable_ops maps "
            "causal masks with sliding windows, padding and packed sequences. Use attn_implementation='eager' or "
            "'sdpa' for this model")
    return pieces


def _from_another_import(mask_function, masking_utils) -> bool:
    """Whether ``mask_function`` is one of transformers.masking_utils' own module-level functions, but not the one
    ``masking_utils`` (the module register() imported) holds under its name: transformers was reloaded since."""
    if not isinstance(mask_function, types.FunctionType) or mask_function.__module__ != masking_utils.__name__:
        return False
    name = mask_function.__qualname__  # a nested function's (and_masks.<locals>...) names no module attribute
    return isinstance(getattr(masking_utils, name, None), types.FunctionType) and getattr(masking_utils,
                                                                                          name) is not mask_function


# The sequence index tensors build_mask handed out: a 2-D integer mask is read as packed sequences only if it is one.
_sequence_ids = WeakIdKeyDictionary()


def build_mask(batch_size, kv_length, kv_offset=0, mask_function=None, attention_mask=None, q_length=None,
               q_offset=None, cache_position=None, **kwargs):
    """What transformers hands each layer's attention as ``attention_mask``: None (no padding), the 2-D bool
    padding mask ``[B, kv_length]`` (or shorter: a static cache's filled part), or for packed sequences
    transformers' sequence index per token ``[B, S]`` (int64). transformers 5.0 passes ``cache_position``,
    later releases ``q_length`` and ``q_offset``."""
    pieces = _mask_pieces(mask_function, {})
    if "causal" not in pieces:
        raise NotImplementedError("portable_ops attention: transformers asked for a mask without causal_mask_function "
                                  "in mask_function (bidirectional attention); only causal attention is mapped")
    if torch.compiler.is_compiling() and getattr(kwargs.get("config"), "attention_chunk_size", None):
        raise NotImplementedError("portable_ops attention: under torch.compile the mask of a model with "
                                  "config.attention_chunk_size (chunked attention) can't be checked; it is not mapped")
    if "packed" in pieces:
        _sequence_ids[pieces["packed"]] = None
        return pieces["packed"]
    if attention_mask is not None:
        attention_mask = attention_mask[:, -kv_length:]
        # All valid over every key: nothing to unpad (a static cache's shorter mask still cuts its unfilled tail)
        return None if attention_mask.shape[1] == kv_length and attention_mask.all() else attention_mask
    if q_length is None:
        q_length, q_offset = cache_position.shape[0], cache_position[0]
    filled = int(q_offset) + q_length - kv_offset
    if filled < kv_length:  # a static cache, not yet full: its tail holds no tokens
        return torch.ones(batch_size, filled, dtype=torch.bool, device=kwargs.get("device"))
    return None


# ----------------------------------------------------------------------------- the attention function

def _refuse(module, argument, why):
    where = type(module).__name__ + (f" (layer {module.layer_idx})" if hasattr(module, "layer_idx") else "")
    raise NotImplementedError(f"portable_ops attention can't take {argument} in {where}: {why}")


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None,
                      softcap=None, is_causal=None, s_aux=None, position_ids=None, cu_seq_lens_q=None,
                      cu_seq_lens_k=None, max_length_q=None, max_length_k=None, output_attentions=False, **kwargs):
    """transformers' attention interface: query ``[B, Hq, Sq, D]``, key and value ``[B, Hkv, Skv, D]`` (the
    cache's keys included), ``attention_mask`` from :func:`build_mask`; returns ``([B, Sq, Hq, D], None)``."""
    if output_attentions:
        _refuse(module, "output_attentions=True", "portable_ops never forms the attention weights; "
                "use attn_implementation='eager' to see them")
    for argument, what in _UNMAPPED.items():
        if kwargs.get(argument) is not None:
            _refuse(module, argument, f"{what} has no portable_ops mapping")
    if dropout and module.training:
        _refuse(module, f"dropout={dropout} while training", "portable_ops attention has no dropout; "
                "set the config's attention_dropout to 0")
    if not (is_causal if is_causal is not None else getattr(module, "is_causal", True)):
        _refuse(module, "is_causal=False", "only causal attention is mapped (transformers' masks for it "
                "can't be told from the arguments)")
    window = None if sliding_window is None else (sliding_window - 1, 0)  # transformers' window counts the query
    options = dict(causal=True, scale=scaling, window=window, softcap=softcap, sinks=s_aux)  # s_aux: gpt-oss's sinks

    varlen = (cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k)
    if any(x is not None for x in varlen) and not all(x is not None for x in varlen):
        missing = [n for n, x in zip(("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"), varlen)
                   if x is None]
        raise ValueError(f"portable_ops attention: packed sequences need cu_seq_lens_q, cu_seq_lens_k, max_length_q "
                         f"and max_length_k together; {', '.join(missing)} missing")
    if attention_mask is None:
        if cu_seq_lens_q is not None:
            return _packed(query, key, value, _int32(cu_seq_lens_q), _int32(cu_seq_lens_k), int(max_length_q),
                           int(max_length_k), options), None
        if isinstance(position_ids, torch.Tensor) and position_ids.dim() == 2 and query.shape[2] > 1:
            _once("restarts", _no_restarts, position_ids)
        return _dense(query, key, value, options), None
    if attention_mask.dim() != 2:
        raise NotImplementedError(
            f"portable_ops attention: attention_mask of shape {tuple(attention_mask.shape)} (a mask given to the "
            "model ready-made): only 2-D padding masks are mapped")
    if attention_mask in _sequence_ids:
        cu, longest = _once("packing", _packing, attention_mask)
        if cu_seq_lens_q is not None:  # a flattening collator gives both: they must tell the same sequences
            cu_q, cu_k = _int32(cu_seq_lens_q), _int32(cu_seq_lens_k)
            if not _once("agrees", lambda _, a, b: bool(torch.equal(cu, a) and torch.equal(cu, b)),
                         attention_mask, cu_q, cu_k):
                raise ValueError(_CU_DISAGREE)
        return _packed(query, key, value, cu, cu, longest, longest, options), None
    if attention_mask.dtype != torch.bool:
        raise ValueError(f"portable_ops attention: attention_mask is a 2-D {attention_mask.dtype} mask that "
                         "transformers' mask interface did not prepare (this model hands the mask to attention as "
                         "given); pass a bool padding mask")
    if cu_seq_lens_q is not None:
        raise ValueError("portable_ops attention: cu_seq_lens_q/k given with a padding attention_mask; pass one")
    return _padded(module, query, key, value, attention_mask, options), None


def _dense(query, key, value, options):
    return portable_ops.attention(query, key, value, **options).transpose(1, 2)


def _tokens(x):
    """``[B, H, S, D]`` as ``[B * S, H, D]``."""
    return x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3])


def _packed(query, key, value, cu_q, cu_k, max_q, max_k, options):
    out = portable_ops.attention_varlen(_tokens(query), _tokens(key), _tokens(value), cu_q, cu_k, max_q, max_k,
                                        **options)
    return out.view(query.shape[0], query.shape[2], *out.shape[1:])


def _padded(module, query, key, value, mask, options):
    """FlashAttention 2's path: unpad, attend per sequence, pad the output back (zeros at padded queries)."""
    batch, heads, sq, _ = query.shape
    length = mask.shape[1]
    if mask.shape[0] != batch or not sq <= length <= key.shape[2]:
        raise ValueError(f"portable_ops attention: attention_mask has shape {tuple(mask.shape)}; expected "
                         f"[{batch}, L] with {sq} queries <= L <= {key.shape[2]} keys")
    key, value = key[:, :, :length], value[:, :, :length]  # a static cache's unfilled tail, when L is shorter
    indices_k, cu_k, max_k, everything, contiguous = _once("unpadding", _unpadding, mask)
    if everything:
        return _dense(query, key, value, options)
    if options["window"] is not None and not contiguous:
        _refuse(module, "a sliding_window with an attention_mask that has padding between valid tokens",
                "unpadded, the window would count valid tokens where eager counts positions")
    if sq == length:
        indices_q, cu_q, max_q = indices_k, cu_k, max_k
    else:  # the queries are the last sq keys
        indices_q, cu_q, max_q = _once(("queries", sq), lambda m: _unpadding(m[:, -sq:])[:3], mask)
    out = portable_ops.attention_varlen(_tokens(query).index_select(0, indices_q),
                                        _tokens(key).index_select(0, indices_k),
                                        _tokens(value).index_select(0, indices_k), cu_q, cu_k, max_q, max_k, **options)
    return out.new_zeros(batch * sq, heads, out.shape[-1]).index_copy(0, indices_q, out).view(batch, sq, heads, -1)
