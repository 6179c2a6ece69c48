"""The transformers benchmark (``python -m portable_ops.bench hf``) runs its protocol end to end on CPU at a toy
size (a smoke run, not a measurement), its results render into the docs' table, and the README's transformers
recipe runs as written."""

import importlib.util
import json
import math
import os
import pathlib
import re
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

ROOT = pathlib.Path(__file__).resolve().parents[1]
# One OpenMP thread: on a small machine shared with other work, threads waiting on each other slow a toy model
# far more than one thread does.
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _docs_tables():
    spec = importlib.util.spec_from_file_location("docs_tables", ROOT / "benchmarks" / "docs_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tiny_hf_benchmark_writes_rows_the_docs_render(tmp_path, monkeypatch):
    result = subprocess.run([sys.executable, "-m", "portable_ops.bench", "hf", "--tiny", "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=300, cwd=ROOT, env=ENV)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    results = json.loads((tmp_path / "hf.json").read_text())
    info, rows = results["info"], results["rows"]
    assert info["device"].startswith("CPU") and info["transformers"] and info["command"].endswith(str(tmp_path))
    steps = info["warm-up steps"] + info["rounds"] * info["timed steps per round"]
    # on CPU: eager only, and FlexAttention (no CPU backward) left out
    assert [(r["model"], r["mode"], r["attention"]) for r in rows] == [
        (model, "eager", attention) for model in ("llama", "mistral") for attention in ("sdpa", "portable_ops")]
    for r in rows:
        assert "error" not in r, r
        figures = [r[k] for k in ("tokens/s", "tokens/s min", "tokens/s max", "ms/step", "vs best transformers")]
        assert all(math.isfinite(x) and x > 0 for x in figures), r
        assert r["tokens/s min"] <= r["tokens/s"] <= r["tokens/s max"] and r["warm-up s"] >= 0
        assert len(r["losses"]) == steps and all(map(math.isfinite, r["losses"])) and r["final loss"] > 0
        assert r["best transformers"] == "sdpa" and r["peak GiB"] is None
        if r["attention"] == "sdpa":
            assert r["vs best transformers"] == 1.0 and r["loss - sdpa's"] == 0.0
        else:
            # float32 on CPU, the same weights and batches: the same training as sdpa's, to rounding
            assert r["optimizer"].startswith("portable_ops") and r["max |loss - sdpa's|"] < 1e-3
    docs_tables = _docs_tables()
    monkeypatch.setattr(docs_tables, "RESULTS", tmp_path)
    rendered = docs_tables.hf()
    assert rendered.count("| **portable_ops** |") == 2 and "sliding window 16" in rendered
    assert "Results: `docs/perf/hf.json`" in rendered and f"transformers {info['transformers']}" in rendered


def test_tiny_applies_to_train_and_hf_only(capsys):
    from portable_ops.bench.__main__ import main

    with pytest.raises(SystemExit):
        main(["optimizer", "--tiny"])
    assert "--tiny applies to the train or hf benchmark, not optimizer" in capsys.readouterr().err


def test_readme_transformers_recipe_runs(tmp_path):
    readme = (ROOT / "README.md").read_text()
    block = next(code for code in re.findall(r"```python\n(.*?)```", readme, re.S)
                 if "attn_implementation=register()" in code)
    assert "po.optim.AdamW(" in block and len(block.strip().splitlines()) <= 12
    result = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True, timeout=300,
                            cwd=tmp_path, env=ENV)
    assert result.returncode == 0, result.stderr[-3000:]
