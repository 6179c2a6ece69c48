"""NKI tensors of the emulator (``nl.NkiTensor``): torch storage with an NKI dtype and buffer, views that share it,
the on-chip access rules (partition axis kept, no partition stride), reads in float32 and writes rounded once.

Allocating one (capacity, liveness) is ``allocation.py``'s.
"""

from __future__ import annotations

import torch

from .core import Buffer, DType, counting_only, reject


class Tensor:
    """An NKI tensor (``nl.NkiTensor``): torch storage, an NKI dtype and a buffer. Partition axis
    first on chip. Views (indexing, :meth:`reshape`) share the storage, as NKI's do."""

    def __init__(self, data: torch.Tensor, dtype: DType, buffer: Buffer, root: "Tensor | None" = None):
        self.data, self.dtype, self.buffer = data, dtype, buffer
        self._root = root  # the allocation a view belongs to (None for the allocation itself)
        self.last_writer = None  # on the root: what last wrote it ('matmul' or 'other', for PSUM accumulation)
        self.buffer_id = None  # on an on-chip root while instructions are counted: the buffer it occupies

    @property
    def root(self) -> "Tensor":
        return self._root or self

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    @property
    def ndim(self) -> int:
        return self.data.dim()

    @property
    def size(self) -> int:
        return self.data.numel()

    @property
    def free_size(self) -> int:
        free = 1
        for n in self.shape[1:]:
            free *= n
        return free

    @property
    def partition_bytes(self) -> int:
        return self.free_size * self.dtype.itemsize

    def __getitem__(self, index) -> "Tensor":
        if self.buffer.on_chip:
            index = _keep_partition_axis(index, self.shape[0])
        view = self.data[index]
        if self.buffer.on_chip:
            if view.dim() == 0:
                reject("tile-rank", "an on-chip tile access must keep the partition axis (got a scalar)")
            if view.shape[0] > 1 and view.stride(0) != self.root.data.stride(0):
                # trainium_inferentia2_arch.rst: "hardware does not allow P dimension striding"
                reject("partition-stride", f"{self.buffer.name} access {tuple(view.shape)} steps over partitions; an "
                       "SBUF/PSUM access covers consecutive partitions (no stride on the partition axis)")
        return Tensor(view, self.dtype, self.buffer, self.root)

    @property
    def start_partition(self) -> int:
        """The first partition an on-chip view covers."""
        return (self.data.storage_offset() - self.root.data.storage_offset()) // self.root.data.stride(0)

    def __setitem__(self, key, value):
        reject("tile-assign", "assign through nki.isa instructions (dst=...), not with Python item assignment")

    def reshape(self, shape: tuple[int, ...]) -> "Tensor":
        """NkiTensor.reshape: a view with the same elements; on chip the partition axis is kept."""
        shape = tuple(int(n) for n in shape)
        if self.buffer.on_chip and shape[0] != self.shape[0]:
            reject("tile-shape", f"reshape of an on-chip tile must keep its partition axis: {self.shape} -> {shape}")
        if not self.data.is_contiguous():
            reject("view", f"reshape needs a contiguous view; {self.shape} is strided")
        return Tensor(self.data.view(shape), self.dtype, self.buffer, self.root)

    def ap(self, pattern, offset=None, scalar_offset=None, vector_offset=None, indirect_dim=0, dtype=None):
        """NkiTensor.ap, an explicit ``[[step, num], ...]`` access pattern; emulated for one use, an HBM tensor's
        rows gathered or scattered by a DMA through a per-partition index tile (``emulator/indirect.py``)."""
        from .indirect import IndirectView
        if vector_offset is None or scalar_offset is not None or dtype is not None:
            reject("api-subset", "NkiTensor.ap is emulated with vector_offset= only (no scalar_offset, no dtype)")
        return IndirectView(self, pattern, 0 if offset is None else offset, vector_offset, indirect_dim)

    def __repr__(self) -> str:
        return f"Tensor({self.shape}, {self.dtype}, {self.buffer})"

    # values as float32 (engines compute in fp32) / write with one rounding to the tile's dtype
    def read(self) -> torch.Tensor:
        if counting_only() or not self.dtype.is_float:
            return self.data
        return self.data.to(torch.float32)

    def assign(self, compute):
        """``self = compute()``, rounded once to the tile's dtype; in count-only mode nothing is computed."""
        if counting_only():
            self.root.last_writer = "other"
        else:
            self.write(compute())

    def write(self, value: torch.Tensor):
        if tuple(value.shape) != self.shape:
            value = value.expand(self.shape) if value.dim() <= len(self.shape) else value.reshape(self.shape)
        self.data.copy_(value.to(self.data.dtype))
        self.root.last_writer = "other"


def _keep_partition_axis(index, partitions: int):
    """An integer index on the partition axis keeps it, at size 1 (NKI language guide, 'The partition dimension
    is special')."""
    first, rest = (index[0], index[1:]) if isinstance(index, tuple) else (index, ())
    if isinstance(first, int) and -partitions <= first < partitions:  # out of range: torch's IndexError
        first = slice(first % partitions, first % partitions + 1)
    return (first, *rest)

