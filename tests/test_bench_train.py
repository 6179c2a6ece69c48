"""The end-to-end training benchmark runs its whole protocol (on CPU, at a toy size: a smoke run,
not a measurement) and its two stacks compute the same training."""

import json
import math

import torch

from portable_ops.bench import train


def test_train_benchmark_protocol_on_a_toy_shape(tmp_path):
    name = next(iter(train.SHAPES))
    shapes = {name: train.tiny(train.SHAPES[name])}
    result = train.run_train(shapes, device="cpu", timed_steps=2, profiled_steps=1, host_steps=3, second_run=False,
                             progress=lambda line: None)
    runs = result["runs"]
    assert {(r["stack"], r["mode"]) for r in runs} == {(s, m) for s in train.STACKS for m in train.MODES}
    for r in runs:
        # on CPU no profiled step runs; host-timed steps are not compared
        assert r["tokens/s"] > 0 and len(r["losses"]) == train.WARMUP_STEPS + 2
        phases = [r[f"host {phase} ms"] for phase in train.PHASES]
        assert all(ms >= 0 for ms in phases) and r["host forward ms"] > 0 and r["host backward ms"] > 0
        # medians of each phase over 3 steps: no bound ties their sum to the median step (a host busy with
        # other work slows a different phase of each step), so the sum is checked per step below
        assert (r["vs torch"] == 1.0) == (r["stack"] == "torch")
    assert [len(r["losses"]) for r in result["noise runs"]] == [train.WARMUP_STEPS + 2]
    assert all(row["agree"] for row in result["losses"]), result["losses"]
    assert {h["stack"] for h in result["attention host"]} == set(train.STACKS)
    text = train.report(result, {"device": "cpu"}, tmp_path)
    assert "vs torch" in text and json.loads((tmp_path / "train.json").read_text())["rows"]["runs"]


def test_host_phases_of_one_step_add_up_to_the_step():
    name = next(iter(train.SHAPES))
    run = train.Run(train.tiny(train.SHAPES[name]), "portable_ops", "eager", torch.device("cpu"), steps=2)
    run.step()
    times = train.step_host_ms(run, 1)  # one step: each median is that step's own time
    phases = [times[f"host {phase} ms"] for phase in train.PHASES]
    assert all(ms >= 0 for ms in phases) and times["host forward ms"] > 0
    assert math.isclose(sum(phases), times["host ms/step"], rel_tol=1e-9, abs_tol=1e-9)


def test_train_shapes_option_picks_by_number_or_name_and_rejects_others(capsys):
    import pytest

    from portable_ops.bench.__main__ import _shape_names

    names = list(train.SHAPES)
    assert _shape_names("2") == [names[1]]
    assert _shape_names(f"{names[2]},1,3") == [names[2], names[0]]
    for bad in ("0", "4", "d9 hd1", ""):
        with pytest.raises(Exception, match="unknown train shape"):
            _shape_names(bad)
    from portable_ops.bench.__main__ import main

    with pytest.raises(SystemExit):
        main(["train", "--tiny", "--shapes", "7"])
    assert "unknown train shape '7'; choose from 1 (d1024 hd64 s2048)" in capsys.readouterr().err


def test_loss_curves_agree_within_tolerance_or_within_torchs_own_spread():
    def rows(ours, torch_eager, torch_compiled):
        curves = {("portable_ops", "eager"): ours, ("portable_ops", "compiled"): ours,
                  ("torch", "eager"): torch_eager, ("torch", "compiled"): torch_compiled}
        return [{"shape": "s", "stack": s, "mode": m, "losses": c} for (s, m), c in curves.items()]

    base = [3.0] * 12
    calm = train.compare_losses(rows([3.01] * 12, base, base))
    assert [r["agree"] for r in calm] == [True, True]
    off = train.compare_losses(rows([3.5] * 12, base, base))
    assert [r["agree"] for r in off] == [False, False]
    # torch's own runs 1.0 apart: a 0.5 gap is within that spread
    spread = train.compare_losses(rows([3.5] * 12, base, [4.0] * 12))
    assert [r["agree"] for r in spread] == [True, True] and spread[0]["torch's own spread"] == "1 / 1"
    # the same through torch's run with its other attention kernel (the noise run)
    noisy = rows([3.5] * 12, base, base) + [{"shape": "s", "stack": train.NOISE_RUN[0], "mode": train.NOISE_RUN[1],
                                             "losses": [2.4] * 12}]
    assert [r["agree"] for r in train.compare_losses(noisy)] == [True, True]


def test_kernel_kinds_sort_ours_torchs_and_the_rest():
    kinds = {
        "fwd_kernel": "attention fwd", "dkdv_kernel": "attention bwd", "delta_kernel": "attention bwd",
        "dq_kernel": "attention bwd", "bwd_kernel": "attention bwd", "combine_kernel": "attention fwd",
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128": "attention fwd",
        "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_2_64x128x128": "attention bwd",
        "void flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4> >(flash::Flash_fwd_params)":
            "attention fwd",
        "fmha_cutlassB_bf16_aligned_64x64_k128_sm80": "attention bwd",
        "_adam_kernel": "optimizer", "_partials_kernel": "optimizer",
        "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::NormTwoOps<float>>>":
            "optimizer",
        "void at::native::multi_tensor_apply_kernel<at::native::FusedAdamMathFunctor<float, 4>>": "optimizer",
        "triton_poi_fused__scaled_dot_product_flash_attention_backward_0": "other",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64": "other",
        "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_1": "other",
    }
    assert {name: train._kind(name) for name in kinds} == kinds
