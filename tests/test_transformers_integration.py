"""portable_ops as a Hugging Face transformers attention implementation (portable_ops/integrations/transformers.py).

Tiny random-init models built from configs (no downloads), float32 on CPU, each against transformers' own "eager"
attention on the same weights: logits and every parameter's gradient, under strict mode (no silent fallback), on
every backend usable here. reference takes every case; triton (the Triton interpreter) takes a few tiny ones; nki
(the emulator) takes them too, packed attention one launch per sequence. A backend that declines packed attention
(a stand-in) is refused under strict mode, naming the op. Whatever the integration can't map must be refused, naming
the argument.
"""

import contextlib
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.0",
                                   reason="transformers >= 5.0 is not installed (the test extra installs it)")

import portable_ops  # noqa: E402
from portable_ops import BackendUnavailableError  # noqa: E402
from portable_ops.conformance import usable_backends  # noqa: E402
from portable_ops.conformance.runner import forced_strict  # noqa: E402
from portable_ops.conformance.tolerances import GRADIENT_FACTOR, tolerance  # noqa: E402
from portable_ops.integrations.transformers import attention_forward, build_mask, register  # noqa: E402
from transformers import masking_utils  # noqa: E402

NAME = register()
BACKENDS = usable_backends()
TOL = tolerance("attention", torch.float32)
GRAD_TOL = TOL.scaled(GRADIENT_FACTOR)
# initializer_range 0.3: scores large enough that a dropped softcap or a wrong window changes the logits
BASE = dict(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=64, pad_token_id=0, initializer_range=0.3)
FAMILIES = {
    "llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig, {}),
    "mistral": (transformers.MistralForCausalLM, transformers.MistralConfig, dict(sliding_window=5)),
    "gemma2": (transformers.Gemma2ForCausalLM, transformers.Gemma2Config,
               dict(sliding_window=5, attn_logit_softcapping=2.0, final_logit_softcapping=None,
                    query_pre_attn_scalar=8)),
    "qwen3": (transformers.Qwen3ForCausalLM, transformers.Qwen3Config,
              dict(use_sliding_window=True, sliding_window=5, layer_types=["full_attention", "sliding_attention"])),
}


def same_weights(model, config):
    """(eager, ours): ``model`` of ``config(attn_implementation)``, one random init, the same weights."""
    torch.manual_seed(0)
    eager = model(config("eager"))
    ours = model(config(NAME))
    ours.load_state_dict(eager.state_dict())
    return eager, ours


def models(family, **overrides):
    """(eager, ours) of a family in FAMILIES: one random init, the same weights."""
    model, config, extra = FAMILIES[family]
    return same_weights(model, lambda attn_implementation: config(**BASE, **extra, **overrides,
                                                                  attn_implementation=attn_implementation))


def tokens(batch, length, seed=1):
    return torch.randint(1, BASE["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(seed))


def strict(backend):
    return forced_strict(backend) if backend else contextlib.nullcontext()


def run(model, backend=None, valid=None, **inputs):
    """Logits and every parameter's gradient of a random projection of the logits at the ``valid`` tokens."""
    model.zero_grad(set_to_none=True)
    with strict(backend):
        logits = model(**inputs).logits
        weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(2))
        if valid is not None:
            weights = weights * valid[..., None]
        (logits * weights).sum().backward()
    return logits.detach(), {name: p.grad for name, p in model.named_parameters()}


def assert_matches_eager(eager, ours, backend, valid=None, eager_inputs=None, **inputs):
    """Logits at the valid tokens and every gradient within the attention tolerances (conformance/tolerances.py;
    gradients scaled by its GRADIENT_FACTOR) of eager's on the same inputs (or ``eager_inputs``)."""
    theirs, their_grads = run(eager, None, valid, **(eager_inputs or inputs))
    mine, my_grads = run(ours, backend, valid, **inputs)
    keep = (slice(None),) if valid is None else (valid.bool(),)
    torch.testing.assert_close(mine[keep], theirs[keep], atol=TOL.atol, rtol=TOL.rtol)
    assert my_grads.keys() == their_grads.keys()
    for name, grad in their_grads.items():
        assert (grad is None) == (my_grads[name] is None), name
        if grad is not None:
            torch.testing.assert_close(my_grads[name], grad, atol=GRAD_TOL.atol, rtol=GRAD_TOL.rtol, msg=name)


@pytest.fixture
def calls(monkeypatch):
    """The portable_ops functions the integration called, in order."""
    seen = []
    for op in ("attention", "attention_varlen"):
        original = getattr(portable_ops, op)
        monkeypatch.setattr(portable_ops, op, lambda *a, _op=op, _f=original, **k: seen.append(_op) or _f(*a, **k))
    return seen


# ----------------------------------------------------------------------------- registration

def test_importing_portable_ops_does_not_import_transformers():
    code = "import sys, portable_ops, portable_ops.integrations; print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_register_is_idempotent_and_refuses_names_taken():
    from transformers import AttentionInterface

    assert register() == register() == NAME == "portable_ops"
    for taken in ("sdpa", "eager", "my_flash_attention", "paged|portable_ops"):
        with pytest.raises(ValueError, match="name"):
            register(taken)
    AttentionInterface.register("someone_elses", lambda *a, **k: None)
    try:
        with pytest.raises(ValueError, match="already registered"):
            register("someone_elses")
    finally:
        del AttentionInterface._global_mapping["someone_elses"]


def test_missing_or_old_transformers_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "4.57.1")  # the module register() imports
    with pytest.raises(ImportError, match=r"transformers 4\.57\.1 is installed.*transformers >= 5\.0"):
        register()
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match=r"needs transformers >= 5\.0.*not installed"):
        register()


# ----------------------------------------------------------------------------- the mapping

class Attention(torch.nn.Module):
    is_causal = True
    layer_idx = 0


@pytest.mark.parametrize("sq, skv, sliding_window", [(8, 8, 3), (8, 8, 1), (1, 8, 3), (3, 9, 4), (6, 6, 9)])
def test_a_sliding_window_sees_what_eagers_mask_lets_it(sq, skv, sliding_window):
    # q = k = 0 and v = I: each query's output is uniform over exactly the keys it sees
    q, k, v = torch.zeros(1, 1, sq, skv), torch.zeros(1, 1, skv, skv), torch.eye(skv)[None, None]
    with forced_strict("reference"):
        out, weights = attention_forward(Attention(), q, k, v, None, sliding_window=sliding_window)
    # the mask function eager's mask is made of, at the last sq of skv positions
    eager = masking_utils.sliding_window_causal_mask_function(sliding_window)(
        torch.tensor(0), torch.tensor(0), torch.arange(skv - sq, skv)[:, None], torch.arange(skv)[None, :])
    assert weights is None and out.shape == (1, sq, 1, skv)
    assert torch.equal(out[0, :, 0] > 0, eager)


def family_cases():
    """Every family on reference and nki; triton (the interpreter: slow) on the two that cover its features."""
    return [(family, backend) for family in FAMILIES for backend in BACKENDS
            if backend != "triton" or family in ("llama", "gemma2")]


@pytest.mark.parametrize("family, backend", family_cases())
def test_a_family_matches_eager(family, backend, calls):
    eager, ours = models(family)
    assert_matches_eager(eager, ours, backend, input_ids=tokens(2, 12))
    assert set(calls) == {"attention"}


@pytest.mark.parametrize("side, backend", [("right", b) for b in BACKENDS] + [("left", "reference")])
def test_a_padded_batch_is_unpadded_and_matches_eager(side, backend, calls):
    eager, ours = models("gemma2")  # window and softcap through the packed kernels
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[0, 7:] = 0
    if side == "left":
        mask = mask.flip(1)
    assert_matches_eager(eager, ours, backend, valid=mask, input_ids=tokens(2, 12), attention_mask=mask)
    assert set(calls) == {"attention_varlen"}


def packed_positions():
    """Two rows of packed sequences (lengths 5 + 4 + 3, and 2 + 10), as position ids restarting."""
    return torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1, 2], [0, 1, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9]])


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_packed_batch_matches_eager(backend, calls):
    eager, ours = models("mistral")  # its window inside each packed sequence
    assert_matches_eager(eager, ours, backend, input_ids=tokens(2, 12), position_ids=packed_positions(),
                         use_cache=False)
    assert set(calls) == {"attention_varlen"}


def test_cu_seq_lens_pack_as_flash_attention_does(calls):
    from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids

    eager, ours = models("qwen3")
    positions = packed_positions().reshape(1, -1)
    (cu_q, cu_k), (max_q, max_k) = prepare_fa_kwargs_from_position_ids(positions)
    packing = dict(cu_seq_lens_q=cu_q, cu_seq_lens_k=cu_k, max_length_q=max_q, max_length_k=max_k)
    ids = tokens(1, 24)
    # A trainer's call keeps the cache on, where eager does not pack: eager is shown the packing by use_cache=False
    assert_matches_eager(eager, ours, "reference", input_ids=ids, position_ids=positions, **packing,
                         eager_inputs=dict(input_ids=ids, position_ids=positions, use_cache=False))
    assert_matches_eager(eager, ours, "reference", input_ids=ids, position_ids=positions, use_cache=False, **packing)
    assert set(calls) == {"attention_varlen"}
    with pytest.raises(ValueError, match="max_length_k missing"):
        ours(ids, position_ids=positions, **{**packing, "max_length_k": None})
    wrong = dict(packing, cu_seq_lens_q=cu_q.flip(0).neg().add(24), cu_seq_lens_k=cu_k.flip(0).neg().add(24))
    with pytest.raises(ValueError, match="cu_seq_lens_q/k mark other sequences"):
        ours(ids, position_ids=positions, use_cache=False, **wrong)


def test_position_ids_restarting_where_transformers_does_not_pack_are_refused():
    _, ours = models("llama")
    with pytest.raises(ValueError, match="position_ids restart.*use_cache=False"):
        ours(tokens(2, 12), position_ids=packed_positions())  # the cache is on by default


def generate(model, backend, ids, **options):
    with strict(backend):
        out = model.generate(ids, max_new_tokens=6, do_sample=False, output_scores=True,
                             return_dict_in_generate=True, **options)
    return out.sequences, torch.stack(out.scores)


# (family, prompt length, left-padded, static cache): the prompt plus 6 new tokens pass the window of 5, so decoding
# slides it; a static cache's tail is empty until filled, a static sliding cache of 5 fills past a prompt of 3.
GENERATE_CASES = ([("llama", 8, False, False, b) for b in BACKENDS]
                  + [(family, 8, True, False, "reference") for family in ("mistral", "gemma2")]
                  + [("llama", 8, True, True, "reference"), ("gemma2", 3, True, True, "reference")])


@pytest.mark.parametrize("family, prompt, left_padded, static, backend", GENERATE_CASES)
def test_greedy_generation_matches_eager(family, prompt, left_padded, static, backend):
    eager, ours = models(family)
    ids = tokens(2, prompt)
    options = dict(cache_implementation="static") if static else {}
    if left_padded:
        options["attention_mask"] = torch.ones_like(ids)
        options["attention_mask"][0, :2] = 0
    theirs, their_scores = generate(eager, None, ids, **options)
    mine, my_scores = generate(ours, backend, ids, **options)
    assert torch.equal(mine, theirs)
    torch.testing.assert_close(my_scores, their_scores, atol=TOL.atol, rtol=TOL.rtol)


def test_a_backend_declining_packed_attention_refuses_under_strict_mode(fake_backend):
    """A backend with dense attention only (a stand-in: every real backend takes packed sequences): under strict mode a
    padded batch, which the integration runs as packed sequences, is refused naming the op."""
    fake_backend("triton", ops=("attention_fwd", "attention_bwd"))
    _, ours = models("llama")
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[0, 7:] = 0
    with forced_strict("triton"), pytest.raises(BackendUnavailableError, match="attention_varlen"):
        ours(tokens(2, 12), attention_mask=mask)


# ----------------------------------------------------------------------------- refusals

def test_gpt_oss_sinks_match_eager(calls):
    """gpt-oss's learned sinks (``s_aux``, a parameter of each attention layer) and its sliding layers: logits and
    every gradient, the sinks' included, as eager's."""
    def config(attn_implementation):
        return transformers.GptOssConfig(vocab_size=100, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=2,
                                         num_experts_per_tok=1, sliding_window=4, initializer_range=0.3,
                                         attn_implementation=attn_implementation)

    eager, ours = same_weights(transformers.GptOssForCausalLM, config)
    assert_matches_eager(eager, ours, "reference", input_ids=tokens(2, 9))
    assert set(calls) == {"attention"}


def test_deepseek_v3_latent_attention_head_dims_match_eager(calls):
    """DeepSeek-V3's multi-head latent attention: queries and keys of 192 (128 + 64 rope), values of 128."""
    def config(attn_implementation):
        return transformers.DeepseekV3Config(
            vocab_size=100, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
            topk_group=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=64,
            qk_nope_head_dim=128, v_head_dim=128, initializer_range=0.3, attn_implementation=attn_implementation)

    eager, ours = same_weights(transformers.DeepseekV3ForCausalLM, config)
    assert_matches_eager(eager, ours, "reference", input_ids=tokens(2, 6))
    assert set(calls) == {"attention"}


def test_what_has_no_mapping_is_refused_naming_the_argument():
    _, ours = models("llama", attention_dropout=0.1)
    ours.eval()  # a model built from its config is in training mode
    ids = tokens(2, 6)
    with pytest.raises(NotImplementedError, match="output_attentions=True"):
        ours(ids, output_attentions=True)
    # 5.17 builds a bidirectional mask for it, which the mask function refuses; 5.0 a causal one
    with pytest.raises(NotImplementedError, match="bidirectional|is_causal=False"):
        ours(ids, is_causal=False)
    with pytest.raises(NotImplementedError, match="attention_mask of shape"):
        ours(ids, attention_mask=torch.zeros(2, 1, 6, 6))
    ours.train()
    with pytest.raises(NotImplementedError, match="dropout=0.1 while training"):
        ours(ids)
    q = k = v = torch.zeros(1, 1, 4, 8)
    with pytest.raises(NotImplementedError, match="is_causal=False"):
        attention_forward(Attention(), q, k, v, None, is_causal=False)
    with pytest.raises(NotImplementedError, match="position_bias"):
        attention_forward(Attention(), q, k, v, None, position_bias=torch.zeros(1, 1, 4, 4))
    with pytest.raises(ValueError, match="attention_mask is a 2-D torch.int64 mask"):
        attention_forward(Attention(), q, k, v, torch.ones(1, 4, dtype=torch.long))
    hole = torch.tensor([[True, False, True, True]])
    with pytest.raises(NotImplementedError, match="sliding_window with an attention_mask that has padding between"):
        attention_forward(Attention(), q, k, v, hole, sliding_window=2)


@pytest.mark.parametrize("mask_function, what", [
    (masking_utils.bidirectional_mask_function, "bidirectional"),
    (masking_utils.chunked_causal_mask_function(4, torch.zeros(1, dtype=torch.long)), "chunked_overlay"),
    (masking_utils.or_masks(masking_utils.causal_mask_function, lambda b, h, q, kv: q == kv), "or_mask"),
], ids=["bidirectional", "chunked", "overlay"])
def test_a_mask_portable_ops_cant_express_is_refused(mask_function, what):
    with pytest.raises(NotImplementedError, match=f"mask_function|{what}") as error:
        build_mask(batch_size=1, q_length=4, kv_length=4, q_offset=0, mask_function=mask_function)
    assert what in str(error.value)


# ----------------------------------------------------------------------------- torch.compile and host reads

def compiled_counts(model, **inputs):
    """(graphs, graph breaks, logits) of ``torch.compile`` (Dynamo, eager backend: the counts are Dynamo's) of a
    function calling ``model``, from a fresh Dynamo, with a backward as in training."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()

    def forward(**kwargs):
        return model(**kwargs)

    with forced_strict("reference"):
        out = torch.compile(forward, backend="eager")(**inputs)
        out.loss.backward()
    counts = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    torch._dynamo.reset()
    return counts, out.logits.detach()


@pytest.mark.parametrize("family", ["llama", "mistral"])
@pytest.mark.parametrize("use_cache", [None, False], ids=["cache_default", "no_cache"])
def test_the_training_call_compiles_as_sdpa_does(family, use_cache, calls):
    eager, ours = models(family)
    sdpa = FAMILIES[family][0](FAMILIES[family][1](**BASE, **FAMILIES[family][2], attn_implementation="sdpa"))
    sdpa.load_state_dict(eager.state_dict())
    ids = tokens(2, 12)
    inputs = dict(input_ids=ids, labels=ids, **({} if use_cache is None else dict(use_cache=use_cache)))
    theirs, _ = compiled_counts(sdpa, **inputs)
    mine, logits = compiled_counts(ours, **inputs)
    assert mine == theirs
    assert set(calls) == {"attention"}  # portable_ops' dense attention ran in every layer
    torch.testing.assert_close(logits, eager(**inputs).logits.detach(), atol=TOL.atol, rtol=TOL.rtol)


def test_packed_position_ids_under_compile_are_refused_not_run_dense():
    _, ours = models("mistral")
    ids = tokens(2, 12)
    for use_cache in (None, False):  # compiled, transformers' packed mask can't be read without leaving the graph
        with pytest.raises(Exception, match="position_ids restart"):
            compiled_counts(ours, input_ids=ids, labels=ids, position_ids=packed_positions(), use_cache=use_cache)


def test_an_unpadded_forward_reads_nothing_on_the_host(monkeypatch):
    """Each of these is a device-to-host copy (a sync) on a GPU; the integration does none for an unpadded batch.
    The CPU takes the CUDA path here (an asynchronous assert, not a host read: on the CPU a read costs nothing)."""
    from portable_ops.integrations import transformers as integration

    monkeypatch.setattr(integration, "_ASYNC_CHECKED", ("cuda", "cpu"))
    _, ours = models("mistral")
    ids = tokens(2, 12)
    ours(input_ids=ids, labels=ids)  # first calls may set things up
    reads = []
    for name in ("item", "__bool__", "tolist", "__int__", "__float__", "__index__"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name,
                            lambda self, *a, _n=name, _f=original: reads.append(_n) or _f(self, *a))
    ours(input_ids=ids, labels=ids)
    assert reads == []
    with pytest.raises(RuntimeError, match="position_ids restart"):  # the check still runs, in the assert
        ours(input_ids=ids, position_ids=packed_positions())


def test_a_device_side_refusal_fits_the_asserts_message_limit(monkeypatch):
    """CUDA's asynchronous assert refuses a message of 255 characters or more (a RuntimeError in every forward)."""
    from portable_ops.integrations import transformers as integration

    monkeypatch.setattr(integration, "_ASYNC_CHECKED", ("cuda", "cpu"))
    messages = []
    monkeypatch.setattr(torch, "_assert_async", lambda ok, message="": messages.append(message))
    _, ours = models("llama")
    ids = tokens(2, 12)
    ours(input_ids=ids, labels=ids)
    assert messages and all(len(m) <= integration.ASSERT_MESSAGE_LIMIT < 255 for m in messages)
