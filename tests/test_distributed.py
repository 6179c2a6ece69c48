"""FSDP2 (DTensor parameters) on 2 CPU processes over gloo: same training as one process."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import portable_ops

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch built without distributed")

STEPS = 6


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.GELU(), torch.nn.Linear(32, 32), torch.nn.GELU(),
                               torch.nn.Linear(32, 3))


def batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 12, generator=g), torch.randn(8, 3, generator=g)) for _ in range(STEPS)]


def train(model, opt, data):
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses)


def _worker(rank, world, port, out_file):
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                         set_optimizer_state_dict)
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = make_model()
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)
        opt = portable_ops.optim.AdamW(model.parameters(), lr=1e-2, max_grad_norm=0.05)
        data = batches()  # every rank the same batch: FSDP's averaged grad is the one-process grad
        half = STEPS // 2
        losses = train(model, opt, data[:half])
        # The norm reduced across ranks is the whole model's: every rank clips by the same factor.
        norms = [torch.zeros(()) for _ in range(world)]
        dist.all_gather(norms, opt.last_grad_norm.reshape(()))
        full = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
        saved_step = full["state"]["0.weight"]["step"].item()  # state dicts alias live state, as in torch
        opt.zero_grad(set_to_none=True)  # as after a restart: torch's loader initialises state from no grads
        opt2 = portable_ops.optim.AdamW(model.parameters(), lr=1e-2, max_grad_norm=0.05)
        set_optimizer_state_dict(model, opt2, full, options=StateDictOptions(full_state_dict=True))
        losses = torch.cat([losses, train(model, opt2, data[half:])])
        params = [p.detach().full_tensor() for p in model.parameters()]
        if rank == 0:
            torch.save((losses, norms, params, saved_step), out_file)
    finally:
        dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_fsdp2_matches_one_process_with_fused_clip_and_checkpoint(tmp_path):
    out_file = str(tmp_path / "rank0.pt")
    mp.start_processes(_worker, args=(2, free_port(), out_file), nprocs=2, join=True, start_method="spawn")
    losses, norms, params, saved_step = torch.load(out_file)

    model = make_model()
    opt = portable_ops.optim.AdamW(model.parameters(), lr=1e-2, max_grad_norm=0.05)
    expected = train(model, opt, batches())
    torch.testing.assert_close(losses, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(norms[0], norms[1])
    for a, b in zip(params, model.parameters()):
        torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-6)
    assert saved_step == STEPS // 2


def test_clip_grad_norm_of_dtensor_grads_in_one_process_mesh():
    """A one-rank mesh exercises the DTensor path without spawning: same as plain tensors."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        plain = [torch.nn.Parameter(torch.randn(6, 4)) for _ in range(3)]
        for p in plain:
            p.grad = torch.randn_like(p) * 3
        sharded = [torch.nn.Parameter(distribute_tensor(p.detach().clone(), mesh, [Shard(0)])) for p in plain]
        for s, p in zip(sharded, plain):
            s.grad = distribute_tensor(p.grad.clone(), mesh, [Shard(0)])
        def with_grads(params):
            copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
            for c, p in zip(copies, params):
                c.grad = p.grad.clone()
            return copies

        for norm_type in (2.0, float("inf")):
            a = portable_ops.clip_grad_norm_(with_grads(plain), 0.5, norm_type)
            b = portable_ops.clip_grad_norm_(sharded, 0.5, norm_type)
            torch.testing.assert_close(a, b)
            for s, p in zip(sharded, plain):
                s.grad = distribute_tensor(p.grad.clone(), mesh, [Shard(0)])
        clipped = with_grads(plain)
        portable_ops.clip_grad_norm_(clipped, 0.5)
        portable_ops.clip_grad_norm_(sharded, 0.5)
        for s, p in zip(sharded, clipped):
            torch.testing.assert_close(s.grad.full_tensor(), p.grad)
    finally:
        dist.destroy_process_group()
