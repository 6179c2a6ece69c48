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
    row = runner.run_case(Case("probe", "clip_grad_norm_", torch.float32,
                               dict(shapes=[(4,)], max_norm=1.0, norm_type=2.0)), "triton", torch.device("cpu"))
    assert row.status == "fallback" and "no kernel for this test" in row.detail and not row.declared
    assert conformance_cli.main(["--backend", "triton", "--case", "clip_l2_odd_sizes[float32]"]) == 1


def test_a_declared_decline_is_a_fallback_that_fails_only_under_strict(fake_backend, capsys):
    """An op the backend lists in Backend.declined falls back on every case: reported as a fallback
    (declared), never a pass; the exit status is 0 unless --strict."""
    backend = fake_backend("triton", ops=("adam", "attention_fwd", "attention_bwd"))
    backend.declined = ("grad_norm",)
    row = runner.run_case(Case("probe", "clip_grad_norm_", torch.float32,
                               dict(shapes=[(4,)], max_norm=1.0, norm_type=2.0)), "triton", torch.device("cpu"))
    assert row.status == "fallback" and row.declared
    assert "the global norm of gradients (clip_grad_norm_): not in the triton kernels yet" in row.detail
    case = ["--backend", "triton", "--case", "clip_l2_odd_sizes[float32]"]
    assert conformance_cli.main(case) == 0
    assert "0 pass, 0 fail, 1 fallback (1 declared)" in capsys.readouterr().out
    assert conformance_cli.main([*case, "--strict"]) == 1


# ----------------------------------------------------------------------------- usage errors: exit 2, before any work

import importlib  # noqa: E402
import os  # noqa: E402
import pathlib  # noqa: E402
import threading  # noqa: E402

import pytest  # noqa: E402

import portable_ops  # noqa: E402
from portable_ops import dispatch, env  # noqa: E402
from portable_ops.bench import __main__ as bench_cli  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
import gpt2_tiny  # noqa: E402


def test_help_exits_0_and_names_the_commands():
    result = run_module("portable_ops", "--help")
    assert result.returncode == 0, result.stderr
    for command in ("doctor", "portable_ops.conformance", "portable_ops.bench"):
        assert command in result.stdout


def usage_error(main, argv, capsys):
    """What ``main(argv)`` printed on stderr, having exited 2 (argparse's usage error) before any case or step."""
    with pytest.raises(SystemExit) as exited:
        main(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2, err
    assert "usage:" in err and "Traceback" not in err
    return err


def refused_runs(monkeypatch):
    """Fail the test if the conformance runner starts on any case."""
    monkeypatch.setattr(conformance_cli, "run", lambda *a, **k: pytest.fail("the run started"))


@pytest.mark.parametrize("device, message", [("bogus", "'bogus' is not a device name"),
                                             ("cuda:99", "'cuda:99': no such device here"),
                                             ("meta", "meta tensors hold no values to check")])
def test_conformance_refuses_a_device_it_cant_use(device, message, capsys, monkeypatch):
    refused_runs(monkeypatch)
    assert message in usage_error(conformance_cli.main, ["--backend", "reference", "--device", device], capsys)


def test_conformance_checks_the_json_folder_before_running(tmp_path, capsys, monkeypatch):
    refused_runs(monkeypatch)
    missing = tmp_path / "no" / "rows.json"
    assert "does not exist" in usage_error(conformance_cli.main, ["--backend", "reference", "--json", str(missing)],
                                           capsys)
    assert "is a folder" in usage_error(conformance_cli.main, ["--backend", "reference", "--json", str(tmp_path)],
                                        capsys)
    assert "--json needs a file name" in usage_error(conformance_cli.main, ["--backend", "reference", "--json", ""],
                                                     capsys)


def test_conformance_reports_a_json_file_it_could_not_write(tmp_path, capsys, monkeypatch):
    """A write that fails after the run (a full disk) is one line and exit 2, not a traceback."""
    import builtins

    real_open = builtins.open
    out = tmp_path / "rows.json"

    def full_disk(path, *args, **kwargs):
        if str(path) == str(out):
            raise OSError(28, "No space left on device")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", full_disk)
    assert conformance_cli.main(["--backend", "reference", "--case", "clip_one", "--json", str(out)]) == 2
    assert "could not write the results (No space left on device)" in capsys.readouterr().err


def test_conformance_refuses_a_backend_that_cannot_run_here_and_runs_each_once(capsys, monkeypatch):
    from portable_ops import dispatch

    refused_runs(monkeypatch)
    nki = dispatch.get_backend("nki")
    monkeypatch.setattr(nki, "runtime_reasons", lambda device: ["nki needs a NeuronCore"])
    assert conformance_cli.main(["--backend", "nki"]) == 2
    assert ("backend 'nki' is unavailable: no neuron device in this process, and nki needs a NeuronCore"
            in capsys.readouterr().err)
    monkeypatch.undo()
    seen = []
    monkeypatch.setattr(conformance_cli, "run", lambda backends, *a, **k: seen.append(backends) or [])
    conformance_cli.main(["--backend", "reference", "--backend", "reference", "--case", "clip_one"])
    assert seen == [["reference"]]


def test_a_case_filter_matching_nothing_is_a_usage_error(capsys, monkeypatch):
    refused_runs(monkeypatch)
    err = usage_error(conformance_cli.main, ["--backend", "reference", "--case", "no_such_case"], capsys)
    assert "--case 'no_such_case' matches none of the" in err


@pytest.mark.parametrize("argv, message", [(["nki", "--tiny"], "--tiny applies to the train or hf benchmark, not nki"),
                                           (["train", "--seqs", "7"], "--seqs applies to the attention benchmark"),
                                           (["optimizer", "--shapes", "1"], "--shapes applies to the train")])
def test_bench_refuses_options_of_another_benchmark(argv, message, capsys):
    assert message in usage_error(bench_cli.main, argv, capsys)


def test_bench_checks_its_output_folder_before_timing(tmp_path, capsys):
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    assert "is a file, not a folder" in usage_error(bench_cli.main, ["optimizer", "--out", str(not_a_folder / "x")],
                                                    capsys)


@pytest.mark.parametrize("argv, message", [(["--device", "bogus"], "is not a device name"),
                                           (["--steps", "0"], "--steps must be at least 1"),
                                           (["--json", "/no/such/folder/x.json"], "does not exist")])
def test_the_example_refuses_bad_arguments_before_training(argv, message, capsys, monkeypatch):
    monkeypatch.setattr(gpt2_tiny, "train", lambda *a, **k: pytest.fail("training started"))
    assert message in usage_error(gpt2_tiny.main, argv, capsys)


# ----------------------------------------------------------------------------- environment variables

@pytest.mark.parametrize("value, expected", [("1", True), ("true", True), ("YES", True), (" on ", True),
                                             ("0", False), ("false", False), ("Off", False), ("no", False),
                                             ("", False)])
def test_strict_mode_parses_booleans(value, expected, monkeypatch):
    """PORTABLE_OPS_STRICT=false / off / no turned strict mode on (anything but "" and "0" did)."""
    monkeypatch.setenv("PORTABLE_OPS_STRICT", value)
    assert dispatch.strict() is expected


@pytest.mark.parametrize("name", ["PORTABLE_OPS_STRICT", "PORTABLE_OPS_AUTOTUNE", "PORTABLE_OPS_NKI_EMULATOR"])
def test_a_boolean_variable_that_is_not_one_names_itself(name, monkeypatch):
    monkeypatch.setenv(name, "maybe")
    with pytest.raises(ValueError, match=rf"{name}='maybe' is not a boolean: expected one of 1, true, yes, on"):
        env.flag(name, False)


def test_every_boolean_variable_is_read_by_the_one_parser(monkeypatch):
    """PORTABLE_OPS_AUTOTUNE=0 was the only way to turn tuning off; PORTABLE_OPS_NKI_EMULATOR=false forced the
    emulator. Each is read through env.flag now."""
    autotune = importlib.import_module("portable_ops.backends.triton.autotune")
    compat = importlib.import_module("portable_ops.backends.nki.compat")
    monkeypatch.setattr(autotune, "INTERPRETED", False)  # tuning is off in the interpreter whatever the variable
    for value, tuned in (("off", False), ("false", False), ("1", True)):
        monkeypatch.setenv("PORTABLE_OPS_AUTOTUNE", value)
        assert autotune.Tuner().enabled() is tuned
    monkeypatch.setenv("PORTABLE_OPS_NKI_EMULATOR", "false")
    assert compat._load_sdk()[3] != "PORTABLE_OPS_NKI_EMULATOR is set"
    monkeypatch.setenv("PORTABLE_OPS_NKI_EMULATOR", "yes")
    assert compat._load_sdk()[3] == "PORTABLE_OPS_NKI_EMULATOR is set"


def test_a_variable_reads_as_os_environ_has_it(monkeypatch):
    """env.get reads os.environ's own dict: it sees every change made through os.environ."""
    monkeypatch.delenv("PORTABLE_OPS_TEST_VARIABLE", raising=False)
    assert env.get("PORTABLE_OPS_TEST_VARIABLE") is None
    for value in ("1", "", " Déjà vu "):
        monkeypatch.setenv("PORTABLE_OPS_TEST_VARIABLE", value)
        assert env.get("PORTABLE_OPS_TEST_VARIABLE") == value == os.environ.get("PORTABLE_OPS_TEST_VARIABLE")
    monkeypatch.delenv("PORTABLE_OPS_TEST_VARIABLE")
    assert env.get("PORTABLE_OPS_TEST_VARIABLE") is None


def test_a_backend_forced_in_one_thread_is_not_forced_in_another():
    seen = []
    with portable_ops.use_backend("reference"):
        thread = threading.Thread(target=lambda: seen.append(dispatch.forced_backend()))
        thread.start()
        thread.join()
        assert dispatch.forced_backend() == "reference"
    assert seen == [None] and dispatch.forced_backend() is None


@pytest.mark.parametrize("value, expected", [("triton", "triton"), (" Reference ", "reference"), ("", None)])
def test_the_forced_backend_variable(value, expected, monkeypatch):
    monkeypatch.setenv("PORTABLE_OPS_BACKEND", value)
    assert dispatch.forced_backend() == expected


def test_an_unknown_forced_backend_names_the_variable(monkeypatch):
    monkeypatch.setenv("PORTABLE_OPS_BACKEND", "cuda")
    with pytest.raises(ValueError, match="PORTABLE_OPS_BACKEND='cuda'; expected one of triton, nki, reference"):
        dispatch.forced_backend()


@pytest.mark.parametrize("value", ["0", "false", "off", "no", "", "1", "true", "ON", "y", "2"])
def test_triton_interpret_means_to_the_package_what_it_means_to_triton(value, monkeypatch):
    """The package read TRITON_INTERPRET=false as on, where Triton reads it as off: kernels compiled for a GPU
    while the backend routed CPU tensors to them, or the other way round."""
    pytest.importorskip("triton")
    from triton._C.libtriton import getenv_bool

    interpreter = importlib.import_module("portable_ops.backends.triton.interpreter")
    monkeypatch.setenv("TRITON_INTERPRET", value)
    try:
        assert importlib.reload(interpreter).INTERPRETED is getenv_bool("TRITON_INTERPRET", False)
    finally:
        monkeypatch.undo()
        importlib.reload(interpreter)


def test_explain_with_missing_arguments_names_them():
    """A lambda's TypeError (``<lambda>() missing 2 required positional arguments``) came out."""
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(TypeError, match=r"explain\(attention, \.\.\.\): missing k, v; attention takes \(q, k, v, \*, "
                                        r"causal=False, scale=None, window=None, softcap=None, sinks=None, "
                                        r"return_lse=False\)"):
        portable_ops.explain(portable_ops.attention, q)
    with pytest.raises(TypeError, match="explain.clip_grad_norm_, ....: missing max_norm"):
        portable_ops.explain(portable_ops.clip_grad_norm_, [])
    with pytest.raises(ValueError, match="explain: unknown op"):
        portable_ops.explain(print, q)
