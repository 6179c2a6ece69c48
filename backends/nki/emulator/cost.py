"""Cost model: time on a NeuronCore from the emulator's counts (:class:`core.Stats`).

An estimate from documented rates, not a measurement and not a simulation of the pipeline:

* compute engines: each instruction costs ``max(MIN_II, factor * N)`` engine cycles, ``N`` its
  free elements per partition, ``MIN_II`` ~64 cycles. ``factor`` by rule: one input tile streams
  in ~N cycles, two in ~2N (trainium_inferentia2_arch.rst, Vector Engine 'Cost Model'; Scalar and
  GpSimd the same per input tile); VectorE's BF16/FP16 performance mode 4x / 2x
  (trainium2_arch.rst); ``nisa.reciprocal`` on VectorE ``8*N`` (nki.api.shared.rst, 'NKI Engine
  Selection'); the activation accumulator read-out ~64 cycles ('ActReadAccumulator'); a matmul
  ``max(64, N)`` TensorE cycles for N moving columns, 4x for fp32 inputs (trainium_inferentia2_arch.rst,
  TensorE 'Cost Model'), a transpose a matmul against an identity with N = the input's
  partitions, 2x for fp32 (trainium2_arch.rst, transpose mode: '2x speedup in FP32 transpose').
* DMA: bytes over the NeuronCore's share of bandwidth (the smaller of its 16 DMA engines'
  aggregate, nki-dma-bandwidth-guide.rst, and the chip's HBM bandwidth over its 8 NeuronCores),
  plus a fixed ~1.3 us per transfer (descriptor setup and semaphore latency, same guide) spread
  over the 16 DMA queues.
* Engines and DMA queues overlap perfectly: the estimate is the busiest one. A lower bound in that
  respect (dependencies, SBUF-port contention and imperfect pipelining only add), an upper bound
  in charging MIN_II to every instruction (engines hide some of it).

Clock rates and widths: trainium2_arch.rst / trainium3_arch.rst 'Compute Engine Specifications';
HBM per chip: about-neuron/arch/neuron-hardware/trainium2.rst (2.9 TB/s) and trainium3.rst
(4.9 TB/s); all in github.com/aws-neuron/aws-neuron-sdk.
"""

from __future__ import annotations

from dataclasses import dataclass

from .core import ENGINES, Stats

MIN_II = 64
FACTOR = {"stream": 1.0, "stream2": 2.0, "perf2": 0.5, "perf4": 0.25, "reciprocal": 8.0, "accumulator_read": 0.0,
          "matmul": 1.0, "matmul_fp32": 4.0, "transpose": 1.0, "transpose_fp32": 2.0}


@dataclass(frozen=True)
class Machine:
    name: str
    cores: int  # NeuronCores per chip
    hbm_bytes_per_s: float  # per chip
    dma_bytes_per_s: float  # per NeuronCore: 16 DMA engines
    hz: dict  # engine -> clock
    tensor_flops_bf16: float  # per NeuronCore, dense
    dma_fixed_s: float = 1.3e-6
    dma_queues: int = 16

    @property
    def core_bytes_per_s(self) -> float:
        return min(self.dma_bytes_per_s, self.hbm_bytes_per_s / self.cores)


TRN2 = Machine("Trn2", cores=8, hbm_bytes_per_s=2.9e12, dma_bytes_per_s=16 * 23e9,
               hz={"tensor": 2.4e9, "vector": 0.96e9, "scalar": 1.2e9, "gpsimd": 1.2e9}, tensor_flops_bf16=79e12)
TRN3 = Machine("Trn3", cores=8, hbm_bytes_per_s=4.9e12, dma_bytes_per_s=16 * 33e9,
               hz={"tensor": 2.4e9, "vector": 1.2e9, "scalar": 1.2e9, "gpsimd": 1.2e9}, tensor_flops_bf16=79e12)
MACHINES = (TRN2, TRN3)


@dataclass
class Estimate:
    machine: Machine
    seconds: dict  # engine -> seconds on one NeuronCore

    @property
    def core_seconds(self) -> float:
        return max(self.seconds.values())

    @property
    def bound(self) -> str:
        return max(self.seconds, key=self.seconds.get)

    @property
    def chip_seconds(self) -> float:
        """The counted work split evenly over the chip's NeuronCores."""
        return self.core_seconds / self.machine.cores


def estimate(stats: Stats, machine: Machine) -> Estimate:
    cycles = dict.fromkeys(ENGINES, 0.0)
    dma = 0.0
    for (engine, rule, size), count in stats.work.items():
        if engine == "dma":
            dma += count * (size / machine.core_bytes_per_s + machine.dma_fixed_s / machine.dma_queues)
        else:
            cycles[engine] += count * max(MIN_II, FACTOR[rule] * size)
    seconds = {e: cycles[e] / machine.hz[e] for e in ENGINES if e != "dma"}
    seconds["dma"] = dma
    return Estimate(machine, seconds)
