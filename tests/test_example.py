"""The GPT-2-style example trains on every backend usable here, with agreeing loss curves.

Tolerance: float32 training is chaotic, so curves from different kernels drift apart by rounding
alone (our reference against SDPA + torch fused AdamW drifts by 0.015 over 300 steps). Each
step's loss must stay within 0.05 of the reference's, and the mean of the last 20 within 0.02.
The reference trains 200 steps; the interpreted backends (Triton interpreter, NKI emulator) run
20 steps of a one-layer model on a smaller batch against the reference on the same batches, to fit
CPU CI (a layer's step of the interpreted Triton kernels takes about a second there). On a GPU, the command line trains
any backend for as long as asked.
"""

import pathlib
import sys

import pytest

from portable_ops.conformance import usable_backends
from portable_ops.conformance.runner import default_device
from conftest import slow_in_the_interpreter

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
import gpt2_tiny  # noqa: E402

STEPS = 200
CFG = gpt2_tiny.Config()
SHORT_STEPS = 20
SHORT_CFG = gpt2_tiny.Config(batch=2, layers=1)


@pytest.fixture(scope="module")
def reference_run():
    return gpt2_tiny.train(CFG, STEPS, backend="reference")


def assert_curves_agree(losses, expected):
    assert len(losses) == len(expected)
    worst = max(abs(a - b) for a, b in zip(losses, expected))
    assert worst <= 0.05, f"a step's loss differs by {worst:.4f}"
    tail = abs(sum(losses[-20:]) - sum(expected[-20:])) / min(20, len(losses))
    assert tail <= 0.02, f"last-20 mean differs by {tail:.4f}"


def test_reference_learns_and_matches_torch(reference_run):
    losses = reference_run["losses"]
    assert losses[0] > 3.5 and sum(losses[-20:]) / 20 < 1.0  # from ln(64) down to a learnt grammar
    torch_run = gpt2_tiny.train(CFG, STEPS, use_torch=True)
    assert_curves_agree(losses, torch_run["losses"])


@pytest.mark.parametrize("backend", slow_in_the_interpreter([b for b in usable_backends() if b != "reference"
                                                              and default_device(b).type == "cpu"]))
def test_every_backend_trains_the_same(backend):
    run = gpt2_tiny.train(SHORT_CFG, SHORT_STEPS, backend=backend)
    expected = gpt2_tiny.train(SHORT_CFG, SHORT_STEPS, backend="reference")
    assert_curves_agree(run["losses"], expected["losses"])
    assert run["losses"][-1] < run["losses"][0] - 1.0  # it learns


def test_command_line_with_progress_and_json(tmp_path, capsys):
    out = tmp_path / "run.json"
    assert gpt2_tiny.main(["--steps", "12", "--json", str(out), "--layers", "1"]) == 0
    captured = capsys.readouterr()
    assert "12/12" in captured.err and "tokens/s" in captured.out
    assert out.exists()
