"""AWS's own attention forward, counted per tile from its published source and priced with this project's NKI cost
model: the check on the model that needs no hardware.

Counted from github.com/aws-neuron/nki-library at d2ad3a5 (2026-04-13),
``src/nkilib_src/nkilib/core/attention/attention_cte.py``, along the path a causal bf16 call with head dim 128 takes
with the kernel's defaults (``tp_q=True``, ``tp_k=False``, ``tp_out=False``, float32 softmax and matmul output; no
sink, window, prefix cache or context parallelism; keys up to 10K, so one section). The counts are the tables below,
one row per instruction: where the kernel issues it, its engine and cost rule (``cost.FACTOR``; for a DMA its kind),
its free elements per partition (a DMA's bytes, and bytes per descriptor), and the buffers it reads and writes, which
the replay resolves per 128-query group ``g``, 512-key tile ``j`` and 128-key subtile ``t``. The replay issues the
rows into the emulator's trace (no arithmetic: count-only tiles) in the kernel's program order (its software
pipeline across groups), with the kernel's number of copies of each buffer (its modular allocation), one (batch,
head) on one NeuronCore, and ``cost.estimate`` prices the trace like any kernel's. Left out: the kernel's LNC=2
sharding (the comparison is per core) and the features this call does not use.

``python benchmarks/nki_attention_mix.py`` prints the estimate for B 1, H 32, S 4096, D 128, causal, beside the hand
roofline in issue 36 (2.3-2.6 ms on one NeuronCore, its Tensor and Scalar engines each near 1.8 ms busy).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from portable_ops.backends.nki import emulator
from portable_ops.backends.nki.emulator import cost, trace
from portable_ops.backends.nki.emulator import language as nl

S_TILE, K_TILE, LARGE_TILE, Q_GROUPS_PER_LOAD = 128, 512, 2048, 8  # _Q_GRP_SZ/_V_TILE_SZ, _K_TILE_SZ, ...
HAND_ROOFLINE_MS = (2.3, 2.6)  # issue 36: causal B 1, H 32, S 4096, D 128 on one NeuronCore


@dataclass(frozen=True)
class Step:
    source: str  # the attention_cte.py function that issues it
    instruction: str  # its nki.isa name
    engine: str
    rule: str  # the cost rule; for a DMA: copy, transpose_from_hbm, transpose_on_chip
    size: int  # free elements per partition; a DMA's bytes
    reads: tuple  # buffer names (the replay's views); a matmul's stationary first
    writes: tuple
    descriptor: int = 0  # a DMA copy's bytes per descriptor (one partition's contiguous run)


D = 128  # head dim; every count below is for D 128, bf16
PER_HEAD = [
    Step("_attention_cte_impl", "memset", "gpsimd", "stream", 1, (), ("zero_bias",)),
]
PER_K_TILE_LOAD = [  # _load_k_tile, tp_k=False: k is [d, seqlen], a [128, 512] bf16 tile per 512 keys
    Step("_load_k_tile", "dma_copy", "dma", "copy", D * K_TILE * 2, ("hbm_k",), ("k",), descriptor=K_TILE * 2),
]
PER_V_TILE_LOAD = [  # _load_v_tile: v is [seqlen, d], a [128, 128] bf16 tile per 128 keys
    Step("_load_v_tile", "dma_copy", "dma", "copy", S_TILE * D * 2, ("hbm_v",), ("v",), descriptor=D * 2),
]
PER_Q_LOAD = [  # _load_q_tile, tp_q=True: 8 groups' queries transposed to [d, 1024] by DMA from HBM
    Step("_load_q_tile", "dma_transpose", "dma", "transpose_from_hbm", Q_GROUPS_PER_LOAD * S_TILE * D * 2,
         ("hbm_q",), ("q_block",)),
]
PER_GROUP_START = [
    Step("_qk_and_max_impl", "memset", "gpsimd", "stream", 8, (), ("partial_max",)),
]
PER_K_TILE = [  # _qk_and_max_large_tile_impl, every 512-key tile the causal mask does not skip
    Step("_qk_and_max_large_tile_impl", "nc_matmul", "tensor", "matmul", K_TILE, ("q", "k"), ("scores",)),
]
PER_K_TILE_OFF_DIAGONAL = [  # no mask: scale and row max straight out of PSUM
    Step("_qk_and_max_large_tile_impl", "tensor_scalar_reduce", "vector", "stream", K_TILE, ("scores",),
         ("masked", "max_column")),
]
PER_K_TILE_ON_DIAGONAL = [  # the causal mask: a PSUM copy, affine_select on GpSimd, then scale and row max
    Step("_qk_and_max_large_tile_impl", "tensor_copy", "vector", "stream", K_TILE, ("scores",), ("scores_copy",)),
    Step("_qk_and_max_large_tile_impl", "affine_select", "gpsimd", "stream", K_TILE, ("scores_copy",),
         ("scores_masked",)),
    Step("_qk_and_max_large_tile_impl", "tensor_scalar_reduce", "vector", "stream", K_TILE, ("scores_masked",),
         ("masked", "max_column")),
]
PER_GROUP_MAX = [  # _update_max_impl, one section
    Step("_update_max_impl", "tensor_reduce", "vector", "stream", 8, ("partial_max",), ("section_max",)),
    Step("_update_max_impl", "tensor_copy", "vector", "stream", 1, ("section_max",), ("running_max",)),
]
PER_GROUP_EXP = [
    Step("_exp_impl", "memset", "gpsimd", "stream", 8, (), ("partial_sum",)),
]
PER_K_TILE_EXP = [  # _exp_impl: exp(s - max) to bf16 with its row sum, then P^T by an SBUF-to-SBUF DMA transpose
    Step("_exp_impl", "activation_reduce", "scalar", "stream", K_TILE, ("masked", "running_max"),
         ("p", "sum_column")),
    Step("_exp_impl", "dma_transpose", "dma", "transpose_on_chip", S_TILE * K_TILE * 2, ("p",), ("p_t",)),
]
PER_V_SUBTILE = [  # _pv_large_tile_impl, every 128-key subtile the causal mask does not skip, into PSUM
    Step("_pv_large_tile_impl", "nc_matmul", "tensor", "matmul", D, ("p_t_block", "v"), ("out_psum",)),
]
PER_FIRST_LARGE_TILE = [  # _pv_large_tile_impl: the first 2048-key tile's PSUM sum copied into SBUF
    Step("_pv_large_tile_impl", "tensor_copy", "vector", "stream", D, ("out_psum",), ("out_sb",)),
]
PER_LARGE_TILE = [  # and each later one's added to it
    Step("_pv_large_tile_impl", "tensor_tensor", "vector", "stream2", D, ("out_psum", "out_sb"), ("out_sb",)),
]
PER_GROUP_END = [  # _write_back_impl, _scale_reciprocal_write_back_impl, _write_back_o_impl
    Step("_write_back_impl", "tensor_reduce", "vector", "stream", 8, ("partial_sum",), ("section_sum",)),
    Step("_write_back_impl", "reciprocal", "vector", "reciprocal", 1, ("section_sum",), ("reciprocal",)),
    Step("_scale_reciprocal_write_back_impl", "activation", "scalar", "stream", D, ("out_sb", "reciprocal"),
         ("out_final",)),
    Step("_write_back_o_impl", "dma_copy", "dma", "copy", S_TILE * D * 2, ("out_final",), ("hbm_o",),
         descriptor=D * 2),
]


def _issue(steps, views: dict):
    for step in steps:
        reads, writes = [views[n] for n in step.reads], [views[n] for n in step.writes]
        if step.engine == "dma":
            trace.record_dma(step.size, reads[0], writes[0], step.descriptor, transpose=step.rule != "copy")
        else:
            trace.record(step.engine, step.rule, step.size, reads=reads, writes=writes,
                        stationary=reads[0] if step.instruction == "nc_matmul" else None)


def _tiles(count, shape, dtype, buffer=nl.sbuf):
    return [nl.ndarray(shape, dtype=dtype, buffer=buffer) for _ in range(count)]


@emulator.jit
def _replay(q, k, v, o):
    """One (batch, head) of attention_cte's causal forward: q, v, o ``[S, D]``, k ``[D, S]``, bf16."""
    s = q.shape[0]
    bf16, f32 = nl.bfloat16, nl.float32
    groups, k_tiles, large_tiles = s // S_TILE, s // K_TILE, -(-s // LARGE_TILE)
    # the kernel's buffers, as many copies as its modular allocation keeps (_allocate_attention_buffers)
    k_sb, v_sb = _tiles(k_tiles, (D, K_TILE), bf16), _tiles(s // S_TILE, (S_TILE, D), bf16)
    q_sb = _tiles(2, (D, S_TILE * Q_GROUPS_PER_LOAD), bf16)
    scores, out_psum = _tiles(4, (S_TILE, K_TILE), f32, nl.psum), _tiles(large_tiles, (S_TILE, D), f32, nl.psum)
    copies = [_tiles(2, (S_TILE, K_TILE), f32) for _ in range(2)]  # mm1_copy_sb, mm1_affine_select_output
    masked = [_tiles(large_tiles, (S_TILE, LARGE_TILE), f32) for _ in range(2)]
    p = _tiles(large_tiles, (S_TILE, LARGE_TILE), bf16)  # exp_sb: one copy across groups
    p_t = [[_tiles(LARGE_TILE // K_TILE, (S_TILE, K_TILE), bf16) for _ in range(large_tiles)] for _ in range(2)]
    partial_max, partial_sum = _tiles(2, (S_TILE, k_tiles), f32), _tiles(2, (S_TILE, k_tiles), f32)
    section_max, section_sum = _tiles(2, (S_TILE, 1), f32), _tiles(2, (S_TILE, 1), f32)
    running_max, reciprocal = _tiles(1, (S_TILE, groups), f32)[0], _tiles(1, (S_TILE, groups), f32)[0]
    out_sb, out_final = _tiles(2, (S_TILE, D), f32), _tiles(2, (S_TILE, D), f32)
    _issue(PER_HEAD, {"zero_bias": _tiles(1, (S_TILE, 1), f32)[0]})
    for j in range(k_tiles):
        _issue(PER_K_TILE_LOAD, {"hbm_k": k[:, j * K_TILE:(j + 1) * K_TILE], "k": k_sb[j]})
    for t in range(s // S_TILE):
        _issue(PER_V_TILE_LOAD, {"hbm_v": v[t * S_TILE:(t + 1) * S_TILE, :], "v": v_sb[t]})

    def group(g):
        return {"partial_max": partial_max[g % 2], "section_max": section_max[g % 2],
                "running_max": running_max[:, g:g + 1], "partial_sum": partial_sum[g % 2],
                "section_sum": section_sum[g % 2], "reciprocal": reciprocal[:, g:g + 1], "out_sb": out_sb[g % 2],
                "out_final": out_final[g % 2], "hbm_o": o[g * S_TILE:(g + 1) * S_TILE, :]}

    def key_tiles(g, large=None):  # the 512-key tiles group g sees (causal), in one 2048-key tile or all
        seen = range((g * S_TILE + S_TILE - 1) // K_TILE + 1)
        return [j for j in seen if large is None or j * K_TILE // LARGE_TILE == large]

    def load_q(g):  # _load_q_impl
        if g % Q_GROUPS_PER_LOAD == 0:
            rows = slice(g * S_TILE, (g + Q_GROUPS_PER_LOAD) * S_TILE)
            _issue(PER_Q_LOAD, {"hbm_q": q[rows, :], "q_block": q_sb[g // Q_GROUPS_PER_LOAD % 2]})

    def qk(g, large):  # _qk_and_max_large_tile_impl
        seen = key_tiles(g)
        for j in key_tiles(g, large):
            first_query, first_key = g % Q_GROUPS_PER_LOAD * S_TILE, j * K_TILE % LARGE_TILE
            tile = dict(group(g), q=q_sb[g // Q_GROUPS_PER_LOAD % 2][:, first_query:first_query + S_TILE],
                        k=k_sb[j], scores=scores[j % 4], scores_copy=copies[0][j % 2],
                        scores_masked=copies[1][j % 2],
                        masked=masked[g % 2][large][:, first_key:first_key + K_TILE],
                        max_column=partial_max[g % 2][:, j:j + 1])
            _issue(PER_K_TILE + (PER_K_TILE_ON_DIAGONAL if j == seen[-1] else PER_K_TILE_OFF_DIAGONAL), tile)

    def exp(g):  # _exp_impl
        _issue(PER_GROUP_EXP, group(g))
        for j in key_tiles(g):
            large, keys = j * K_TILE // LARGE_TILE, slice(j * K_TILE % LARGE_TILE, j * K_TILE % LARGE_TILE + K_TILE)
            _issue(PER_K_TILE_EXP, dict(group(g), masked=masked[g % 2][large][:, keys], p=p[large][:, keys],
                                        sum_column=partial_sum[g % 2][:, j:j + 1],
                                        p_t=p_t[g % 2][large][keys.start // K_TILE]))

    def pv(g, large):  # _pv_large_tile_impl
        subtiles = [t for t in range(g + 1) if t * S_TILE // LARGE_TILE == large]  # 128-key blocks seen
        for t in subtiles:
            first_key = t * S_TILE % LARGE_TILE
            queries = slice(first_key % K_TILE, first_key % K_TILE + S_TILE)  # P^T's block for these keys
            _issue(PER_V_SUBTILE, dict(group(g), p_t_block=p_t[g % 2][large][first_key // K_TILE][:, queries],
                                       v=v_sb[t], out_psum=out_psum[large]))
        if subtiles:
            _issue(PER_LARGE_TILE if large else PER_FIRST_LARGE_TILE, dict(group(g), out_psum=out_psum[large]))

    # _attention_cte_impl's software pipeline: group g's PV beside group g + 2's QK, g + 1's exponentials between
    for g in (0, 1):
        load_q(g)
        _issue(PER_GROUP_START, group(g))
        for large in range(large_tiles):
            qk(g, large)
        _issue(PER_GROUP_MAX, group(g))
        if g == 0:
            exp(g)
    for g in range(groups - 2):
        load_q(g + 2)
        exp(g + 1)
        _issue(PER_GROUP_START, group(g + 2))
        for large in range(large_tiles):
            pv(g, large)
            qk(g + 2, large)
        _issue(PER_GROUP_END, group(g))
        _issue(PER_GROUP_MAX, group(g + 2))
    for g in (groups - 2, groups - 1):
        if g == groups - 1:
            exp(g)
        for large in range(large_tiles):
            pv(g, large)
        _issue(PER_GROUP_END, group(g))
    return o


def estimate(machine: cost.Machine, s: int = 4096, heads: int = 32) -> cost.Estimate:
    """The priced mix for ``heads`` (batch, head) pairs on one NeuronCore: one head's trace, its times times heads."""
    meta = dict(dtype=torch.bfloat16, device="meta")
    with emulator.count_only(), emulator.count_instructions() as stats:
        _replay(torch.empty(s, D, **meta), torch.empty(D, s, **meta), torch.empty(s, D, **meta),
                torch.empty(s, D, **meta))
    one = cost.estimate(stats, machine)
    return cost.Estimate(machine, {e: t * heads for e, t in one.seconds.items()}, one.core_seconds * heads, one.cores)


def main() -> int:
    low, high = HAND_ROOFLINE_MS
    print("attention_cte forward, causal, bf16, B 1, H 32, S 4096, D 128, on one NeuronCore; "
          f"hand roofline {low}-{high} ms")
    for machine in cost.MACHINES:
        est = estimate(machine)
        busy = ", ".join(f"{e} {t * 1e3:.2f}" for e, t in est.seconds.items())
        print(f"{machine.name}: {est.core_seconds * 1e3:.2f} ms, bound {est.bound}; busy ms: {busy}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
