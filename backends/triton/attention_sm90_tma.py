"""What both Gluon attention kernels for Hopper build on: TMA copies (under the names of each Triton release
read), the shared-memory ring that a loader warp fills and the consumers drain, and the layout of a warpgroup
MMA's accumulator."""

from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

# Triton 3.6 names TMA copies async_copy_*; later releases async_load/async_store and refuse the old names.
tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
tma_store = tma.async_store if hasattr(tma, "async_store") else tma.async_copy_shared_to_global
if hasattr(tma, "async_atomic_add"):
    tma_add = tma.async_atomic_add
else:  # Triton 3.6 builds TMA reduce-adds but has no Gluon function for them
    @builtin
    def tma_add(tensor_desc, coord, src, _semantic=None):
        coord = _semantic._convert_to_ir_values(coord, require_i64=False)
        _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord,
                                                  src.handle)


@gluon.constexpr_function
def mma_layout(n):
    """The accumulator layout of a warpgroup MMA (4 warps) whose tiles are ``n`` columns wide."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16])


@gluon.jit
def fill_slot(a_desc, b_desc, a_smem, b_smem, ready, empty, i, coord):
    """The ring's ``i``-th load: once its slot is free, ``a`` and ``b`` at ``coord`` into it. Returns the slot."""
    STAGES: gl.constexpr = a_smem.shape[0]
    slot = i % STAGES
    # a fresh barrier counts as having completed the phase before its first: the first pass does not wait
    mbarrier.wait(empty.index(slot), ((i // STAGES) & 1) ^ 1)
    mbarrier.expect(ready.index(slot), a_desc.block_type.nbytes + b_desc.block_type.nbytes)
    tma_load(a_desc, coord, ready.index(slot), a_smem.index(slot))
    tma_load(b_desc, coord, ready.index(slot), b_smem.index(slot))
    return slot


@gluon.jit
def slot_matrix(smem, i, BLOCK: gl.constexpr, D: gl.constexpr):
    """Slot ``i`` of a ring of [1, 1, BLOCK, D] TMA tiles, as the [BLOCK, D] matrix the MMAs take."""
    return smem.index(i).reshape([BLOCK, D])
