"""The triton kernels compile for Hopper (sm_90) on a machine with no GPU, within its registers and
shared memory.

Triton ships ptxas, so ``triton.compile`` can target a GPU that isn't there. This catches in CI
the errors the interpreter never meets: front-end and lowering errors of the compiled path (a
non-constexpr global read in a kernel, a layout the compiler rejects), and, from the compiled
binary, register spills and shared memory past an H100's 227 KB per block. What it can't see is
speed: only a GPU run measures that. The compilation runs in a fresh process: in this one,
TRITON_INTERPRET=1 has already turned every kernel into an interpreted function.

Run as a script it prints the resources of every tile candidate at every tile width, the table in
docs/backends/triton.md: ``python tests/test_triton_compiles.py --table``.
"""

import contextlib
import json
import pathlib
import subprocess
import sys

BACKEND_DIR = pathlib.Path(__file__).resolve().parents[1] / "backends" / "triton"
SHARED_LIMIT = 227 * 1024  # bytes of shared memory one block may have on an H100


def _kernel_module(name: str, backend_dir: str):
    """backends/triton/``name``.py loaded alone, without portable_ops (which would switch the interpreter on)."""
    import importlib
    import os
    import types

    os.environ.pop("TRITON_INTERPRET", None)
    if "kernels" not in sys.modules:
        pkg = types.ModuleType("kernels")
        pkg.__path__ = [backend_dir]
        sys.modules["kernels"] = pkg
        # portable_ops' plain modules (env, read by the launch checks) load from its directory
        po = types.ModuleType("portable_ops")
        po.__path__ = [str(pathlib.Path(backend_dir).parents[1] / "portable_ops")]
        sys.modules["portable_ops"] = po
    return importlib.import_module(f"kernels.{name}")


def _compile(specs: list[dict], backend_dir: str) -> list[dict]:
    """Compile each spec for sm_90 (kernels loaded alone, interpreter off); its resources, or its error."""
    import re
    import tempfile

    (configs, fwd_kernels, bwd_kernels, attention_sm90, sm90_fwd, sm90_bwd, adam, grad_norm, norms, rope,
     cross_entropy) = (_kernel_module(name, backend_dir) for name in (
        "attention_configs", "attention_fwd_kernels", "attention_bwd_kernels", "attention_sm90",
        "attention_sm90_fwd_kernels", "attention_sm90_bwd_kernels", "adam", "grad_norm", "norms", "rope",
        "linear_cross_entropy"))
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget

    assert not configs.INTERPRETED
    dtypes = {"bf16": tl.bfloat16, "fp16": tl.float16, "fp32": tl.float32}
    sm90 = GPUTarget("cuda", 90, 32)

    def strides(*names):
        return {f"s{n}_{axis}": "i32" for n in names for axis in ("b", "h", "m")}

    def run(kernel, types_, consts, warps, stages, aligned, source_type=triton.compiler.ASTSource, **options):
        signature = dict(types_, **{name: "constexpr" for name in consts})
        assert sorted(signature) == sorted(kernel.arg_names), (sorted(signature), kernel.arg_names)
        signature = {name: signature[name] for name in kernel.arg_names}
        # what a launch on aligned tensors specialises: pointers, and strides that are multiples of 16
        attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names)
                 if signature[name].startswith("*") or (aligned and name.startswith("s") and "_" in name)}
        source = source_type(kernel, signature, consts, attrs)
        binary = triton.compile(source, target=sm90, options={"num_warps": warps, "num_stages": stages, **options})
        # registers, and the stack frame a thread needs, read from the cubin: ptxas puts spilled registers
        # there (our kernels call nothing and keep no local arrays). Not the LOCAL field, which stays 0 when
        # a kernel spills (the D 128 Hopper backward: STACK 64 and 28 spill stores, LOCAL 0).
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(binary.asm["cubin"])
            f.flush()
            usage = subprocess.run([triton.knobs.nvidia.cuobjdump.path, "-res-usage", f.name], capture_output=True,
                                   text=True, check=True).stdout
        regs, local = (int(re.search(rf"{field}:(\d+)", usage).group(1)) for field in ("REG", "STACK"))
        # 2-byte global loads: what a row whose alignment the compiler can't see costs every load
        # maxima that must keep a NaN compile to PTX max.NaN; the plain max returns the other operand
        return {"regs": regs, "spills": local, "shared": binary.metadata.shared,
                "scalar_loads": binary.asm["ptx"].count("ld.global.b16"), "nan_max": "max.NaN.f32" in binary.asm["ptx"],
                "mma": binary.asm["ptx"].count("wgmma.mma_async") + binary.asm["ptx"].count("mma.sync"),
                "tma": binary.asm["ptx"].count("cp.async.bulk.tensor"), "setmaxnreg": "setmaxnreg" in binary.asm["ptx"],
                "tma_reduce": binary.asm["ptx"].count("cp.reduce.async.bulk.tensor"),
                "atomics": len(re.findall(r"^\s*(?:@!?%p\d+\s+)?(?:atom|red)\.", binary.asm["ptx"], re.M))}

    def attention_types(pointers, names, extra):
        t = {p: "*fp32" if p in ("LSE", "DELTA") else "*bf16" for p in pointers}
        t.update({n: "i32" for n in names})
        t.update(extra)
        return t

    results = []
    for spec in specs:
        kind, d = spec["kernel"], spec.get("d", 128)
        d0, d1 = configs.head_split(d)
        dv = spec.get("dv", d)  # v's head dim, where it has its own
        dv0, dv1 = configs.head_split(dv)
        head = dict(D=d, D0=d0, D1=d1, VD=dv, VD0=dv0, VD1=dv1, UPCAST=False, PRECISION="ieee")
        # the masks and features a spec asks for (default: causal, nothing else)
        features = dict(BOUND_LEFT=spec.get("window", False), BOUND_RIGHT=spec.get("causal", True),
                        SOFTCAP=spec.get("softcap", False), VARLEN=spec.get("varlen", False))
        floats = {"scale_log2": "fp32", "squash": "fp32", "cap_log2": "fp32"}
        offsets = {name: "*i32" for name in ("CU_Q", "CU_K")}  # the packed sequences' cu_seqlens
        row = dict(spec)
        try:
            if kind == "fwd_sm90":
                from triton.experimental.gluon import language as gl
                from triton.experimental.gluon._runtime import GluonASTSource

                def descriptor(rows):  # the signature Triton derives from the host's TensorDescriptor
                    shape, layout = attention_sm90.tile(rows, d, gl.bfloat16)
                    return f"tensordesc<bf16[{','.join(map(str, shape))}],{layout!r}>"

                block_n, stages, o_through_q, consumers = (spec.get("config")
                                                           or attention_sm90.config(d, spec.get("causal", True)))
                row["consumers"] = consumers
                rows = attention_sm90.WARPGROUP_ROWS
                types_ = {"q_desc": descriptor(rows), "k_desc": descriptor(block_n), "v_desc": descriptor(block_n),
                          "o_desc": descriptor(rows), "lse_ptr": "*fp32", "counter": "*i32", "BH": "i32", "H": "i32",
                          "GROUP": "i32", "SQ": "i32", "SKV": "i32", "qk_scale": "fp32"}
                consts = dict(CAUSAL=spec.get("causal", True), NEGATIVE_SCALE=False, STAGES=stages,
                              O_THROUGH_Q=o_through_q, CONSUMERS=consumers, num_warps=4)
                row.update(run(sm90_fwd.fwd_kernel, types_, consts, 4, 1, False, GluonASTSource,
                               maxnreg=attention_sm90.FWD_MAXNREG[consumers]))
            elif kind == "bwd_sm90":
                from triton.experimental.gluon import language as gl
                from triton.experimental.gluon._runtime import GluonASTSource

                block_m, stages, dq_buffers, split_mask = (spec.get("config")
                                                           or attention_sm90.BWD_CONFIGS[d, spec["causal"]])

                def descriptor(rows, cols, dtype):  # as above
                    shape, layout = attention_sm90.tile(rows, cols, getattr(gl, dtype))
                    name = "fp32" if dtype == "float32" else "bf16"
                    return f"tensordesc<{name}[{','.join(map(str, shape))}],{layout!r}>"

                keys = attention_sm90.BWD_BLOCK_N
                types_ = {**{name: descriptor(block_m if name in ("q_desc", "do_desc") else keys, d, "bfloat16")
                             for name in ("q_desc", "k_desc", "v_desc", "do_desc", "dk_desc", "dv_desc")},
                          "dq_desc": descriptor(block_m, d // 2, "float32"), "lse_ptr": "*fp32", "delta_ptr": "*fp32",
                          "H": "i32", "GROUP": "i32", "SQ": "i32", "SKV": "i32", "BAND": "i32", "qk_scale": "fp32",
                          "scale": "fp32"}
                consts = dict(CAUSAL=spec["causal"], STAGES=stages, DQ_BUFFERS=dq_buffers, SPLIT_MASK=split_mask,
                              num_warps=4)
                row.update(run(sm90_bwd.bwd_kernel, types_, consts, 4, 1, False, GluonASTSource,
                               maxnreg=attention_sm90.MAXNREG))
            elif kind in ("fwd", "decode", "paged"):
                block_m, block_n, warps, stages = spec["config"]
                names = ["sq_b", "sq_h", "sq_m", "sk_b", "sk_h", "sk_n", "sv_b", "sv_h", "sv_n", "so_split", "so_b",
                         "so_h", "so_m", "slse_split", "slse_b", "slse_h", "stable_b", "H", "GROUP", "SQ", "SKV",
                         "LEFT", "RIGHT", "PAIRS", "KEYS_PER_SPLIT"]
                types_ = attention_types(("Q", "K", "V", "O", "LSE"), names, {**floats, **offsets, "CACHE_LENS": "*i32",
                                                                             "TABLE": "*i32", "SINK": "*fp32"})
                consts = dict(head, **features, PAGED=kind == "paged", PAGE=16 if kind == "paged" else 0,
                              BLOCK_M=block_m, BLOCK_N=block_n, PACK_GROUP=kind in ("decode", "paged"),
                              NEGATIVE_SCALE=False, UNIT=spec.get("unit", 8),
                              OFFSETS_64=spec.get("offsets_64", False), FOLD=spec.get("fold", False),
                              SINKS=spec.get("sinks", False))
                row.update(run(fwd_kernels.fwd_kernel, types_, consts, warps, stages, False))
            elif kind == "dkdv":
                block_m, block_n, warps, stages = spec["config"]
                names = [f"s{t}_{a}" for t in ("q", "k", "v", "do", "dk", "dv") for a in
                         (("b", "h", "n") if t in ("k", "v", "dk", "dv") else ("b", "h", "m"))]
                types_ = attention_types(("Q", "K", "V", "DO", "LSE", "DELTA", "DK", "DV"),
                                         names + ["slse_b", "slse_h", "HKV", "GROUP", "SQ", "SKV", "LEFT", "RIGHT",
                                                  "PAIRS"],
                                         {"scale": "fp32", **floats, **offsets})
                consts = dict(head, **features, BLOCK_M=block_m, BLOCK_N=block_n, UNIT=8,
                              OFFSETS_64=spec.get("offsets_64", False), FOLD=spec.get("fold", False))
                row.update(run(bwd_kernels.dkdv_kernel, types_, consts, warps, stages, False))
            elif kind == "dq":
                block_m, block_n, warps, stages = spec["config"]
                names = [f"s{t}_{a}" for t in ("q", "k", "v", "do", "dq") for a in
                         (("b", "h", "n") if t in ("k", "v") else ("b", "h", "m"))]
                types_ = attention_types(("Q", "K", "V", "DO", "LSE", "DELTA", "DQ"),
                                         names + ["slse_b", "slse_h", "H", "GROUP", "SQ", "SKV", "LEFT", "RIGHT",
                                                  "PAIRS"],
                                         {"scale": "fp32", **floats, **offsets})
                consts = dict(head, **features, BLOCK_M=block_m, BLOCK_N=block_n, UNIT=8,
                              OFFSETS_64=spec.get("offsets_64", False), FOLD=spec.get("fold", False))
                row.update(run(bwd_kernels.dq_kernel, types_, consts, warps, stages, False))
            elif kind == "delta":
                types_ = {"O": "*bf16", "DO": "*bf16", "DLSE": "*fp32", "DELTA": "*fp32", "DQ_SUM": "*fp32",
                          **strides("o", "do"), "H": "i32", "SQ": "i32", "PAIRS": "i32"}
                # zeroing dQ's float32 sum where the Hopper backward takes the head dim, as it runs
                consts = dict(D=d, BLOCK_D=triton.next_power_of_2(d), BLOCK=64 if d <= 128 else 32,
                              ZERO_DQ=d in attention_sm90.BWD_HEAD_DIMS, OFFSETS_64=spec.get("offsets_64", False),
                              FOLD=spec.get("fold", False), LSE_GRADIENT=spec.get("lse_gradient", False))
                row.update(run(bwd_kernels.delta_kernel, types_, consts, 4, 3, d % 16 == 0))
            elif kind == "combine":
                types_ = {"O_PART": "*fp32", "LSE_PART": "*fp32", "O": "*bf16", "LSE": "*fp32", "SINK": "*fp32",
                          "SPLITS": "i32", "H": "i32", "SQ": "i32", **strides("o")}
                consts = dict(D=d, BLOCK_D=triton.next_power_of_2(d), BLOCK_S=16, SINKS=spec.get("sinks", False))
                row.update(run(fwd_kernels.combine_kernel, types_, consts, 4, 3, d % 16 == 0))
            elif kind == "norm_partials":
                types_ = {"addresses": "*i64", "chunk_tensor": "*i32", "chunk_start": "*i64", "numels": "*i64",
                          "partials": "*fp32", "offset": "i32"}
                consts = dict(DTYPE=dtypes[spec["dtype"]], CHUNK=8192, BLOCK=2048, INF=spec["inf"], ALIGNED=True)
                row.update(run(grad_norm._partials_kernel, types_, consts, 8, 3, False))
            elif kind == "norm_final":
                types_ = {"partials": "*fp32", "n": "i32", "out": "*fp32"}
                row.update(run(grad_norm._final_kernel, types_, dict(BLOCK=grad_norm.FINAL_BLOCK, INF=spec["inf"]), 4,
                               3, False))
            elif kind in ("rms_fwd", "ln_fwd", "rms_bwd", "ln_bwd"):  # every option on, at row width d
                flags = dict(DTYPE=dtypes[spec["dtype"]], RMS=kind.startswith("rms"), BLOCK_D=triton.next_power_of_2(d))
                warps = norms._warps(flags["BLOCK_D"])
                x, pointers = f"*{spec['dtype']}", ("W", "B", "MEAN", "RSTD", "DW_PART", "DB_PART")
                if kind.endswith("fwd"):
                    types_ = {name: "*fp32" if name in pointers else x for name in ("X", "R", "W", "B", "OUT", "H",
                                                                                      "MEAN", "RSTD")}
                    types_.update({n: "i32" for n in ("stride_xm", "stride_rm", "D")}, eps="fp32")
                    # rows of unit column stride, which a launch specialises to the constant 1 (the usual case)
                    consts = dict(flags, HAS_RES=True, HAS_W=True, HAS_B=True, stride_xd=1, stride_rd=1)
                    row.update(run(norms._norm_fwd_kernel, types_, consts, warps, 1, False))
                else:
                    types_ = {name: "*fp32" if name in pointers else x for name in ("X", "W", "MEAN", "RSTD", "DY",
                                                                                      "DH", "DX", "DW_PART",
                                                                                      "DB_PART")}
                    types_.update({n: "i32" for n in ("stride_xm", "stride_ym", "stride_hm", "M", "D",
                                                      "rows_per_program")})
                    consts = dict(flags, HAS_W=True, HAS_DH=True, BIAS_GRAD=True, stride_xd=1, stride_yd=1,
                                  stride_hd=1, W_RESIDENT=flags["BLOCK_D"] <= norms.W_RESIDENT_BLOCK)
                    row.update(run(norms._norm_bwd_kernel, types_, consts, warps, 1, False))
            elif kind == "cross_entropy_rows":  # every option on, a row of unit column stride
                types_ = {"LOGITS": f"*{spec['dtype']}", "TARGET": "*i64", "SCALE": "*fp32", "LOSS": "*fp32",
                          "C": "i32", "stride_row": "i64", "stride_scale": "i32", "V": "i32", "ignore_index": "i32",
                          "smoothing": "fp32", "softcap": "fp32", "inv_softcap": "fp32"}
                consts = dict(SOFTCAP=True, SMOOTHING=True, GRAD=True, DTYPE=dtypes[spec["dtype"]],
                              BLOCK_R=spec["rows"], BLOCK_V=cross_entropy.TILE // spec["rows"], stride_col=1,
                              stride_target=1)
                row.update(run(cross_entropy._rows_kernel, types_, consts, 8, 1, False))
            elif kind == "rope":  # q, k and the outputs of unit dim stride (the usual case), float32 tables
                x = f"*{spec['dtype']}"
                types_ = {name: x for name in ("Q", "K", "QO", "KO")}
                types_.update(COS="*fp32", SIN="*fp32")
                types_.update({f"s{t}_{axis}": "i32" for t in ("q", "k", "qo", "ko") for axis in ("b", "h", "s")})
                types_.update({f"s{t}_{axis}": "i32" for t in ("c", "s") for axis in ("b", "s")})
                types_.update({n: "i32" for n in ("HQ", "HK", "S", "D", "R", "s_blocks", "q_head_blocks",
                                                  "head_blocks")})
                half = triton.next_power_of_2(d // 2)
                heads = max(1, min(rope.HEADS, rope.BLOCK_ELEMENTS // (rope.BLOCK_S * half)))  # as _plan sizes it
                consts = dict(DTYPE=dtypes[spec["dtype"]], INTERLEAVED=spec["interleaved"], INVERSE=spec["inverse"],
                              COPY_REST=True, BLOCK_S=max(1, min(rope.BLOCK_S, rope.BLOCK_ELEMENTS // (heads * half))),
                              BLOCK_HALF=half, PASS_BLOCK=rope.PASS_BLOCK, HEADS=heads, sq_d=1, sk_d=1, sqo_d=1,
                              sko_d=1, sc_r=1, ss_r=1)
                row.update(run(rope._rope_kernel, types_, consts, rope.NUM_WARPS, 1, True))
            elif kind == "column_sum":
                row.update(run(norms._column_sum_kernel, {"PART": "*fp32", "OUT": "*fp32", "P": "i32", "D": "i32"},
                               dict(BLOCK=norms.COLUMN_BLOCK), 4, 1, False))
            else:
                types_ = {"addresses": "*i64", "chunk_tensor": "*i32", "chunk_start": "*i64", "numels": "*i64",
                          "n_tensors": "i32", "step_addresses": "*i64", "lr_ptr": "*fp32", "lr_value": "fp32",
                          "grad_scale_ptr": "*fp32", "found_inf_ptr": "*fp32", "clip_coef_ptr": "*fp32"}
                types_.update({n: "fp32" for n in ("beta1", "beta2", "log2_beta1", "log2_beta2", "eps",
                                                   "weight_decay")})
                consts = dict(DTYPE=dtypes[spec["dtype"]], STATE_DTYPE=dtypes[spec["state"]], CHUNK=4096, BLOCK=2048,
                              AMSGRAD=spec.get("amsgrad", True), MAXIMIZE=False, WEIGHT_DECAY=True, DECOUPLED=True,
                              LR_IS_TENSOR=True, HAS_GRAD_SCALE=True, HAS_FOUND_INF=True, HAS_CLIP=True, ALIGNED=True)
                row.update(run(adam._adam_kernel, types_, consts, 8, 3, False))
        except Exception as exc:  # noqa: BLE001 -- reported per spec, so one failure names itself
            root = exc  # Triton chains an error through every inlined function: the root names the cause
            while root.__cause__ is not None:
                root = root.__cause__
            cause = f" (from {type(root).__name__}: {str(root)[-500:]})" if root is not exc else ""
            row["error"] = f"{type(exc).__name__}: {str(exc)[-500:]}{cause}"
        results.append(row)
        print(json.dumps(row), flush=True)
    return results


def _run(specs: list[dict]) -> list[dict]:
    done = subprocess.run([sys.executable, __file__, "--specs", json.dumps(specs)], capture_output=True, text=True,
                          timeout=1500)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def _traced_launches(backend_dir: str) -> dict:
    """Per traced op (OpImpl.traced; kernels loaded alone, interpreter off, as on a GPU): the kernels its forward and
    backward graphs launch once AOTAutograd has decomposed it, as Inductor receives them, and the portable_ops ops
    left in those graphs (none: each decomposes into its launches). The graphs are traced, not run."""
    norms, rope = (_kernel_module(name, backend_dir) for name in ("norms", "rope"))
    import torch
    from torch._functorch.aot_autograd import aot_function
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
    from triton.runtime.jit import JITFunction

    def kernel_name(index):
        kernel = kernel_side_table.get_kernel(index)
        while not isinstance(kernel, JITFunction):  # an Autotuner holding the launch's warps
            kernel = kernel.fn
        return kernel.fn.__name__

    rows, x = torch.randn(6, 16).t().contiguous().t(), torch.randn(6, 16)  # rows of any strides
    w, cos = torch.randn(16), torch.randn(1, 5, 8)
    q, k = torch.randn(2, 5, 4, 16).transpose(1, 2), torch.randn(2, 2, 5, 16)
    traced = {**norms.traced_ops(), **rope.traced_ops()}
    ops = torch.ops.portable_ops
    calls = {"triton_rms_norm_fwd": (getattr(ops, traced["rms_norm_fwd"]), (rows, x, w, 1e-6)),
             "triton_layer_norm_fwd": (getattr(ops, traced["layer_norm_fwd"]), (rows, None, w, w, 1e-5)),
             "triton_rope_fwd": (getattr(ops, traced["rope_fwd"]), (q, k, cos, cos, False))}
    found = {}
    for name, (op, args) in calls.items():
        graphs = []

        def keep(graph, inputs, graphs=graphs):
            graphs.append(graph)
            return graph

        differentiable = [a.clone().requires_grad_() if isinstance(a, torch.Tensor) and a is not cos else a
                          for a in args]
        compiled = aot_function(lambda *a, op=op: op(*a)[0].square().sum(), fw_compiler=keep, bw_compiler=keep,
                                dynamic=True)
        with contextlib.suppress(Exception):  # its launches need a GPU: tracing them is the point
            compiled(*differentiable).backward()
        found[name] = [([kernel_name(n.kwargs["kernel_idx"]) for n in graph.graph.nodes
                         if n.target is torch.ops.higher_order.triton_kernel_wrapper_functional],
                        [str(n.target) for n in graph.graph.nodes if "portable_ops" in str(n.target)])
                       for graph in graphs]
    print(json.dumps(found), flush=True)
    return found


def _table_specs(backend_dir: str) -> list[dict]:
    """Every candidate of attention_configs.CONFIGS at its tile width, at the widest head dim that uses it."""
    configs = _kernel_module("attention_configs", backend_dir).CONFIGS
    head_dims = {16: 16, 32: 32, 48: 48, 64: 64, 80: 80, 96: 96, 128: 128, 144: 144, 160: 160, 192: 192, 256: 256}
    return [{"kernel": kernel, "d": head_dims[width], "config": list(config)}
            for kernel, by_width in configs.items() for width, cands in by_width.items() for config in cands]


if __name__ == "__main__":
    if sys.argv[1] == "--specs":
        _compile(json.loads(sys.argv[2]), str(BACKEND_DIR))
    elif sys.argv[1] == "--traced":
        _traced_launches(str(BACKEND_DIR))
    else:  # --table
        rows = _compile(_table_specs(str(BACKEND_DIR)), str(BACKEND_DIR))
        print("| kernel | D | BLOCK_M, BLOCK_N, warps, stages | registers | spills | shared KB |")
        print("| --- | --- | --- | --- | --- | --- |")
        for r in rows:
            print(f"| {r['kernel']} | {r['d']} | {tuple(r['config'])} | {r.get('regs', '')} | "
                  f"{r.get('spills', r.get('error', ''))} | {r['shared'] / 1024:.0f} |" if "shared" in r else
                  f"| {r['kernel']} | {r['d']} | {tuple(r['config'])} | | | error: {r.get('error')} |")
else:
    import pytest

    triton = pytest.importorskip("triton")
    from portable_ops.backends.triton.launch import TRITON_RELEASE

    # Stack bytes that kernels already spill, per Triton release (docs/backends/triton.md, "Spills"): 3.9,
    # CI's, and 3.6, the H100's, which alone times them. The tl.* dK/dV kernel at every width (at D 128 with
    # issue 12's features on 3.6) and at D 128 the tl.* dQ kernel; the Hopper backward at D 128 unmasked on 3.9 and,
    # on 128-row tiles, at D 64 (unmasked / causal: 96 / 168 bytes on 3.9, 48 / 80 on 3.6); the Hopper
    # forward with three consumer warpgroups at D 64, 160 registers each (which 3.6 alone ships), and at
    # D 256 (unmasked / causal: 16 / 32 bytes on 3.9, 0 / 16 on 3.6, O alone 128 registers). Recorded
    # so that they can't grow unnoticed; every other kernel must spill nothing. Another release's spills
    # are not checked.
    SPILLS_KNOWN = {
        (3, 9): {("dkdv", 40): 344, ("dkdv", 80): 520, ("dkdv", 128): 1016, ("dkdv", 192): 1120, ("dq", 128): 16,
                 ("bwd_sm90", 128, "unmasked"): 8, ("bwd_sm90", 64, "unmasked"): 96,
                 ("bwd_sm90", 64, "causal"): 168, ("fwd_sm90", 64, 3): 96, ("fwd_sm90", 256, "unmasked"): 16,
                 ("fwd_sm90", 256, "causal"): 32},
        (3, 6): {("dkdv", 40): 504, ("dkdv", 80): 1088, ("dkdv", 128): 1520, ("dkdv", 192): 912, ("dq", 128): 16,
                 ("bwd_sm90", 64, "unmasked"): 48, ("bwd_sm90", 64, "causal"): 80, ("fwd_sm90", 64, 3): 8,
                 ("fwd_sm90", 256, "causal"): 16},
    }.get(TRITON_RELEASE)

    def _spills_within_known(row) -> bool:
        """Within what SPILLS_KNOWN records for the row's kernel and head dim, or, where it records them
        apart, for its mask or its consumer warpgroups."""
        if SPILLS_KNOWN is None:
            return True
        kernel, d = row["kernel"], row.get("d")
        mask = {True: "causal", False: "unmasked"}.get(row.get("causal"))
        for key in ((kernel, d, row.get("consumers")), (kernel, d, mask), (kernel, d)):
            if key in SPILLS_KNOWN:
                return row["spills"] <= SPILLS_KNOWN[key]
        return row["spills"] == 0

    def test_attention_and_adam_kernels_compile_for_sm90_spilling_no_more_than_known():
        from portable_ops.backends.triton.attention_configs import (CONFIGS, DECODE_CONFIG, DECODE_CONFIG_WIDE_HEADS,
                                                                    DECODE_CONFIG_WIDE_KEYS, head_split)

        specs = [{"kernel": "adam", "dtype": d, "state": s} for d, s in (("bf16", "bf16"), ("bf16", "fp32"),
                                                                            ("fp16", "fp32"))]
        for d in (128, 80, 40, 192):  # a power of two, and split head dims (the last with its tail masked)
            width = sum(head_split(d))
            specs += [{"kernel": kernel, "d": d, "config": list(CONFIGS[kernel][width][0])}
                      for kernel in ("fwd", "dkdv", "dq")]
            specs += [{"kernel": "decode", "d": d,
                       "config": list(DECODE_CONFIG_WIDE_HEADS if width > 128 else DECODE_CONFIG)},
                      {"kernel": "delta", "d": d}, {"kernel": "combine", "d": d}]
            if width <= 128 and head_split(d)[1] == 0:  # sm_90's wide-tile decode
                specs.append({"kernel": "decode", "d": d, "config": list(DECODE_CONFIG_WIDE_KEYS)})
        # issue 12's features at D 128: a sliding window with a softcap, packed sequences, a paged cache
        for kernel in ("fwd", "dkdv", "dq"):
            specs += [{"kernel": kernel, "d": 128, "config": list(CONFIGS[kernel][128][0]), "window": True,
                       "softcap": True, "varlen": True}]
        specs.append({"kernel": "paged", "d": 128, "config": list(DECODE_CONFIG), "window": True})
        # issue 33's: sinks in the forward, the GQA-packed decode and the split-key merge; a gradient through lse;
        # DeepSeek's MLA (q and k of 192, v of 128)
        specs += [{"kernel": kernel, "d": 192, "dv": 128, "config": list(CONFIGS[kernel][192][0]),
                   "sinks": kernel == "fwd"} for kernel in ("fwd", "dkdv", "dq")]
        specs += [{"kernel": "decode", "d": 128, "config": list(DECODE_CONFIG), "sinks": True},
                  {"kernel": "combine", "d": 128, "sinks": True}, {"kernel": "delta", "d": 128, "lse_gradient": True}]
        # (sequence, head) pairs past CUDA's grid limit, folded over the grid's third dim
        specs += [{"kernel": kernel, "d": 128, "config": list(CONFIGS[kernel][128][0]), "fold": True}
                  for kernel in ("fwd", "dkdv", "dq")]
        specs += [{"kernel": "decode", "d": 128, "config": list(DECODE_CONFIG), "fold": True},
                  {"kernel": "delta", "d": 128, "fold": True}]
        rows = _run(specs)
        assert len(rows) == len(specs)
        errors = [r for r in rows if "error" in r]
        assert not errors, errors
        # the first (untimed) candidate of each list must fit an H100 as it is
        assert all(_spills_within_known(r) and r["shared"] <= SHARED_LIMIT for r in rows), rows
        # strides passed divided by UNIT (8 here: any head dim that is a multiple of 8, contiguous or
        # not) still give 16-byte loads: D = 40's rows (80 bytes apart) loaded 2 bytes at a time without it
        assert all(r["scalar_loads"] == 0 for r in rows if r["kernel"] in ("fwd", "dkdv", "dq", "decode")), rows
        # bf16 tiles multiply on the tensor cores with input_precision="ieee" (only float32 operands
        # need "tf32" for that): a dot lowered to FMAs would be many times slower
        assert all(r["mma"] > 0 for r in rows if r["kernel"] in ("fwd", "dkdv", "dq", "decode")), rows

    def test_hopper_attention_forward_compiles_for_sm90():
        """The Gluon forward, at every head dim it takes, causal or not: TMA loads, warpgroup MMAs,
        registers split between the loader and the consumers (setmaxnreg), nothing spilled but what
        SPILLS_KNOWN records, within an H100's shared memory."""
        from portable_ops.backends.triton.attention_sm90 import CONFIGS, HEAD_DIMS

        specs = [{"kernel": "fwd_sm90", "d": d, "causal": causal} for d in HEAD_DIMS for causal in (False, True)]
        # each config as CONFIGS has it, whichever the Triton here runs (three consumers at D 64 unmasked)
        specs += [{"kernel": "fwd_sm90", "d": d, "causal": causal, "config": list(config)}
                  for (d, causal), config in CONFIGS.items()]
        rows = _run(specs)
        errors = [r for r in rows if "error" in r]
        assert not errors, errors
        for r in rows:
            assert _spills_within_known(r) and r["shared"] <= SHARED_LIMIT and r["setmaxnreg"], r
            assert r["mma"] > 0 and r["tma"] > 0, r

    def test_hopper_attention_backward_compiles_for_sm90():
        """The Gluon backward at every head dim and mask it takes: as the forward (but D 128 spills a
        little: SPILLS_KNOWN), within shared memory with its Q/dO ring, two K/V tiles, four dS tiles
        and the dQ buffers; dQ goes out through TMA reduce-adds, not atomics from registers."""
        from portable_ops.backends.triton.attention_sm90 import BWD_CONFIGS

        specs = [{"kernel": "bwd_sm90", "d": d, "causal": causal} for d, causal in BWD_CONFIGS]
        rows = _run(specs)
        errors = [r for r in rows if "error" in r]
        assert not errors, errors
        for r in rows:
            assert _spills_within_known(r) and r["shared"] <= SHARED_LIMIT and r["setmaxnreg"], r
            assert r["mma"] > 0 and r["tma"] > 0 and r["tma_reduce"] > 0 and r["atomics"] == 0, r

    def test_norm_and_amsgrad_maxima_keep_nan_on_the_gpu():
        """The inf-norm's maxima and AMSGrad's running max compile to PTX max.NaN (a NaN grad gives a NaN
        norm, as in torch); the 2-norm has no max."""
        specs = [{"kernel": "norm_partials", "dtype": d, "inf": inf} for d, inf in (("bf16", True), ("fp32", True),
                                                                                     ("fp32", False))]
        specs += [{"kernel": "norm_final", "inf": inf} for inf in (True, False)]
        specs += [{"kernel": "adam", "dtype": "fp32", "state": "fp32", "amsgrad": ams} for ams in (True, False)]
        rows = _run(specs)
        errors = [r for r in rows if "error" in r]
        assert not errors, errors
        for r in rows:
            assert r["nan_max"] == r.get("inf", r.get("amsgrad")), r

    def test_rms_and_layer_norm_kernels_compile_for_sm90_without_atomics_spilling_only_past_4096():
        """Every option on (residual, weight, bias, the sum's gradient), rows of unit column stride, at a model's
        width and up to MAX_D: the weight and bias gradients are partial sums and a second launch, never atomics.
        The forward spills nothing; the backward nothing up to 4096 columns, and past them (a block of 8192,
        where the row's values, its float32 dweight and dbias sums and their addresses pass 128 registers a
        thread) a little, recorded here so it can't grow unnoticed (3.9: 64 to 112 bytes)."""
        from portable_ops.backends.triton.norms import MAX_D

        specs = [{"kernel": kind, "d": d, "dtype": dtype} for kind in ("rms_fwd", "ln_fwd", "rms_bwd", "ln_bwd")
                 for d, dtype in ((4096, "bf16"), (4099, "fp16"), (MAX_D, "fp32"))]
        specs.append({"kernel": "column_sum"})
        rows = _run(specs)
        errors = [r for r in rows if "error" in r]
        assert not errors, errors
        for r in rows:
            wide_backward = r["kernel"].endswith("bwd") and r["d"] > 4096
            assert r["spills"] <= (128 if wide_backward else 0), r
            assert r["atomics"] == 0 and r["shared"] <= SHARED_LIMIT, r

    def test_linear_cross_entropy_rows_kernel_compiles_for_sm90_without_spills_or_atomics():
        """Every option on (softcap, label smoothing, the gradient written over the logits), rows of unit column
        stride: one row a program in the widest block (bf16, fp32), and 64 rows of 64 columns (bf16)."""
        rows = _run([{"kernel": "cross_entropy_rows", "dtype": dtype, "rows": rows}
                     for dtype, rows in (("bf16", 1), ("fp32", 1), ("bf16", 64))])
        errors = [r for r in rows if "error" in r]
        assert not errors, errors
        for r in rows:
            assert r["spills"] == 0 and r["atomics"] == 0 and r["shared"] <= SHARED_LIMIT, r

    def test_rope_kernel_compiles_for_sm90_without_spills_or_atomics():
        """Both layouts, forward and backward, at head dims 64, 128 and 256 and at MAX_ROTARY (the block shrinks
        with the rotary dims: fewer heads, then fewer positions, so its six float32 blocks stay in registers)."""
        from portable_ops.backends.triton.rope import MAX_ROTARY

        specs = [{"kernel": "rope", "d": d, "dtype": dtype, "interleaved": interleaved, "inverse": inverse}
                 for d, dtype, interleaved, inverse in ((64, "bf16", False, False), (128, "fp16", True, True),
                                                        (256, "bf16", True, False), (MAX_ROTARY, "fp32", False, True))]
        rows = _run(specs)
        errors = [r for r in rows if "error" in r]
        assert not errors, errors
        for r in rows:
            assert r["spills"] == 0 and r["atomics"] == 0 and r["shared"] <= SHARED_LIMIT, r

    def test_traced_ops_decompose_into_their_kernels_launches_for_inductor():
        """What Inductor gets for the ops torch.compile traces into (interpreter off, as on a GPU; in the
        interpreter they stay custom ops): each forward and its registered backward decomposed into the kernels'
        launches, with no portable_ops op left in the graphs."""
        done = subprocess.run([sys.executable, __file__, "--traced"], capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        found = json.loads(done.stdout.splitlines()[-1])
        forward, backward = ["_norm_fwd_kernel"], ["_norm_bwd_kernel", "_column_sum_kernel"]  # a sum per parameter
        assert found == {"triton_rms_norm_fwd": [[forward, []], [backward, []]],
                         "triton_layer_norm_fwd": [[forward, []], [backward + ["_column_sum_kernel"], []]],
                         "triton_rope_fwd": [[["_rope_kernel"], []], [["_rope_kernel"], []]]}, found
