"""What a new user meets first (issue 38): the CPU commands run without triton, explain suggests only what
can run here, strict mode's error reads as one refusal, the package says its license, the docs link only
inside the repository, the test extra installs what the tests need, and importing stays light."""

import importlib.metadata
import json
import pathlib
import re
import subprocess
import sys
import urllib.parse

import pytest
import torch

import portable_ops
from portable_ops import dispatch

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Prepended to a child's code: triton can't be imported there, as where it is not installed.
WITHOUT_TRITON = "import sys\nsys.modules['triton'] = None\n"


def run_python(code: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """``python -c code args`` from the checkout's root."""
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout)


def pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


# ----------------------------------------------------------------------------- without triton


def test_the_blocked_import_is_what_a_missing_triton_looks_like():
    result = run_python(WITHOUT_TRITON + "import triton")
    assert result.returncode != 0 and "ModuleNotFoundError" in result.stderr


def test_cpu_smoke_bench_runs_without_triton(tmp_path):
    code = WITHOUT_TRITON + (
        "import runpy\n"
        "sys.argv = ['portable_ops.bench', 'train', '--tiny', '--shapes', '1', '--out', sys.argv[1]]\n"
        "runpy.run_module('portable_ops.bench', run_name='__main__', alter_sys=True)\n")
    result = run_python(code, str(tmp_path))
    assert result.returncode == 0, result.stderr[-4000:]
    written = json.loads((tmp_path / "train.json").read_text())
    assert written["info"]["triton"] is None
    assert {r["stack"] for r in written["rows"]["runs"]} == {"torch", "portable_ops", "all-ops"}


def test_example_trains_without_triton():
    code = WITHOUT_TRITON + (
        "import runpy\n"
        "script = sys.argv[1]\n"
        "sys.argv = [script, '--steps', '2']\n"
        "runpy.run_path(script, run_name='__main__')\n")
    result = run_python(code, str(ROOT / "examples" / "gpt2_tiny.py"))
    assert result.returncode == 0, result.stderr[-4000:]


def test_explain_suggests_forcing_only_backends_usable_here():
    code = WITHOUT_TRITON + (
        "import json, torch, portable_ops\n"
        "from portable_ops import dispatch\n"
        "q = torch.randn(1, 2, 8, 16)\n"
        "choice = portable_ops.explain(portable_ops.attention, q, q, q)\n"
        "usable = {name: dispatch.unavailable_reason(name) is None\n"
        "          and not dispatch.get_backend(name).device_reasons(q.device) for name in dispatch.BACKEND_NAMES}\n"
        "print(json.dumps({'backend': choice.backend, 'rejected': choice.rejected, 'usable': usable,\n"
        "                  'triton': dispatch.unavailable_reason('triton'), 'report': str(choice)}))\n")
    result = run_python(code)
    assert result.returncode == 0, result.stderr[-4000:]
    seen = json.loads(result.stdout.splitlines()[-1])
    assert not seen["usable"]["triton"]
    assert seen["rejected"]["triton"] == [seen["triton"]]  # why it can't run: not installed
    for name, reasons in seen["rejected"].items():
        suggested = f"use_backend({name!r})" in seen["report"]
        assert suggested == seen["usable"][name], (name, reasons)


def test_explain_does_not_suggest_a_backend_for_tensors_it_does_not_run(fake_backend):
    fake_backend("triton", devices=("cuda",))
    q = torch.randn(1, 2, 8, 16)
    choice = portable_ops.explain(portable_ops.attention, q, q, q)
    assert choice.backend == "reference"
    assert choice.rejected["triton"] == dispatch.get_backend("triton").device_reasons(q.device)
    assert "use_backend('triton')" not in str(choice)


# ----------------------------------------------------------------------------- strict mode


def test_strict_mode_error_is_one_refusal_naming_the_backend_the_reason_and_the_way_out(fake_backend, monkeypatch):
    fake_backend("triton", reasons=["the stand-in declines"])
    q = torch.randn(1, 2, 8, 16)
    monkeypatch.setenv("PORTABLE_OPS_STRICT", "1")
    with portable_ops.use_backend("triton"), pytest.raises(portable_ops.BackendUnavailableError) as raised:
        portable_ops.attention(q, q, q)
    error = raised.value
    message = str(error)
    assert "running '" not in message
    expected = (rf"portable_ops\.{error.op}: call refused under strict mode \(PORTABLE_OPS_STRICT is on\): "
                rf"'{error.preferred}' can't take it \({re.escape('; '.join(error.reasons))}\); "
                rf"set PORTABLE_OPS_STRICT=0 or unset it to let the call fall back to '{error.backend}'")
    assert re.fullmatch(expected, message), message
    assert (error.preferred, error.backend, error.reasons) == ("triton", "reference", ["the stand-in declines"])
    monkeypatch.setenv("PORTABLE_OPS_STRICT", "0")  # the way out the message gives
    with portable_ops.use_backend("triton"), pytest.warns(portable_ops.FallbackWarning, match="running 'reference'"):
        portable_ops.attention(q, q, q)


# ----------------------------------------------------------------------------- packaging


def test_license_is_an_spdx_expression_with_its_file():
    config = pyproject()
    project = config["project"]
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License")
    assert "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text
    # setuptools reads an SPDX `license` and `license-files` from release 77 on
    setuptools = [r for r in config["build-system"]["requires"] if re.match(r"setuptools\b", r)]
    assert [int(re.search(r">=\s*(\d+)", r).group(1)) >= 77 for r in setuptools] == [True]


def _distribution(requirement: str) -> str:
    """A requirement's distribution name, normalised (PEP 503)."""
    return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9._-]+", requirement).group()).lower()


def test_the_test_extra_installs_every_module_a_test_skips_without():
    project = pyproject()["project"]
    declared = {_distribution(r) for r in project["dependencies"] + project["optional-dependencies"]["test"]}
    sources = "\n".join(path.read_text() for path in (ROOT / "tests").glob("*.py"))
    modules = {m.split(".")[0] for m in re.findall(r"importorskip\(\s*[\"']([\w.]+)", sources)}
    installed_by = importlib.metadata.packages_distributions()
    for module in sorted(modules - set(sys.stdlib_module_names)):
        names = {_distribution(name) for name in installed_by.get(module, [module])}
        assert names & declared, f"a test is skipped without {module}, which the test extra does not install"


# ----------------------------------------------------------------------------- docs


_FENCED = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
_CODE_SPAN = re.compile(r"`[^`\n]*`")
_INLINE = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")  # [text](target "title"), ![alt](target)
_HTML = re.compile(r"""\b(?:href|src)\s*=\s*["']([^"']+)["']""")  # <a href>, <img src>
# `[label]: target` lines, which can't interrupt a paragraph: a run of them after a blank line
_DEFINITIONS = re.compile(r"(?:\A|\n[ \t]*\n)((?:[ ]{0,3}\[[^\]\n]+\]:[^\n]*(?:\n|\Z))+)")
_DEFINITION = re.compile(r"^[ ]{0,3}\[[^\]\n]+\]:[ \t]*<?([^\s>]+)", re.M)


def _link_targets(text: str) -> list[str]:
    definitions = [target for block in _DEFINITIONS.findall(text) for target in _DEFINITION.findall(block)]
    return _INLINE.findall(text) + definitions + _HTML.findall(text)


def bad_links(markdown: pathlib.Path, root: pathlib.Path) -> list[str]:
    """The relative links of ``markdown`` that leave ``root`` or name nothing there."""
    text = _CODE_SPAN.sub("", _FENCED.sub("", markdown.read_text()))
    bad = []
    for target in _link_targets(text):
        if re.match(r"[A-Za-z][A-Za-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL, or a heading of this page
        path = urllib.parse.unquote(target.split("#")[0].split("?")[0])
        resolved = ((root / path.lstrip("/")) if path.startswith("/") else (markdown.parent / path)).resolve()
        if not resolved.is_relative_to(root.resolve()):
            bad.append(f"{markdown.name}: {target} leaves the repository")
        elif not resolved.exists():
            bad.append(f"{markdown.name}: {target} does not exist")
    return bad


def test_docs_link_only_to_files_in_the_repository():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    assert [problem for page in pages for problem in bad_links(page, ROOT)] == []


def test_link_check_finds_links_outside_the_repository_and_to_missing_files(tmp_path):
    root = tmp_path / "repo"
    (root / "docs").mkdir(parents=True)
    (root / "docs" / "there.md").write_text("x")
    page = root / "docs" / "page.md"
    page.write_text("[a](there.md#part) [b](../../outside.md) [c](missing.md) [d](https://example.com/x.md)\n"
                    "`[e](../../in-code.md)` and, in the paragraph,\n  [2, 4]: not a link\n\n"
                    "[f]: ../../shared/DESIGN.md\n[g]: there.md\n[h]: nowhere.md\n\n<img src=\"../gone.png\">\n")
    assert bad_links(page, root) == ["page.md: ../../outside.md leaves the repository",
                                     "page.md: missing.md does not exist",
                                     "page.md: ../../shared/DESIGN.md leaves the repository",
                                     "page.md: nowhere.md does not exist",
                                     "page.md: ../gone.png does not exist"]


# ----------------------------------------------------------------------------- import time


def test_import_leaves_torch_distributed_tensor_unimported():
    result = run_python("import sys, portable_ops\nprint('torch.distributed.tensor' in sys.modules)")
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.split() == ["False"]


def test_a_dtensor_made_after_import_is_seen():
    code = ("import torch, portable_ops\n"
            "from portable_ops import distributed\n"
            "import torch.distributed as dist\n"
            "from torch.distributed.device_mesh import init_device_mesh\n"
            "from torch.distributed.tensor import Shard, distribute_tensor\n"
            "dist.init_process_group('gloo', rank=0, world_size=1, store=dist.HashStore())\n"
            "t = distribute_tensor(torch.ones(4), init_device_mesh('cpu', (1,)), [Shard(0)])\n"
            "print(distributed.is_dtensor(t), distributed.is_dtensor(t.to_local()),\n"
            "      distributed.local(t) is t._local_tensor)\n"
            "dist.destroy_process_group()\n")
    result = run_python(code)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.split() == ["True", "False", "True"]
