"""bench ops: every case computes the same thing as its torch counterpart, in both directions (a CPU smoke run
at a tiny shape, torch.compile replaced by the eager function: the timings are the GPU's to take)."""

from __future__ import annotations

import torch

from portable_ops.bench import ops, train


def test_every_case_runs_and_agrees_with_torch(monkeypatch):
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)
    tiny = {"tiny": train.tiny(train.SHAPES[next(iter(train.SHAPES))])}
    rows = ops.run_ops(tiny, device="cpu")
    assert {(r["op"], r["dir"]) for r in rows} == {(c.op, d) for c in ops.cases(tiny) for d in ops.DIRECTIONS}
    for row in rows:
        assert row["max abs diff"] < 0.05, row  # bf16 outputs of the same function
        assert row["ours ms"] > 0 and row["vs compiled"] > 0
