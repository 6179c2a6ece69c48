"""The fallback benchmark (issue 38) runs on the CPU and gives well-formed rows; speed is never asserted here."""

import json
import math
import pathlib

import pytest
import torch

from portable_ops.bench import __main__ as bench_cli
from portable_ops.bench import fallback

COLUMNS = ["op", "case", "dtype", "device", "ours ms", "torch ms", "ratio", "target", "spread"]


def _check_timed(row):
    assert set(COLUMNS) <= set(row), row
    assert row["device"] == "cpu"
    for field in ("ours ms", "torch ms", "ratio", "ratio min", "ratio max"):
        assert isinstance(row[field], float) and math.isfinite(row[field]) and row[field] > 0, (field, row)
    assert row["ratio min"] <= row["ratio"] <= row["ratio max"]
    assert row["spread"] == fallback.spread(row["ratio min"], row["ratio max"])
    assert (row["met"] is None if row["target"] is None else isinstance(row["met"], bool)) and row["torch"]


@pytest.fixture(scope="module")
def rows():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a shared machine's other processes stall a multi-threaded kernel's threads
    try:
        return fallback.run_fallback("cpu", size="tiny")
    finally:
        torch.set_num_threads(threads)


def test_tiny_run_covers_every_op_with_finite_positive_ratios(rows):
    for row in rows:
        _check_timed(row)
    ops = {row["op"] for row in rows}
    assert ops == {"attention fwd", "attention fwd+bwd", "AdamW step", "clip", "clip + AdamW step", "gpt2_tiny train",
                   "AdamW step, torch against itself"}
    assert {row["dtype"] for row in rows} == {"float32", "bfloat16"}
    cases = " ".join(row["case"] for row in rows)
    for label in ("causal", "non-causal", "decode", "views of one qkv"):
        assert label in cases
    gpt2 = next(row for row in rows if row["op"] == "gpt2_tiny train")
    assert gpt2["target"] == f">= {fallback.THROUGHPUT_TARGET}x" and gpt2["ours tokens/s"] > 0
    noise = next(row for row in rows if row["op"] == "AdamW step, torch against itself")
    assert noise["target"] is None and noise["met"] is None
    assert all(row["target"] == f"<= {fallback.TIME_TARGET}x" for row in rows if row not in (gpt2, noise))


def test_missing_example_is_a_skipped_row(tmp_path):
    row = fallback.gpt2_row(fallback.pick_device("cpu"), fallback.PLANS["tiny"], tmp_path / "gpt2_tiny.py")
    assert row["ratio"] is None and row["case"] == "skipped" and "not found" in row["note"]


def test_cli_writes_the_results_file(tmp_path, monkeypatch, capsys, rows):
    asked = {}

    def run(device, quick, log):  # the tiny run's rows: this test checks the wiring
        asked.update(device=device, quick=quick)
        return rows
    monkeypatch.setattr(fallback, "run_fallback", run)
    assert bench_cli.main(["fallback", "--device", "cpu", "--quick", "--out", str(tmp_path)]) == 0
    assert asked == {"device": torch.device("cpu"), "quick": True}
    results = json.loads((tmp_path / "fallback.json").read_text())
    assert results["info"]["device"].startswith("CPU") and "command" in results["info"]
    assert results["rows"] == json.loads(json.dumps(rows))
    assert "ours ms" in capsys.readouterr().out


def test_cli_refuses_device_for_other_benches():
    with pytest.raises(SystemExit):
        bench_cli.main(["optimizer", "--device", "cpu"])


def test_example_path_is_the_checkouts():
    assert fallback.EXAMPLE == pathlib.Path(__file__).resolve().parents[1] / "examples" / "gpt2_tiny.py"
