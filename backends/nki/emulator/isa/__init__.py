"""Emulated ``nki.isa`` (``import nki.isa as nisa``): the instructions this project's kernels use.

Each instruction has the signature AWS publishes (``backends/nki/aws_signatures.py``, checked by
tests/test_nki_api.py), checks the operand rules its reference page states, computes in float32
(as the engines do) and writes ``dst`` with one rounding to its dtype. It also records itself for
the cost model (``cost.py``): the engine it runs on and the rule that prices it. Semantics and
rules are from aws-neuron/aws-neuron-sdk ``nki/api/nki/isa/__init__.py`` (the API reference
source) unless a line says otherwise; tests/test_nki_aws_examples.py ports AWS's own examples.

A module per instruction family: ``data_movement.py`` (DMA, on-chip copies, memset), ``elementwise.py``
(arithmetic, activation, reciprocal), ``affine.py`` (affine_select, iota), ``reductions.py``, ``matmul.py``
(the Tensor Engine); ``enums.py`` holds the enumerations and ``operands.py`` the checks they share.
"""

from .affine import affine_select, iota
from .data_movement import dma_copy, dma_transpose, memset, tensor_copy, tensor_copy_predicated
from .elementwise import (ACTIVATION_DOMAINS, RSQRT_DOMAIN, activation, reciprocal, scalar_tensor_tensor, tensor_scalar,
                          tensor_scalar_reduce, tensor_tensor)
from .enums import (dge_mode, engine, gpsimd_engine, matmul_perf_mode, oob_mode, reduce_cmd, scalar_engine,
                    tensor_engine, unknown_engine, vector_engine)
from .matmul import nc_matmul, nc_transpose
from .reductions import tensor_partition_reduce, tensor_reduce

__all__ = ["ACTIVATION_DOMAINS", "RSQRT_DOMAIN", "activation", "affine_select", "dge_mode", "dma_copy", "dma_transpose",
           "engine", "gpsimd_engine", "iota", "matmul_perf_mode", "memset", "nc_matmul", "nc_transpose", "oob_mode",
           "reciprocal", "reduce_cmd", "scalar_engine", "scalar_tensor_tensor", "tensor_copy", "tensor_copy_predicated",
           "tensor_engine", "tensor_partition_reduce", "tensor_reduce", "tensor_scalar", "tensor_scalar_reduce",
           "tensor_tensor", "unknown_engine", "vector_engine"]
