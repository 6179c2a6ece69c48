"""The README's and docs/performance.md's figures are rendered from docs/perf's results files, not copied.

Every rendered block (``<!-- results: NAME -->`` ... ``<!-- /results -->``) must be what
benchmarks/docs_tables.py renders from the results file now, and no ratio (``1.05x``) or throughput
(``600 TFLOP/s``, ``3.0 TB/s``, ``200,000 tokens/s``) may be written outside a rendered block.
"""

import importlib.util
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("docs_tables", ROOT / "benchmarks" / "docs_tables.py")
docs_tables = importlib.util.module_from_spec(spec)
spec.loader.exec_module(docs_tables)

FIGURE = re.compile(r"\d+\.\d+x\b|\d[\d,.]*\s*(?:TFLOP/s|[GT]B/s|tokens/s)")


@pytest.mark.parametrize("doc", docs_tables.DOCS, ids=lambda p: p.name)
def test_rendered_blocks_match_their_results_files(doc):
    text = doc.read_text()
    assert docs_tables.BLOCK.search(text), f"{doc.name} has no rendered block"
    assert docs_tables.render(text) == text, f"run: python benchmarks/docs_tables.py ({doc.name} differs)"


@pytest.mark.parametrize("doc", docs_tables.DOCS, ids=lambda p: p.name)
def test_no_figure_outside_a_rendered_block(doc):
    text = doc.read_text()
    rendered = [m.span() for m in docs_tables.BLOCK.finditer(text)]
    stray = [(text.count("\n", 0, m.start()) + 1, m.group()) for m in FIGURE.finditer(text)
             if not any(start <= m.start() < end for start, end in rendered)]
    assert not stray, f"{doc.name}: figures outside a rendered block (line, figure): {stray}"


def test_every_block_names_a_renderer_and_every_renderer_a_results_file():
    names = {m.group(2) for doc in docs_tables.DOCS for m in docs_tables.BLOCK.finditer(doc.read_text())}
    assert names <= set(docs_tables.RENDERERS)
    for name in names - {"headline"}:
        assert (docs_tables.RESULTS / f"{name}.json").exists(), name


def test_the_check_flags_a_hand_edited_figure():
    text = (ROOT / "README.md").read_text()
    edited = re.sub(r"\d+\.\d+x", "9.99x", text, count=1)
    assert edited != text and docs_tables.render(edited) == text
