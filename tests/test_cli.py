import json
import subprocess
import sys

import torch

from portable_ops.conformance import __main__ as conformance_cli
from portable_ops.conformance import runner
from portable_ops.conformance.cases import Case


def run_module(*args):
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=300)


def test_doctor_reports_hardware_and_every_backend():
    result = run_module("portable_ops", "doctor")
    assert result.returncode == 0, result.stderr
    assert "torch " in result.stdout
    for name in ("triton", "nki", "reference"):
        assert f"  {name} " in result.stdout
    assert "reference  available" in result.stdout


def test_unknown_subcommand_prints_usage():
    result = run_module("portable_ops", "frobnicate")
    assert result.returncode == 2 and "usage" in result.stderr


def test_conformance_cli_prints_a_table_and_writes_json(tmp_path):
    out = tmp_path / "rows.json"
    result = run_module("portable_ops.conformance", "--backend", "reference", "--case", "clip_l2", "--json", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "clip_l2_odd_sizes[float32]" in result.stdout and "3 pass, 0 fail, 0 fallback, 0 error" in result.stdout
    rows = json.loads(out.read_text())["rows"]
    assert {r["status"] for r in rows} == {"pass"} and all("torch" in r["oracles"] for r in rows)


def test_the_suite_catches_a_wrong_kernel(monkeypatch):
    """A backend whose Adam forgets bias correction fails the suite; the CLI exits 1."""
    from portable_ops import dispatch

    backend = dispatch.get_backend("reference")
    original = backend.ops["adam"].run

    def wrong(*args, **kw):
        kw["beta1"] = kw["beta1"] * 0.5
        return original(*args, **kw)

    monkeypatch.setitem(backend.ops, "adam", dispatch.OpImpl(run=wrong))
    assert conformance_cli.main(["--backend", "reference", "--case", "adam_odd_sizes[float32]"]) == 1
    row = runner.run_case(Case("probe", "adam", torch.float32, dict(
        shapes=[(10,)], steps=2, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, decoupled=False,
        amsgrad=False, maximize=False)), "reference")
    assert row.status == "fail" and "exp_avg" in row.detail


def test_a_declined_case_is_a_fallback_not_a_pass(fake_backend):
    fake_backend("triton", reasons=["no kernel for this test"])
    row = runner.run_case(Case("probe", "clip", torch.float32, dict(shapes=[(4,)], max_norm=1.0, norm_type=2.0)),
                          "triton", torch.device("cpu"))
    assert row.status == "fallback" and "no kernel for this test" in row.detail
