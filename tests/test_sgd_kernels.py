"""SGD's kernels on each backend (one launch per dtype group, what each reads and writes), the reference's torch
paths, the bench's SGD variants, DTensor and complex params; tests/test_sgd.py holds the behaviour against
torch.optim.SGD."""

import pytest
import torch
from conftest import assert_bit_identical, snapshot
from test_sgd import BACKENDS, sgd_lists
from torch.optim.sgd import sgd as torch_sgd

import portable_ops
from portable_ops import dispatch
from portable_ops.conformance import tolerance
from portable_ops.conformance.runner import default_device, usable_backends

def test_explain_names_the_backend_and_why_not_the_others():
    params, grads, buffers = sgd_lists()
    choice = portable_ops.explain(portable_ops.functional.sgd, params, grads, buffers, momentum=0.9, lr=0.1)
    assert choice.backend == "reference"
    with pytest.raises(TypeError, match=r"explain\(sgd, \.\.\.\): missing d_p_list, momentum_buffer_list"):
        portable_ops.explain("sgd", params)


def _mixed_call(device, first):
    """Lists of float32, bfloat16 and float16 tensors (odd sizes), buffers new where ``first`` says."""
    g = torch.Generator().manual_seed(4)
    shapes = [(1,), (129,), (33, 65), (1000,), (3,), (5, 7, 11)]
    dtypes = [torch.float32, torch.bfloat16, torch.float16]
    params = [torch.randn(s, generator=g).to(device, dtypes[i % 3]) for i, s in enumerate(shapes)]
    grads = [torch.randn(p.shape, generator=g).to(device, p.dtype) for p in params]
    buffers = [None if f else torch.randn(p.shape, generator=g).to(device, p.dtype) for p, f in zip(params, first)]
    return params, grads, buffers


@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_dtypes_and_new_and_old_buffers_match_the_definition(backend, monkeypatch):
    from portable_ops.definitions.sgd import sgd as definition

    monkeypatch.setenv("PORTABLE_OPS_STRICT", "1")
    first = [True, False, False, True, False, True]
    params, grads, buffers = _mixed_call(default_device(backend), first)
    ref_p, ref_g = [t.double().cpu() for t in params], [t.double().cpu() for t in grads]
    ref_b = [torch.empty_like(p) if b is None else b.double().cpu() for p, b in zip(ref_p, buffers)]
    kw = dict(lr=0.1, momentum=0.9, dampening=0.2, weight_decay=0.01, nesterov=False, maximize=True)
    with portable_ops.use_backend(backend):
        portable_ops.functional.sgd(params, grads, buffers, clip_coef=torch.tensor(0.5, device=params[0].device),
                                    **kw)
    definition(ref_p, ref_g, ref_b, first, clip_coef=torch.tensor(0.5, dtype=torch.float64), **kw)
    for ours, ref in zip(params + buffers, ref_p + ref_b):
        assert ours.dtype in (torch.float32, torch.bfloat16, torch.float16)
        atol, rtol = tolerance("sgd", ours.dtype)
        torch.testing.assert_close(ours.cpu(), ref.to(ours.dtype), atol=atol, rtol=rtol)


@pytest.mark.parametrize("first", [[False] * 6, [True, False, False, True, False, True]], ids=["old", "mixed"])
def test_triton_launches_once_per_dtype_and_first_step_group(first, monkeypatch):
    if "triton" not in usable_backends():
        pytest.skip(f"triton can't run here: {dispatch.unavailable_reason('triton')}")
    import importlib

    module = importlib.import_module("portable_ops.backends.triton.sgd")
    launches = []
    original = module.in_compile_env
    monkeypatch.setattr(module, "in_compile_env", lambda call, *a, **kw: launches.append(kw["FIRST"]) or
                        original(call, *a, **kw))
    params, grads, buffers = _mixed_call(default_device("triton"), first)
    with portable_ops.use_backend("triton"):
        portable_ops.functional.sgd(params, grads, buffers, lr=0.1, momentum=0.9)
    groups = {(p.dtype, f) for p, f in zip(params, first)}
    assert len(launches) == len(groups) == (3 if not any(first) else 4)


def test_nki_steps_the_292_tensor_list_in_one_launch_moving_each_byte_once():
    from portable_ops.backends.nki import emulator
    from portable_ops.bench.optimizer import gpt2_medium_shapes

    ops = dispatch.get_backend("nki").ops
    shapes = gpt2_medium_shapes()
    params, grads, buffers = ([torch.empty(s, device="meta") for s in shapes] for _ in range(3))
    call = dict(params=params, grads=grads, momentum_buffers=buffers, first_steps=(False,) * len(shapes), lr=0.1,
                momentum=0.9, dampening=0.0, weight_decay=0.01, nesterov=True, maximize=False)
    with emulator.count_only(), emulator.count_instructions() as stats:
        ops["sgd"].run(**call)
    n = sum(p.numel() for p in params)
    assert stats.launches == 1
    assert stats.dma_bytes_out == 2 * 4 * n  # param and buffer written once, in place
    assert stats.dma_bytes_in - 3 * 4 * n < 128 * 4 * 8  # param, grad, buffer read once, + the hyperparameters
    with emulator.count_only(), emulator.count_instructions() as first:
        ops["sgd"].run(**dict(call, first_steps=(True,) * len(shapes)))
    assert first.launches == 1 and first.dma_bytes_in - 2 * 4 * n < 128 * 4 * 8  # a new buffer is not read


def test_the_reference_takes_torchs_foreach_kernels_off_the_fused_devices(monkeypatch):
    """Where torch has no fused SGD for the device (the toy backend's, say): its foreach kernels, float32, and the
    caller's grads stay as they were (torch's foreach Nesterov adds the buffer into the grads it is handed)."""
    reference = __import__("portable_ops.backends.reference.sgd", fromlist=["sgd"])
    monkeypatch.setattr(reference, "FUSED_DEVICE_TYPES", ())
    used = []
    original = reference.torch_sgd
    monkeypatch.setattr(reference, "torch_sgd", lambda *a, **kw: used.append(kw["foreach"]) or original(*a, **kw))
    params, grads, buffers = sgd_lists()
    buffers[1] = None
    theirs, their_buffers = [p.clone() for p in params], [None if b is None else b.clone() for b in buffers]
    grads_before = snapshot(grads)
    kw = dict(lr=0.1, momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=True, maximize=False)
    portable_ops.functional.sgd(params, grads, buffers, **kw)
    torch_sgd(theirs, [g.clone() for g in grads], their_buffers, foreach=False, **kw)
    assert used == [True]
    assert_bit_identical(grads_before, grads)
    for a, b in zip(params + buffers, theirs + their_buffers):
        torch.testing.assert_close(a, b)


def test_torchs_fused_cpu_sgd_is_wrong_for_half_precision_so_the_reference_does_not_use_it():
    """backends/reference/sgd.py's reason for running the definition for float16/bfloat16 on the CPU (torch 2.13):
    the fused kernel's vectorised loop misses the plain ``p - lr * g`` by far more than a rounding. Should a
    torch release fix it, this test fails and the reference can take the fused kernel there again."""
    g = torch.Generator().manual_seed(0)
    p, grad = torch.randn(64, generator=g).bfloat16(), torch.randn(64, generator=g).bfloat16()
    expected = (p.float() - 0.1 * grad.float()).bfloat16()
    fused = p.clone()
    torch._fused_sgd_([fused], [grad.clone()], [], weight_decay=0.0, momentum=0.0, lr=0.1, dampening=0.0,
                      nesterov=False, maximize=False, is_first_step=False)
    assert (fused.float() - expected.float()).abs().max() > 0.05
    ours = p.clone()
    portable_ops.functional.sgd([ours], [grad], [], lr=0.1)
    assert torch.equal(ours, expected)


def test_the_optimizer_bench_sgd_variants_step_alike():
    """The bench's SGD row (``python -m portable_ops.bench optimizer``, CUDA only) times these optimizers over one
    list of params: each must step it as torch's fused SGD does. Here on CPU float32 tensors, where the fused
    kernel is right."""
    from portable_ops.bench.optimizer import sgd_bytes_per_element, sgd_variants

    g = torch.Generator().manual_seed(0)
    start = [torch.randn(s, generator=g) for s in ((33, 65), (7,), (1000,))]
    grads = [torch.randn(t.shape, generator=g) for t in start]
    results = {}
    for name, make in sgd_variants(params := [torch.nn.Parameter(t.clone()) for t in start],
                                   torch.tensor(1e-4)).items():
        with torch.no_grad():
            for p, t, grad in zip(params, start, grads):
                p.copy_(t)
                p.grad = grad.clone()
        opt = make()
        for _ in range(3):
            opt.step()
        results[name] = [p.detach().clone() for p in params]
    assert set(results) == {"torch fused", "torch foreach", "portable_ops", "portable_ops, graph"}
    for name, got in results.items():
        for a, b in zip(got, results["torch fused"]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=name)
    assert sgd_bytes_per_element(torch.bfloat16, momentum=True) == 10
    assert sgd_bytes_per_element(torch.float32, momentum=False) == 12


def test_dtensor_params_in_a_one_process_mesh_step_as_plain_ones_with_dtensor_buffers():
    """FSDP2's parameters are DTensors: the step runs on their local shards, and a new momentum buffer is a DTensor
    placed as its param (what torch's SGD keeps, so a distributed checkpoint sees the layout it expects)."""
    import os

    import torch.distributed as dist
    from test_distributed import free_port
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        g = torch.Generator().manual_seed(0)
        start = [torch.randn(6, 4, generator=g), torch.randn(5, generator=g)]
        grads = [[torch.randn(t.shape, generator=g) for t in start] for _ in range(3)]
        plain = [torch.nn.Parameter(t.clone()) for t in start]
        sharded = [torch.nn.Parameter(distribute_tensor(t.clone(), mesh, [Shard(0)])) for t in start]
        opts = [portable_ops.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, max_grad_norm=1.0)
                for ps in (plain, sharded)]
        for step_grads in grads:
            for p, s, grad in zip(plain, sharded, step_grads):
                p.grad = grad.clone()
                s.grad = distribute_tensor(grad.clone(), mesh, [Shard(0)])
            for opt in opts:
                opt.step()
        for p, s in zip(plain, sharded):
            buffer = opts[1].state[s]["momentum_buffer"]
            assert isinstance(buffer, DTensor) and buffer.placements == s.placements
            torch.testing.assert_close(s.full_tensor(), p.detach())
            torch.testing.assert_close(buffer.full_tensor(), opts[0].state[p]["momentum_buffer"])
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("backend", BACKENDS)
def test_complex_params_step_as_torchs_with_complex_buffers(backend, monkeypatch):
    """torch steps a complex param as its own dtype; the kernels take its (real, imaginary) pairs."""
    monkeypatch.setenv("PORTABLE_OPS_STRICT", "1")
    device = default_device(backend)
    g = torch.Generator().manual_seed(2)
    start = [torch.randn(s, dtype=torch.complex64, generator=g).to(device) for s in ((5, 3), (130,))]
    ours = [torch.nn.Parameter(t.clone()) for t in start]
    theirs = [torch.nn.Parameter(t.clone()) for t in start]
    opts = (portable_ops.optim.SGD(ours, lr=0.1, momentum=0.9, weight_decay=0.01),
            torch.optim.SGD(theirs, lr=0.1, momentum=0.9, weight_decay=0.01))
    for _ in range(3):
        for a, b in zip(ours, theirs):
            a.grad = torch.randn(a.shape, dtype=a.dtype, generator=g).to(device)
            b.grad = a.grad.clone()
        with portable_ops.use_backend(backend):
            opts[0].step()
        opts[1].step()
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b)
        assert opts[0].state[a]["momentum_buffer"].dtype == torch.complex64
        torch.testing.assert_close(opts[0].state[a]["momentum_buffer"], opts[1].state[b]["momentum_buffer"])
