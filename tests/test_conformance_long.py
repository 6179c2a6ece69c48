"""The long attention cases (16k, 32k): their run policy, and their sampled-rows oracle at sizes a CPU can afford.

The long cases themselves run on an accelerator, or with PORTABLE_OPS_CONFORMANCE_LONG=1; here the same
machinery (``sampled_rows``, ``long=True``) runs at 256 to 2048 rows, must pass on a correct backend and must
fail when a backend's out, dq, dk or dv is wrong in a single element.
"""

import json

import pytest
import torch

from portable_ops import dispatch
from portable_ops.conformance import CASES, Case, run_case, usable_backends
from portable_ops.conformance import __main__ as conformance_cli
from portable_ops.conformance.cases import long_attention_params
from portable_ops.conformance.tolerances import GRADIENT_FACTOR
from portable_ops.conformance.runner import F64, LONG_VARIABLE, attention_inputs, attention_oracle, long_cases_run

USABLE = usable_backends()
LONG = [c for c in CASES if c.long]


def probe(sq, *, block, d=64, causal=True, hq=4, hkv=2, dtype=torch.float16):
    """A long case at ``sq`` rows, built as the catalogue's are, with blocks of ``block`` sampled rows."""
    return Case(f"probe_{sq}", "attention", dtype, long_attention_params(1, hq, hkv, sq, d, causal, block), long=True)


def test_the_catalogue_has_long_cases_at_16k_and_32k():
    assert {c.params["Sq"] for c in LONG} == {16384, 32768}
    assert {c.params["causal"] for c in LONG} == {True, False}
    for case in LONG:
        blocks = case.params["sampled_rows"]
        assert case.op == "attention" and case.params["Sq"] == case.params["Skv"]
        assert all(0 <= a < b <= c < d for (a, b), (c, d) in zip(blocks, blocks[1:]))  # ordered, disjoint
        assert blocks[0][0] == 0 and blocks[-1][1] == case.params["Sq"]  # the first and the last rows
        assert blocks[1][0] % 16 and blocks[1][1] % 16  # the middle block cuts tiles


@pytest.mark.parametrize("case", LONG, ids=lambda c: c.id)
def test_a_long_case_would_fail_a_backend_that_returned_zeros(case):
    """At 16k keys and scale 1/sqrt(D) a row's attention is nearly uniform, out and the gradients inside the
    bf16 atol: the case would pass a kernel that returned zeros. The catalogue's scores are peaked instead:
    zeros fail on most elements of out and dq in every sampled block, and on hundreds of keys' dk and dv
    (only the sampled rows reach dk and dv, and a peaked row reaches few keys)."""
    p = case.params
    q, k, v, dout, blocks, _ = attention_inputs(case)
    q, k, v, dout = (t.to(case.dtype).to(F64) for t in (q, k, v, dout))
    atol, rtol = case.tolerance
    grad_atol, grad_rtol = case.tolerance.scaled(GRADIENT_FACTOR)
    dk = dv = 0.0
    for rows in blocks:
        want = attention_oracle("float64", q, k, v, dout, rows, p["causal"], p["scale"])
        assert (want.out.abs() > atol + rtol * want.out.abs()).double().mean() > 0.5, rows
        assert (want.dq.abs() > grad_atol + grad_rtol * want.dq.abs()).double().mean() > 0.5, rows
        dk, dv = dk + want.dk, dv + want.dv
    for grad in (dk, dv):
        assert (grad.abs() > grad_atol + grad_rtol * grad.abs()).any(-1).sum() > 100


def test_long_cases_run_on_an_accelerator_and_on_the_cpu_only_when_asked(monkeypatch):
    monkeypatch.delenv(LONG_VARIABLE, raising=False)
    cpu = torch.device("cpu")
    assert long_cases_run(torch.device("cuda")) and long_cases_run(torch.device("xla"))
    assert not long_cases_run(cpu) and long_cases_run(cpu, long=True)
    monkeypatch.setenv(LONG_VARIABLE, "1")
    assert long_cases_run(cpu) and not long_cases_run(cpu, long=False)
    monkeypatch.setenv(LONG_VARIABLE, "off")
    assert not long_cases_run(cpu)


@pytest.mark.parametrize("backend", dispatch.BACKEND_NAMES)
def test_long_cases_are_not_run_on_the_cpu_by_default(backend, monkeypatch):
    if backend not in USABLE:
        pytest.skip(f"{backend} is not usable here")
    monkeypatch.delenv(LONG_VARIABLE, raising=False)
    for case in LONG:
        row = run_case(case, backend, torch.device("cpu"))
        assert row.status == "not run" and row.detail.startswith("long case:"), row


@pytest.mark.parametrize("backend, case", [
    ("reference", probe(2048, block=128, d=128, dtype=torch.bfloat16)),
    ("reference", probe(1024, block=128, causal=False, hkv=1)),
    ("triton", probe(256, block=32)),
    ("nki", probe(1024, block=128)),
], ids=lambda x: x if isinstance(x, str) else x.id + ("_causal" if x.params["causal"] else ""))
def test_the_sampled_rows_oracle_passes_a_correct_backend(backend, case):
    if backend not in USABLE:
        pytest.skip(f"{backend} is not usable here")
    row = run_case(case, backend, long=True)
    assert row.status == "pass", row.detail
    assert row.oracles == (["float64", "torch"] if backend == "reference" else ["float64"])
    assert 0 < row.max_abs


def _edited(monkeypatch, op, edit):
    """The reference backend's ``op``, with ``edit`` applied to its result (a wrong kernel)."""
    backend = dispatch.get_backend("reference")
    impl = backend.ops[op]

    def run(*args, **kw):
        result = impl.run(*args, **kw)
        edit(*result)
        return result

    monkeypatch.setitem(backend.ops, op, dispatch.OpImpl(run=run, supports=impl.supports))


# At 512 rows, blocks of 64: the sampled rows are 0:32, 261:325 and 448:512.
@pytest.mark.parametrize("op, edit, label", [
    # key 100 is seen by the middle and last blocks only, far from either
    ("attention_bwd", lambda dq, dk, dv: dk[0, 1, 100, 7].add_(0.05), "dk vs float64"),
    ("attention_bwd", lambda dq, dk, dv: dv[0, 0, 100, 7].add_(0.05), "dv vs float64"),
    ("attention_bwd", lambda dq, dk, dv: dq[0, 3, 300, 5].add_(0.05), "dq rows 261:325 vs float64"),
    # far inside the tolerance, but dq is exactly zero where dout is
    ("attention_bwd", lambda dq, dk, dv: dq[0, 0, 200, 0].fill_(1e-4), "dq outside the sampled rows"),
    ("attention_fwd", lambda out, lse: out[0, 2, 500, 3].add_(0.05), "out rows 448:512 vs float64"),
])
def test_a_wrong_backend_fails_the_sampled_rows_check(op, edit, label, monkeypatch):
    _edited(monkeypatch, op, edit)
    row = run_case(probe(512, block=64), "reference", long=True)
    assert row.status == "fail" and row.detail.startswith(label), row.detail


def test_overlapping_sampled_rows_are_an_error_not_a_wrong_oracle():
    case = Case("probe_overlap", "attention", torch.float16,
                dict(B=1, Hq=1, Hkv=1, Sq=64, Skv=64, D=16, causal=True, sampled_rows=((0, 32), (16, 48))))
    row = run_case(case, "reference")
    assert row.status == "error" and "overlap" in row.detail


# ----------------------------------------------------------------------------- the CLI

def test_the_cli_counts_long_cases_not_run_apart_and_exits_by_the_cases_run(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(LONG_VARIABLE, raising=False)
    out = tmp_path / "rows.json"
    # only long cases, none run here: exit 1, not an empty pass
    assert conformance_cli.main(["--backend", "reference", "--case", "attn_long", "--json", str(out)]) == 1
    n = len(LONG)
    assert f"0 pass, 0 fail, 0 fallback, 0 error, {n} not run of {n} cases" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["counts"]["not run"] == n and {r["status"] for r in report["rows"]} == {"not run"}
    # the other attention cases pass: exit 0, the long ones counted as not run
    assert conformance_cli.main(["--backend", "reference", "--case", "attn_", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    ran = len(report["rows"]) - n
    assert report["counts"] == {"pass": ran, "fail": 0, "fallback": 0, "error": 0, "not run": n}
    assert f"{ran} pass, 0 fail, 0 fallback, 0 error, {n} not run of {ran + n} cases" in capsys.readouterr().out


def test_the_cli_passes_long_on(monkeypatch):
    monkeypatch.delenv(LONG_VARIABLE, raising=False)
    seen = []
    monkeypatch.setattr(conformance_cli, "run", lambda *a, **k: seen.append(k["long"]) or [])
    for argv, env in ((["--long"], None), ([], "yes"), ([], None)):
        if env is not None:
            monkeypatch.setenv(LONG_VARIABLE, env)
        conformance_cli.main(["--backend", "reference", "--case", "attn_long", *argv])
        monkeypatch.delenv(LONG_VARIABLE, raising=False)
    assert seen == [True, True, False]


@pytest.mark.parametrize("argv, variable, message", [
    (["--long=yes"], None, "--long: ignored explicit argument 'yes'"),
    ([], "maybe", f"{LONG_VARIABLE}='maybe' is not a boolean"),
])
def test_the_cli_refuses_a_bad_long_setting_before_running(argv, variable, message, capsys, monkeypatch):
    monkeypatch.setattr(conformance_cli, "run", lambda *a, **k: pytest.fail("the run started"))
    if variable is not None:
        monkeypatch.setenv(LONG_VARIABLE, variable)
    with pytest.raises(SystemExit) as exited:
        conformance_cli.main(["--backend", "reference", *argv])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "usage:" in err and message in err, err
