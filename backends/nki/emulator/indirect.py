"""Vector-indirect DMA access (``NkiTensor.ap(pattern, vector_offset=index, indirect_dim=d)``): a gather or a scatter
of an HBM tensor's rows, one row per partition, the rows named by an SBUF index tile.

AWS's ``nki.isa.dma_copy`` reference (aws-neuron-sdk@81ce03a, ``nki/api/nki/isa/__init__.py``, 'Indirect addressing
(gather/scatter)'): "Vector indirection provides per-partition dynamic offsets ... ``idx_tensor`` is an SBUF tensor of
shape ``(P, 1)`` containing one row index per partition. The tensor being indexed (the one ``.ap()`` is called on)
must be in HBM"; a gather is descriptor generation by the GpSimd engine ("When sw_dge is selected, nisa.dma_copy can
also perform a gather or scatter"); out-of-bound indices raise, or with ``oob_mode.skip`` their rows are not moved.
``NkiTensor.ap``'s own reference: ``indirect_dim`` is the "dimension in ``self.shape`` whose stride scales the
indirect ... vector offset". The emulated subset: the partition step of ``pattern`` is that stride (as in AWS's
examples, ``data.ap(pattern=[[F, P], [1, F]], vector_offset=idx, indirect_dim=0)``), so partition ``p`` addresses
row ``index[p]`` and the rest of the pattern runs within it.
"""

from __future__ import annotations

import torch

from . import core
from .tensors import Tensor

INDEX_DTYPES = ("int32", "uint32")


class IndirectView(Tensor):
    """``base.ap(pattern, offset, vector_offset=index, indirect_dim=dim)``: what ``dma_copy`` gathers from or
    scatters to. Its ``data`` has the pattern's shape and steps with rows ``0..P-1``, for shapes and descriptor
    sizes; the values go through :meth:`gather` and :meth:`scatter`."""

    def __init__(self, base: Tensor, pattern, offset: int, index, dim: int):
        if base.buffer.on_chip:
            core.reject("api-subset", "NkiTensor.ap(vector_offset=...) indexes an HBM tensor (dma_copy reference: "
                        "'The tensor being indexed ... must be in HBM')")
        if not (isinstance(pattern, (list, tuple)) and pattern and all(
                isinstance(p, (list, tuple)) and len(p) == 2 and all(isinstance(n, int) for n in p) for p in pattern)):
            core.reject("access-pattern", f"NkiTensor.ap: pattern must be a list of [step, num] pairs; got {pattern!r}")
        if not 0 <= dim < base.ndim:
            core.reject("access-pattern", f"NkiTensor.ap: indirect_dim {dim} is not an axis of {base.shape}")
        steps, counts = [p[0] for p in pattern], [p[1] for p in pattern]
        if any(n < 1 for n in counts) or any(s < 0 for s in steps):
            core.reject("access-pattern", f"NkiTensor.ap: pattern {pattern!r} needs counts >= 1 and steps >= 0")
        row_stride = base.data.stride(dim)
        if steps[0] != row_stride:
            core.reject("api-subset", f"NkiTensor.ap(vector_offset=...): the pattern's partition step {steps[0]} must "
                        f"be the stride of axis {dim} ({row_stride}), which scales each partition's index")
        if not isinstance(index, Tensor) or index.buffer is not core.sbuf or index.shape != (counts[0], 1):
            core.reject("indirect-index", f"NkiTensor.ap: vector_offset must be an SBUF tile of shape "
                        f"({counts[0]}, 1), one index per partition; got {index!r}")
        if index.dtype.name not in INDEX_DTYPES:
            core.reject("indirect-index", f"NkiTensor.ap: vector_offset holds int32/uint32 indices, not {index.dtype}")
        start = base.data.storage_offset() + offset
        layout = torch.empty_strided(counts, steps, dtype=base.data.dtype, device=core.device())
        super().__init__(layout, base.dtype, base.buffer)
        self.base, self.index, self.rows, self.row_stride, self.start = base, index, base.shape[dim], row_stride, start

    def __getitem__(self, index):
        core.reject("api-subset", "index the tensor before .ap(...), not the indirect view")

    def reshape(self, shape):
        core.reject("api-subset", "reshape the tensor before .ap(...), not the indirect view")

    def _addresses(self) -> torch.Tensor:
        """Flat storage offsets of every element, ``[P, ...]``, with each partition's row from the index tile."""
        shape, steps = self.data.shape, self.data.stride()
        inner = torch.zeros(shape[1:], dtype=torch.int64)
        for axis, (n, step) in enumerate(zip(shape[1:], steps[1:])):
            along = [1] * (len(shape) - 1)
            along[axis] = n
            inner = inner + torch.arange(n).view(along) * step
        rows = self.index.data.reshape(-1, *([1] * (len(shape) - 1))).to(torch.int64)
        return self.start + rows * self.row_stride + inner

    def _storage(self) -> torch.Tensor:
        data = self.base.data
        return data.as_strided((data.untyped_storage().nbytes() // data.element_size(),), (1,), 0)

    def in_bounds(self, oob) -> torch.Tensor:
        """``[P]`` bool: the partitions whose row exists and whose pattern stays inside the indexed tensor; any other is
        refused unless ``oob`` is skip."""
        rows = self.index.data.reshape(-1).to(torch.int64)
        data = self.base.data
        end = data.storage_offset() + sum((n - 1) * step for n, step in zip(data.shape, data.stride())) + 1
        last = self.start + rows * self.row_stride + sum((n - 1) * step for n, step in zip(self.data.shape[1:],
                                                                                           self.data.stride()[1:]))
        inside = (rows >= 0) & (rows < self.rows) & (last < end)
        if oob.name == "error" and not bool(inside.all()):
            p = int((~inside).nonzero()[0])
            core.reject("dma-oob", f"dma_copy: partition {p}'s index {int(rows[p])} addresses past the indexed "
                        f"tensor {self.base.shape} (oob_mode.error; oob_mode.skip leaves such rows unmoved)")
        return inside

    def gather(self) -> torch.Tensor:
        return self._storage()[self._addresses().clamp(0, self._storage().numel() - 1)]

    def scatter(self, values: torch.Tensor, inside: torch.Tensor):
        self._storage()[self._addresses()[inside]] = values.reshape(self.shape)[inside].to(self.base.data.dtype)


def copy(dst: Tensor, src: Tensor, oob, dge) -> None:
    """``dma_copy``'s values where ``dst`` or ``src`` is an :class:`IndirectView` (checked like any DMA before)."""
    if isinstance(dst, IndirectView) and isinstance(src, IndirectView):
        core.reject("api-subset", "dma_copy: only one of dst and src may be indirect")
    if dge.name in ("hwdge", "none"):
        core.reject("indirect-dge", f"dma_copy(dge_mode={dge.name}): a gather or scatter needs software descriptor "
                    "generation (dge_mode.swdge, or unknown for the compiler to choose it)")
    view = dst if isinstance(dst, IndirectView) else src
    core.launch.access(view.base, dst is view)
    if core.device().type == "meta":
        dst.assign(lambda: None)
        return
    inside = view.in_bounds(oob)
    if view is src:
        keep = inside.view(-1, *([1] * (dst.data.dim() - 1)))
        dst.write(torch.where(keep, src.gather().reshape(dst.shape), dst.data))
    else:
        view.scatter(src.data, inside)
