"""Cost model: a kernel's time on its NeuronCores, from the instructions the emulator traced (:class:`trace.Stats`).

An estimate from AWS's documented rates and a schedule of the trace, not a measurement:

* **Each instruction's engine time.** A compute instruction streams its ``N`` free elements per partition in
  ``max(MIN_II, factor * N)`` engine cycles, ``factor`` by rule (``FACTOR``). A DMA moves its bytes at the
  NeuronCore's share of bandwidth times an efficiency that falls with its bytes per descriptor
  (``DMA_EFFICIENCY``); a DMA transpose at a fixed fraction of it (``DMA_TRANSPOSE_EFFICIENCY``).
* **The schedule.** Instructions are placed in program order, each at the first moment its engine is idle long
  enough (the compiler's scheduler reorders independent instructions: nki/guides/how-to-scheduling-apis.rst) and
  the instructions it depends on through on-chip tiles allow: what wrote a region it reads, plus
  ``RESULT_LATENCY`` cycles before the result is readable; what read or wrote a region it writes. A matmul's
  stationary operand is loaded (``stationary free size / FAST_LOAD_STATIONARY`` cycles) after it is written,
  behind the previous matmul if it is ready (background LoadStationary). The DMA queues of a core are one pool of
  bandwidth; a transfer starts ``DMA_LATENCY_S`` after what it waits on. A launch starts when the previous one
  has ended.
* **What earns overlap.** Engines overlap where tiles let them: a dead tile's buffer is reused only when SBUF
  (PSUM) needs the space (:class:`allocation._Memory`), so a tile declared inside a loop gets several copies and its
  iterations overlap (multi-buffering), while a tile declared outside and rewritten every iteration serialises
  them (nki/migration/index.rst, 'Removing block dimensions').
* **Per NeuronCore.** The time is the schedule's length on the launch's cores: a launch on two cores (LNC=2) runs
  them side by side, each with its own engines and DMA queues, each core's DMA at its share of the chip's HBM.

What it leaves out: limits on how far the compiler reorders (it may keep fewer copies than fit), SBUF-port
contention between engines, dependencies through HBM, the partitions a DMA spans, DGE descriptor generation,
spills, and launch overhead. Each constant names its source: a path in github.com/aws-neuron/aws-neuron-sdk (NKI
0.7 / SDK 2.33 docs), ARCH standing for its nki/guides/architecture/.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from .trace import ENGINES, Instruction, Stats

MIN_II = 64  # nki/api/nki.api.shared.rst, 'NKI Engine Selection': the minimum initiation interval, cycles
RESULT_LATENCY = 264 - MIN_II  # nki/deep-dives/nki_perf_guide.rst, Opt #5: dependent one-element ops 264 cycles apart
FAST_LOAD_STATIONARY = 4  # ARCH trainium_inferentia2_arch.rst, 'Fast LoadStationary': up to 4x a MultiplyMoving
FACTOR = {  # engine cycles per free element per partition, by cost rule
    "stream": 1.0,  # one input tile: ARCH trainium_inferentia2_arch.rst, Vector Engine 'Cost Model'
    "stream2": 2.0,  # two input tiles: the same
    "perf2": 0.5,  # VectorE BF16/FP16 2x mode: ARCH trainium2_arch.rst, 'Vector Engine Performance Mode'
    "perf4": 0.25,  # its 4x mode: the same
    "reciprocal": 8.0,  # nisa.reciprocal on VectorE: nki/api/nki.api.shared.rst, 'NKI Engine Selection'
    "accumulator_read": 0.0,  # the minimum: ARCH trainium_inferentia2_arch.rst, 'ActReadAccumulator'
    "scalar_perf2": 1.0,  # ScalarE BF16 tensor_scalar/copy; 2x on Trn3 (Machine.factors): ARCH trainium3_arch.rst
    "matmul": 1.0,  # N moving columns: ARCH trainium_inferentia2_arch.rst, TensorE 'Cost Model'
    "matmul_fp32": 4.0,  # the same
    "transpose": 1.0,  # a matmul against an identity: ARCH trainium2_arch.rst, 'Built-in Transpose Support'
    "transpose_fp32": 2.0,  # transpose mode's 2x for FP32: the same
}
DMA_LATENCY_S = 1.3e-6  # nki/deep-dives/nki-dma-bandwidth-guide.rst: setup and semaphore-to-start per transfer
# (bytes per partition, throughput over peak): AWS's figure in nki/get-started/about/nki-dma-overview.rst, read
# relative to its 32 KiB point (the y axis is unlabelled); one generation's, used for Trn2 and Trn3
DMA_EFFICIENCY = ((32, 0.014), (64, 0.029), (128, 0.053), (256, 0.105), (512, 0.209), (1024, 0.423),
                  (2048, 0.815), (4096, 0.964), (8192, 0.983), (16384, 0.990), (32768, 1.0))
# ARCH trainium2_arch.rst, 'DMA Transpose' (Trn2's; Trn3's guide gives none)
DMA_TRANSPOSE_EFFICIENCY = {"transpose_from_hbm": 0.9, "transpose_on_chip": 0.5}
_GAPS_KEPT = 32  # idle stretches of an engine a later-ready instruction may still fill


@dataclass(frozen=True)
class Machine:
    name: str
    cores: int  # NeuronCores per chip, sharing its HBM
    hbm_bytes_per_s: float  # per chip
    dma_bytes_per_s: float  # per NeuronCore: its 16 DMA engines
    hz: dict  # engine -> clock
    tensor_flops_bf16: float  # per NeuronCore, dense
    factors: dict = field(default_factory=dict)  # rules this NeuronCore prices unlike FACTOR
    background_transpose: bool = False  # TensorE transposes beside matmuls: ARCH trainium3_arch.rst

    @property
    def core_bytes_per_s(self) -> float:
        """One NeuronCore's DMA bandwidth while every core of the chip moves data."""
        return min(self.dma_bytes_per_s, self.hbm_bytes_per_s / self.cores)


# clocks, TFLOP/s: ARCH trainium2_arch.rst; HBM: about-neuron/arch/neuron-hardware/trainium2.rst; DMA: bandwidth guide
TRN2 = Machine("Trn2", cores=8, hbm_bytes_per_s=2.9e12, dma_bytes_per_s=16 * 23e9,
               hz={"tensor": 2.4e9, "vector": 0.96e9, "scalar": 1.2e9, "gpsimd": 1.2e9}, tensor_flops_bf16=79e12)
# ARCH trainium3_arch.rst; HBM: about-neuron/arch/neuron-hardware/trainium3.rst (the NKI guide: 4.7); DMA: the same
TRN3 = Machine("Trn3", cores=8, hbm_bytes_per_s=4.9e12, dma_bytes_per_s=16 * 33e9,
               hz={"tensor": 2.4e9, "vector": 1.2e9, "scalar": 1.2e9, "gpsimd": 1.2e9}, tensor_flops_bf16=79e12,
               factors={"scalar_perf2": 0.5}, background_transpose=True)
MACHINES = (TRN2, TRN3)


@dataclass
class Estimate:
    machine: Machine
    seconds: dict  # engine -> seconds it is busy, on the busiest core
    core_seconds: float  # the schedule's length: the launches' time on their NeuronCores
    cores: int  # the most NeuronCores one launch ran on

    @property
    def bound(self) -> str:
        """The busiest engine (or the DMA queues)."""
        return max(self.seconds, key=self.seconds.get)


def dma_efficiency(descriptor_bytes: int) -> float:
    """Throughput over peak for descriptors of ``descriptor_bytes``: ``DMA_EFFICIENCY`` interpolated; below its
    first point a descriptor costs as much as one of that size."""
    points = DMA_EFFICIENCY
    if descriptor_bytes <= points[0][0]:
        return points[0][1] * max(descriptor_bytes, 1) / points[0][0]
    for (b0, e0), (b1, e1) in zip(points, points[1:]):
        if descriptor_bytes <= b1:
            return e0 + (e1 - e0) * (descriptor_bytes - b0) / (b1 - b0)
    return 1.0


def engine_seconds(instruction: Instruction, machine: Machine) -> float:
    """How long ``instruction`` keeps its engine (or the DMA pool) busy."""
    if instruction.engine == "dma":
        efficiency = DMA_TRANSPOSE_EFFICIENCY.get(instruction.rule) or dma_efficiency(instruction.detail)
        return instruction.size / (machine.core_bytes_per_s * efficiency)
    cycles = max(MIN_II, _factor(instruction.rule, machine) * instruction.size)
    return cycles / machine.hz[instruction.engine]


def _factor(rule: str, machine: Machine) -> float:
    return machine.factors.get(rule, FACTOR[rule])


class _Timeline:
    """When one engine (or a core's DMA pool) is busy. An instruction goes in program order into the first idle
    stretch long enough at or after the moment it may start: the compiler's scheduler reorders independent
    instructions ('How to Use the NKI Scheduling APIs'). A transfer on the DMA pool instead takes every idle
    moment from then on until it has moved its bytes (many transfers share the queues' bandwidth). Only the last
    ``_GAPS_KEPT`` idle stretches are remembered (a bound on the search, which can only lengthen the estimate)."""

    def __init__(self, at: float, shared: bool):
        self.starts, self.ends, self.tail, self.shared = [], [], at, shared  # idle stretches; idle from tail on

    def place(self, earliest: float, seconds: float) -> float:
        """Book ``seconds`` of this engine from ``earliest`` on; when it is done."""
        first = bisect.bisect_right(self.ends, earliest)
        idle, left, done = [], seconds, None
        for start, end in zip(self.starts[first:], self.ends[first:]):
            begin = max(start, earliest)
            take = min(end - begin, left) if left > 0 and (end - begin >= left or self.shared) else 0.0
            idle += [(a, b) for a, b in ((start, begin), (begin + take, end)) if b > a] if take else [(start, end)]
            if take:
                left, done = left - take, begin + take
        if left > 0:
            begin = max(self.tail, earliest)
            idle += [(self.tail, begin)] if begin > self.tail else []
            self.tail = done = begin + left
        self.starts[first:], self.ends[first:] = [a for a, _ in idle], [b for _, b in idle]
        del self.starts[:-_GAPS_KEPT], self.ends[:-_GAPS_KEPT]
        return done


def estimate(stats: Stats, machine: Machine) -> Estimate:
    """Schedule ``stats.trace`` on ``machine`` (the module doc's rules)."""
    timelines, busy = {}, {}
    ends, ready = [], []
    barrier = latest = 0.0
    starts = set(stats.launch_starts)
    for index, ins in enumerate(stats.trace):
        if index in starts:
            barrier, timelines = latest, {}
        seconds = engine_seconds(ins, machine)
        waits = max([barrier, *(ready[j] for j in ins.needs), *(ends[j] for j in ins.after)])
        if ins.stationary:
            load = _factor(ins.rule, machine) * ins.detail / FAST_LOAD_STATIONARY / machine.hz["tensor"]
            waits = max(waits, *(ready[j] + load for j in ins.stationary))
        if ins.engine == "dma":
            waits, latency = waits + DMA_LATENCY_S, 0.0
        else:
            latency = RESULT_LATENCY / machine.hz[ins.engine]
        transposing = machine.background_transpose and ins.rule.startswith("transpose")
        queue = (ins.core, "tensor transpose" if transposing else ins.engine)
        if queue not in timelines:
            timelines[queue] = _Timeline(barrier, shared=ins.engine == "dma")
        end = timelines[queue].place(waits, seconds)
        ends.append(end)
        ready.append(end + latency)
        busy[(ins.core, ins.engine)] = busy.get((ins.core, ins.engine), 0.0) + seconds
        latest = max(latest, end)
    seconds = {e: max((s for (_, engine), s in busy.items() if engine == e), default=0.0) for e in ENGINES}
    return Estimate(machine, seconds, latest, max(stats.cores, 1))
