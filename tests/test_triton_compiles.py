"""The triton kernels compile for Hopper (sm_90) on a machine with no GPU.

Triton ships ptxas, so ``triton.compile`` can target a GPU that isn't there. This catches in CI
the errors the interpreter never meets: front-end and lowering errors of the compiled path (a
non-constexpr global read in a kernel, a layout the compiler rejects). Kernels that compile can
still exceed a real GPU's registers or shared memory: only a GPU run checks that. It runs in a fresh process: in this one, TRITON_INTERPRET=1
has already turned every kernel into an interpreted function.
"""

import pathlib
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")

BACKEND_DIR = pathlib.Path(__file__).resolve().parents[1] / "backends" / "triton"

SCRIPT = r'''
import os, sys, types, importlib
os.environ.pop("TRITON_INTERPRET", None)
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget

# Load the kernel modules alone, with the interpreter flag off, without importing portable_ops.
pkg = types.ModuleType("kernels"); pkg.__path__ = [sys.argv[1]]; sys.modules["kernels"] = pkg
flag = types.ModuleType("kernels.interpreter"); flag.INTERPRETED = False; sys.modules["kernels.interpreter"] = flag
attention = importlib.import_module("kernels.attention")
adam = importlib.import_module("kernels.adam")
SM90 = GPUTarget("cuda", 90, 32)


def compile_(kernel, types_, consts, warps):
    signature = dict(types_, **{name: "constexpr" for name in consts})
    assert list(signature) == list(kernel.arg_names), (list(signature), kernel.arg_names)
    source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=consts)
    binary = triton.compile(source, target=SM90, options={"num_warps": warps, "num_stages": 3})
    print(kernel.__name__, {k: str(v) for k, v in consts.items()}, len(binary.asm["cubin"]))


attn_types = {name: "*bf16" for name in ("Q", "K", "V", "O")}
attn_types["LSE"] = "*fp32"
attn_types.update({name: "i32" for name in ("sq_b", "sq_h", "sq_m", "sk_b", "sk_h", "sk_n", "sv_b", "sv_h", "sv_n",
                                             "H", "GROUP", "SQ", "SKV")})
attn_types.update(scale_log2="fp32", KEYS_PER_SPLIT="i32")
for pack, causal, (block_m, block_n, warps, _) in [(False, True, attention.CONFIGS["fwd"][128][0]),
                                                  (True, True, attention._DECODE_CONFIG[False])]:
    compile_(attention._fwd_kernel, attn_types, dict(CAUSAL=causal, D=128, BLOCK_M=block_m, BLOCK_N=block_n,
                                                     UPCAST=False, PACK_GROUP=pack), warps)

adam_types = {"addresses": "*i64", "chunk_tensor": "*i32", "chunk_start": "*i64", "numels": "*i64",
              "n_tensors": "i32", "step_addresses": "*i64", "lr_ptr": "*fp32", "lr_value": "fp32",
              "grad_scale_ptr": "*fp32", "found_inf_ptr": "*fp32", "clip_coef_ptr": "*fp32"}
adam_types.update({name: "fp32" for name in ("beta1", "beta2", "log2_beta1", "log2_beta2", "eps", "weight_decay")})
for dtype, state_dtype in [(tl.bfloat16, tl.bfloat16), (tl.bfloat16, tl.float32), (tl.float16, tl.float32)]:
    compile_(adam._adam_kernel, adam_types, dict(DTYPE=dtype, STATE_DTYPE=state_dtype, CHUNK=4096, BLOCK=2048,
             AMSGRAD=True, MAXIMIZE=False, WEIGHT_DECAY=True, DECOUPLED=True, LR_IS_TENSOR=True,
             HAS_GRAD_SCALE=True, HAS_FOUND_INF=True, HAS_CLIP=True, ALIGNED=True), 8)
'''


def test_forward_attention_and_adam_kernels_compile_for_sm90():
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(BACKEND_DIR)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    compiled = [line for line in done.stdout.splitlines() if line.split(" ")[0] in ("_fwd_kernel", "_adam_kernel")]
    assert len(compiled) == 5, done.stdout
