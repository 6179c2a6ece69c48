"""The nki backend's PyTorch boundary: each kernel's launch is a custom op ``portable_ops_nki::<name>``, registered
through ``nki_op`` as AWS documents for torch-neuronx (backends/nki/runtime.py). Here ``nki_op`` is the project's test
double of torch-neuronx's (backends/nki/emulator/torch_neuronx.py: real ``torch.library`` ops, every undeclared write
refused), CPU tensors stand in for ``neuron`` ones and the kernels run in the emulator (with torch-neuronx installed,
torch-neuronx's own ``nki_op`` registers them and ``nki.simulate`` runs them: these tests hold there too).
"""

import ast
import importlib
import importlib.util
import json
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch

import portable_ops
from portable_ops.backends.nki import runtime, tensor_table
from portable_ops.backends.nki.emulator import torch_neuronx as double

# the op modules (the package's own names adam, sgd, grad_norm are the backend's functions)
adam, sgd, grad_norm, attention, norms, linear_cross_entropy, rope, paged_attention, paged_kv_append = (
    importlib.import_module(f"portable_ops.backends.nki.{name}")
    for name in ("adam", "sgd", "grad_norm", "attention", "norms", "linear_cross_entropy", "rope", "paged_attention",
                 "paged_kv_append"))

KERNEL_DIR = pathlib.Path(__file__).resolve().parents[1] / "backends" / "nki"
OPS = {"adam": adam.adam_step, "sgd": sgd.sgd_step, "grad_norm": grad_norm.norm_op,
       "attention_fwd": attention.attention_fwd_op, "attention_bwd": attention.attention_bwd_op,
       "norm_fwd": norms.norm_fwd_op, "norm_bwd": norms.norm_bwd_op,
       "linear_cross_entropy_rows": linear_cross_entropy.rows_op, "rope": rope.rope_op, "rope_": rope.rope_inplace_op,
       "paged_attention": paged_attention.paged_attention_op, "paged_kv_append": paged_kv_append.paged_kv_append_op}
# What each kernel writes of what it is given: the optimizers update params and state in place (and their grads
# under a grad scale or clip), rope_ q and k, the append the caches' token rows.
WRITES = {"adam": {"params", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs"},
          "sgd": {"params", "grads", "momentum_buffers"},
          "rope_": {"q", "k"}, "paged_kv_append": {"k_rows", "v_rows"}}


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# A step under a grad scale: the optimizer ops then write their grads back too (unscaled).
GRAD_SCALE = torch.tensor(1024.0)


def _adam_args():
    sizes = (130, 5)  # a [128, 1] body and a tail row; a tail row alone
    state = [[_randn(n, seed=10 * kind + i) for i, n in enumerate(sizes)] for kind in range(5)]
    params, grads, exp_avgs, exp_avg_sqs, maxes = state
    exp_avg_sqs, maxes = [t.abs() for t in exp_avg_sqs], [t.abs() for t in maxes]
    blocks = tensor_table.tail_blocks(sizes, [torch.float32] * len(sizes))
    hyper = adam.hyperparameters([torch.tensor(3.0)] * len(sizes), blocks, device=torch.device("cpu"), beta1=0.9,
                                 beta2=0.999, lr=1e-2, weight_decay=0.0, eps=1e-8, maximize=False,
                                 decoupled_weight_decay=False, grad_scale=GRAD_SCALE, found_inf=None, clip_coef=None)
    return [params, grads, exp_avgs, exp_avg_sqs, maxes, hyper, True, adam.DECAY_NONE, False, True, False]


def _sgd_args():
    params, grads, buffers = ([_randn(n, seed=10 * kind + n) for n in (130, 5)] for kind in range(3))
    hyper = sgd.hyperparameters(device=torch.device("cpu"), lr=0.1, momentum=0.9, dampening=0.0, weight_decay=0.0,
                                maximize=False, grad_scale=GRAD_SCALE, found_inf=None, clip_coef=None)
    return [params, grads, buffers, hyper, True, False, False, False, False, False, True, False]


ATTENTION_OPTIONS = [0.35, True, 3, None, None]  # scale, causal, a window's left side, no right side, no softcap


def _attention_inputs(requires_grad=False):
    q, k, v = _randn(1, 2, 5, 8, seed=1), _randn(1, 1, 7, 8, seed=2), _randn(1, 1, 7, 8, seed=3)
    sinks = _randn(2, seed=4)
    return [t.requires_grad_(requires_grad) for t in (q, k, v, sinks)]


def _attention_bwd_args():
    q, k, v, sinks = _attention_inputs()
    out, lse = attention.attention_fwd_op(q, k, v, sinks, *ATTENTION_OPTIONS)
    return [q, k, v, out, lse, _randn(*out.shape, seed=5), sinks, _randn(*lse.shape, seed=6), *ATTENTION_OPTIONS]


def _norm_bwd_args():
    x = _randn(6, 16, seed=1)
    return [x, _randn(6, seed=2).abs() + 0.5, _randn(6, 16, seed=3), _randn(16, seed=4), _randn(6, seed=5),
            _randn(6, 16, seed=6), False, True]


def _rows_args():
    logits, target = _randn(5, 11, seed=1), torch.tensor([3, -1, 0, 10, 7])  # -1: an ignored token
    valid = target >= 0
    columns = [logits.gather(1, target.clamp_min(0)[:, None]), valid, torch.where(valid, 0.2, 0.0)]
    return [logits, *(c.to(torch.float32).reshape(-1, 1) for c in columns), 0.1, 30.0, True]


def _rope_args(in_place=False):
    angles = _randn(1, 6, 4, seed=1).repeat(1, 1, 2)
    q, k = _randn(1, 2, 6, 8, seed=2), _randn(1, 1, 6, 8, seed=3)
    return [angles.cos(), angles.sin(), q, k, False] + ([] if in_place else [False])


def _cache_rows(seed):
    """A pool of 3 pages of 4 tokens, 2 KV heads of 8, as its token rows."""
    return paged_attention.cache_rows(_randn(3, 4, 2, 8, seed=seed))


def _paged_attention_args():
    table, lengths = torch.tensor([[2, 0], [1, 2]], dtype=torch.int32), torch.tensor([6, 3], dtype=torch.int32)
    tables = paged_attention.kernel_tables(table, lengths, 1, 2, 2, 4, 12, 4)  # 2 x 2 query heads, a window of 4
    q = paged_attention._as_rows(_randn(2, 1, 4, 8, seed=3), 2)
    return [q, _cache_rows(1), _cache_rows(2), *tables, _randn(4, 1, seed=4), 0.35, 30.0, True]


ARGS = {"adam": _adam_args, "sgd": _sgd_args, "grad_norm": lambda: [[_randn(130, seed=1), _randn(5, seed=2)], False],
        "attention_fwd": lambda: [*_attention_inputs(requires_grad=True), *ATTENTION_OPTIONS],
        "attention_bwd": _attention_bwd_args,
        "norm_fwd": lambda: [_randn(6, 16, seed=1), _randn(6, 16, seed=2), _randn(16, seed=3), _randn(16, seed=4),
                             1e-5, False],
        "norm_bwd": _norm_bwd_args, "linear_cross_entropy_rows": _rows_args, "rope": _rope_args,
        "rope_": lambda: _rope_args(in_place=True), "paged_attention": _paged_attention_args,
        "paged_kv_append": lambda: [_cache_rows(1), _cache_rows(2), torch.tensor([[5], [9]], dtype=torch.int32),
                                    _randn(2, 2, 8, seed=3), _randn(2, 2, 8, seed=4)]}


def _written(op):
    """The names of the arguments the op's schema declares written."""
    return {a.name for a in op.op._opoverload._schema.arguments if a.alias_info is not None and a.alias_info.is_write}


def _tensors(name, value):
    return list(double._tensors(name, value))


def test_every_kernel_is_an_op_declaring_what_it_writes():
    registered = {name.split("::")[1] for name in torch._C._dispatch_get_all_op_names()
                  if name.startswith(f"{runtime.NAMESPACE}::")}
    assert registered >= set(OPS)
    assert {name: _written(op) for name, op in OPS.items() if _written(op)} == WRITES
    # and no kernel is launched past an op: every launch(...) sits in a function registered with @kernel_op, or in
    # one that only such functions call
    for path in sorted(KERNEL_DIR.glob("*.py")):
        functions = [fn for fn in ast.walk(ast.parse(path.read_text())) if isinstance(fn, ast.FunctionDef)]
        ops = [fn for fn in functions if any(ast.unparse(d).startswith("kernel_op(") for d in fn.decorator_list)]

        def calls(fn, name):
            return any(isinstance(n, ast.Call) and getattr(n.func, "id", None) == name for n in ast.walk(fn))

        for fn in functions:
            if fn not in ops and calls(fn, "launch"):
                callers = [other for other in functions if other is not fn and calls(other, fn.name)]
                assert callers and all(c in ops for c in callers), f"{path.name}: {fn.name} launches a kernel"


@pytest.mark.parametrize("name", OPS)
def test_every_op_passes_opcheck(name):
    torch.library.opcheck(OPS[name].op, ARGS[name]())


@pytest.mark.parametrize("name", WRITES)
def test_an_op_writes_every_argument_it_declares_and_nothing_else(name):
    op, args = OPS[name], ARGS[name]()
    params = list(op.op._opoverload._schema.arguments)
    before = {label: t.clone() for a, value in zip(params, args) for label, t in _tensors(a.name, value)}
    op(*args)
    for a, value in zip(params, args):
        for label, t in _tensors(a.name, value):
            assert torch.equal(t, before[label]) != (a.name in WRITES[name]), f"{name}: {label}"


def test_the_double_refuses_a_kernel_writing_an_argument_mutates_args_omits():
    # Adam's launch, declared as writing all it writes but the grads, which a scaled step writes back
    undeclared = double.nki_op("portable_ops_nki_test::adam_but_grads", adam.adam_step.launch_fn,
                               mutates_args=("params", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs"))
    with pytest.raises(double.UndeclaredWrite, match=r"wrote its argument grads\[0\]"):
        undeclared(*_adam_args())
    with pytest.raises(ValueError, match="expected 'namespace::name'"):
        double.nki_op("adam_without_namespace", adam.adam_step.launch_fn, mutates_args=("params",))


def test_attention_gradients_through_the_registered_backward_equal_the_dispatched_path():
    q, k, v, sinks = _attention_inputs(requires_grad=True)
    w_out, w_lse = _randn(1, 2, 5, 8, seed=7), _randn(1, 2, 5, seed=8)
    scale, causal, left, _, _ = ATTENTION_OPTIONS
    with portable_ops.use_backend("nki"):
        out, lse = portable_ops.attention(q, k, v, causal=causal, scale=scale, window=(left, None), sinks=sinks,
                                          return_lse=True)
    expected = torch.autograd.grad((out * w_out).sum() + (lse * w_lse).sum(), (q, k, v, sinks))
    op_out, op_lse = attention.attention_fwd_op(q, k, v, sinks, *ATTENTION_OPTIONS)
    got = torch.autograd.grad((op_out * w_out).sum() + (op_lse * w_lse).sum(), (q, k, v, sinks))
    assert torch.equal(op_out, out) and torch.equal(op_lse, lse)
    for name, g, want in zip(("dq", "dk", "dv", "dsinks"), got, expected):
        assert torch.equal(g, want), name


def test_a_compiled_step_through_the_attention_op_has_no_graph_break():
    graphs = []

    def recording(gm, example_inputs):  # aot_eager, keeping the graph Dynamo captured
        graphs.append(gm)
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    def step(q, k, v, sinks):
        out, lse = attention.attention_fwd_op(q, k, v, sinks, *ATTENTION_OPTIONS)
        return out.square().sum() + lse.sum()

    eager = _attention_inputs(requires_grad=True)
    compiled = [t.detach().clone().requires_grad_() for t in eager]
    step(*eager).backward()
    torch.compile(step, backend=recording, fullgraph=True)(*compiled).backward()
    assert len(graphs) == 1
    assert any("portable_ops_nki.attention_fwd" in str(node.target) for node in graphs[0].graph.nodes)
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=0)


# Naming PrivateUse1 "neuron" (what torch-neuronx does) holds for the whole process: a process of its own.
NEURON_DEVICE = textwrap.dedent("""
    import json
    import torch
    torch.utils.rename_privateuse1_backend("neuron")

    class Neuron:  # torch.neuron as torch-neuronx registers it, as far as dispatch asks
        @staticmethod
        def is_available():
            return True

    torch._register_device_module("neuron", Neuron)
    from portable_ops import dispatch, doctor
    from portable_ops.conformance import __main__ as cli, runner

    neuron = torch.device("neuron")
    print(json.dumps(dict(preference=dispatch.preference(neuron), placement=str(runner.placement("nki").device),
                          reasons=dispatch.get_backend("nki").device_reasons(neuron), doctor=doctor.report(),
                          cli=cli.main(["--backend", "nki", "--case", "adam_odd_sizes"]))))
""")


@pytest.mark.skipif(importlib.util.find_spec("torch_neuronx") is not None,
                    reason="torch-neuronx names the neuron device itself: the Trainium job runs nki there")
def test_dispatch_doctor_and_conformance_take_nkis_device_from_its_declaration():
    result = subprocess.run([sys.executable, "-c", NEURON_DEVICE], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(result.stdout.splitlines()[-1])
    assert seen["preference"] == ["nki", "reference"] and seen["placement"] == "neuron"
    assert "default for neuron;" in seen["doctor"] and "neuron (none here)" not in seen["doctor"]
    # no Neuron SDK here: the conformance CLI refuses nki on its device, saying why, rather than run it elsewhere
    assert seen["reasons"] and "Neuron SDK" in seen["reasons"][0] and seen["cli"] == 2
    assert "backend 'nki' is unavailable: neuron tensors need the Neuron SDK" in result.stderr
