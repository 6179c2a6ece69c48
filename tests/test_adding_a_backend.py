"""docs/adding-a-backend.md, followed step by step with a toy backend (tests/toy_backend/toy) for a device type
that is not the CPU: "toy", PyTorch's PrivateUse1 device renamed, whose tensors hold real values
(tests/toy_backend/toy/device.py). Renaming PrivateUse1 holds for the whole process and can't be undone, so
those steps run in a process of their own; the declaration's checks at registration run here.
"""

import json
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch

from portable_ops import backends, dispatch
from portable_ops.conformance import CASES, run_case
from portable_ops.conformance import __main__ as conformance_cli
from portable_ops.conformance.runner import placement

TOY_FOLDER = pathlib.Path(__file__).parent / "toy_backend"

# The steps, in a process of their own: the package where dispatch imports backends from (step 1), its name
# in BACKEND_NAMES (step 2: dispatch.py's tuple, set here as an edit of that file would), then the checks.
STEPS = textwrap.dedent("""
    import json, sys
    import torch
    import portable_ops
    from portable_ops import backends, dispatch

    backends.__path__.append(sys.argv[1])  # step 1: the package backends/toy
    dispatch.BACKEND_NAMES = (*dispatch.BACKEND_NAMES[:-1], "toy", dispatch.FALLBACK)  # step 2

    from portable_ops import doctor
    from portable_ops.conformance import CASES, __main__ as cli, runner
    from portable_ops.backends import toy
    from portable_ops.backends.toy import device

    report = doctor.report()  # step 3: doctor lists it
    cli_status = cli.main(["--backend", "toy", "--case", "adam_odd_sizes", "--json", sys.argv[2]])  # step 4
    rows = runner.run(["toy"], [case for case in CASES if not case.long])  # step 4, every case short enough
    q = torch.randn(1, 2, 8, 16).to("toy")
    result = dict(report=report, cli_status=cli_status, rows=[row.as_dict() for row in rows],
                  calls=dict(toy.CALLS), placement=str(runner.placement("toy").device),
                  default_for_toy=portable_ops.explain("attention", q, q, q).backend,
                  default_for_cpu=portable_ops.explain("attention", q.cpu(), q.cpu(), q.cpu()).backend,
                  out_device=str(portable_ops.attention(q, q, q).device))
    print(json.dumps(result))
""")


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("toy")
    result = subprocess.run([sys.executable, "-c", STEPS, str(TOY_FOLDER), str(folder / "rows.json")],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.splitlines()[-1]), json.loads((folder / "rows.json").read_text())


def test_doctor_lists_the_new_backend_with_its_device_type(toy_run):
    report = toy_run[0]["report"]
    assert "  toy        available (the reference's kernels on toy tensors); default for toy;" in report
    assert "not yet: paged_attention, paged_kv_append" in report


def test_dispatch_makes_it_the_default_for_its_device_type_only(toy_run):
    run = toy_run[0]
    assert (run["default_for_toy"], run["default_for_cpu"], run["out_device"]) == ("toy", "reference", "toy:0")


def test_the_conformance_suite_runs_its_cases_on_its_device(toy_run):
    run, cli_json = toy_run
    assert run["placement"] == "toy" and run["cli_status"] == 0
    assert {r["status"] for r in cli_json["rows"]} == {"pass"} and len(cli_json["rows"]) == 3
    # every op it implements ran there (each kernel first checks that its tensors are on the toy device)
    assert set(run["calls"]) == {"adam", "sgd", "grad_norm", "attention_fwd", "attention_bwd", "attention_varlen_fwd",
                                 "attention_varlen_bwd", "rms_norm_fwd", "rms_norm_bwd", "layer_norm_fwd",
                                 "layer_norm_bwd", "rope_fwd", "rope_bwd", "rope_inplace", "linear_cross_entropy_fwd",
                                 "linear_cross_entropy_bwd"}
    rows = run["rows"]
    assert not [r for r in rows if r["status"] not in ("pass", "fallback")], [r for r in rows if r["status"] != "pass"]
    assert sum(r["status"] == "pass" for r in rows) >= 70


def test_what_it_declares_is_what_dispatch_refuses(toy_run):
    """Its declarations (head dims up to 128, none of attention's optional features but causal) give the generic
    reasons; its declined ops fall back as declared."""
    for row in toy_run[0]["rows"]:
        if row["status"] != "fallback":
            continue
        if row["case"].startswith("paged_"):
            assert row["declared"] and "appending to a paged KV cache (paged_kv_append): not in the toy kernels yet" \
                in row["detail"], row
        else:
            assert not row["declared"], row
            assert ("is over 128, the largest the toy kernels take" in row["detail"] or "window=" in row["detail"]
                    or "softcap=" in row["detail"] or "sinks (" in row["detail"]
                    or "a gradient through lse" in row["detail"]), row


# ----------------------------------------------------------------------------- in this process

@pytest.fixture
def toy_named(monkeypatch):
    """Steps 1 and 2 in this process, undone after: tests/toy_backend on the backends' path, "toy" in
    BACKEND_NAMES. Its module is not imported here (that would rename PrivateUse1 for good)."""
    monkeypatch.setattr(backends, "__path__", [*backends.__path__, str(TOY_FOLDER)])
    monkeypatch.setattr(dispatch, "BACKEND_NAMES", (*dispatch.BACKEND_NAMES[:-1], "toy", dispatch.FALLBACK))
    monkeypatch.setattr(dispatch, "_backends", dict(dispatch._backends))
    monkeypatch.setattr(dispatch, "_import_errors", dict(dispatch._import_errors))
    monkeypatch.delitem(sys.modules, "portable_ops.backends.toy", raising=False)


def test_cases_of_a_backend_whose_device_is_absent_are_not_run(toy_named, monkeypatch):
    """Where its device type is absent and it can't run CPU tensors, its cases are "not run", with the reason."""
    reference = dispatch.get_backend("reference")
    dispatch._backends["toy"] = dispatch.Backend(name="toy", devices=("toy",), ops=dict(reference.ops))
    assert placement("toy").device is None
    row = run_case(CASES[0], "toy")
    assert row.status == "not run"
    assert row.detail == "no toy device in this process, and toy runs on toy tensors; not on cpu"
    assert conformance_cli.main(["--backend", "toy", "--case", CASES[0].id]) == 2


def test_a_backend_declaring_an_op_outside_the_table_fails_to_register():
    impl = dispatch.OpImpl(run=lambda **call: None)
    with pytest.raises(ValueError, match="'softmax' is not an op of portable_ops/ops.py"):
        dispatch.Backend(name="toy", devices=("toy",), ops={"softmax": impl})
    with pytest.raises(ValueError, match="'softmax' is not an op of portable_ops/ops.py"):
        dispatch.Backend(name="toy", devices=("toy",), ops={}, declined=("softmax",))


@pytest.mark.parametrize("declaration, problem", [
    (dict(devices="cuda", ops={}), "devices must be a tuple of device type names"),
    (dict(devices=("*",), ops={}), "only 'reference' runs on every device type"),
    (dict(devices=("toy",), ops={"adam": dispatch.OpImpl(run=print)}, declined=("adam",)),
     "'adam' is both implemented and declined"),
    (dict(devices=("toy",), ops={"adam": dispatch.OpImpl(run=print, max_head_dim=64)}),
     "adam: max_head_dim is declared for an op with no head dim"),
    (dict(devices=("toy",), ops={"attention_fwd": dispatch.OpImpl(run=print, features=("dropout",))}),
     "attention_fwd: 'dropout' is not one of its features"),
    (dict(devices=("toy",), ops={"grad_norm": dispatch.OpImpl(run=print, dtypes=(torch.int8,))}),
     "grad_norm: dtypes"),
    (dict(devices=("toy",), ops={"rope_fwd": dispatch.OpImpl(run=print, traced="toy_rope_fwd")}),
     "rope_fwd: traced must be a function returning its op's name, got 'toy_rope_fwd'"),
])
def test_a_declaration_is_checked_when_it_registers(declaration, problem):
    with pytest.raises(ValueError, match="backend 'toy' is declared wrongly: .*" + problem.replace("(", r"\(")):
        dispatch.Backend(name="toy", **declaration)


def test_a_module_with_a_wrong_declaration_fails_at_import_and_is_reported(tmp_path, monkeypatch):
    package = tmp_path / "wrong"
    package.mkdir()
    (package / "__init__.py").write_text(
        "from portable_ops.dispatch import Backend, OpImpl\n"
        "BACKEND = Backend(name='wrong', devices=('toy',), ops={'softmax': OpImpl(run=print)})\n")
    monkeypatch.setattr(backends, "__path__", [*backends.__path__, str(tmp_path)])
    monkeypatch.setattr(dispatch, "BACKEND_NAMES", (*dispatch.BACKEND_NAMES[:-1], "wrong", dispatch.FALLBACK))
    monkeypatch.setattr(dispatch, "_import_errors", dict(dispatch._import_errors))
    assert dispatch.get_backend("wrong") is None
    assert "'softmax' is not an op of portable_ops/ops.py" in dispatch.unavailable_reason("wrong")
