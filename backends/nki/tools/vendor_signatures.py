"""Regenerate ``backends/nki/aws_signatures.py``: the names, parameters and defaults of NKI's public
API, read from AWS's API-reference stubs, and of torch-neuronx's ``nki_op``, read from its source, so a test can
check the kernels, the emulator and the custom-op boundary against them.

    python backends/nki/tools/vendor_signatures.py GIT_DIR [COMMIT] --torch-neuronx TORCH_NEURONX_GIT_DIR \
        [--torch-neuronx-commit COMMIT] --torch-neuronx-repository URL

``GIT_DIR`` is a clone (bare is fine) of github.com/aws-neuron/aws-neuron-sdk; the stubs are read
with ``git show COMMIT:nki/api/nki/...`` (default ``HEAD``) and parsed with ``ast``, never imported.
``TORCH_NEURONX_GIT_DIR`` is a clone of torch-neuronx's source (the native PyTorch backend), read the same way
(``torch_neuronx/nki_hop.py``, where ``nki_op`` is defined); ``URL`` names the repository it was cloned from.
Only facts go into the table (function and method names, parameter names, kinds and default
expressions, enum members, module-level names); AWS's docstrings and code are not copied.
"""

from __future__ import annotations

import argparse
import ast
import pathlib
import pprint
import subprocess
import sys

STUBS = {"nki": "nki/api/nki/__init__.py", "nki.language": "nki/api/nki/language/__init__.py",
         "nki.isa": "nki/api/nki/isa/__init__.py"}
CLASSES_WITH_METHODS = ("NkiTensor",)  # the tensor methods kernels may call (reshape, ...)
CLASSES_WITH_ATTRIBUTES = ("_TileSize",)  # nl.tile_size.pmax, ...
TORCH_NEURONX_SOURCE = {"torch_neuronx": "torch_neuronx/nki_hop.py"}
TORCH_NEURONX_FUNCTIONS = ("nki_op",)  # what the backend calls: the custom-op boundary
OUT = pathlib.Path(__file__).resolve().parents[1] / "aws_signatures.py"


def _params(fn: ast.FunctionDef, skip_self: bool) -> list[tuple[str, str, str | None]]:
    """(name, kind, default source or None) per parameter, kinds as inspect.Parameter names them."""
    a = fn.args
    positional = a.posonlyargs + a.args
    defaults = [None] * (len(positional) - len(a.defaults)) + [ast.unparse(d) for d in a.defaults]
    out = [(p.arg, "POSITIONAL_ONLY" if p in a.posonlyargs else "POSITIONAL_OR_KEYWORD", d)
           for p, d in zip(positional, defaults)]
    if a.vararg:
        out.append((a.vararg.arg, "VAR_POSITIONAL", None))
    out += [(p.arg, "KEYWORD_ONLY", None if d is None else ast.unparse(d)) for p, d in zip(a.kwonlyargs, a.kw_defaults)]
    if a.kwarg:
        out.append((a.kwarg.arg, "VAR_KEYWORD", None))
    return out[1:] if skip_self else out


def _is_enum(cls: ast.ClassDef) -> bool:
    return any(ast.unparse(b) in ("Enum", "enum.Enum") for b in cls.bases)


def module_table(source: str) -> dict:
    tree = ast.parse(source)
    functions, enums, methods, attributes, names = {}, {}, {}, {}, []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            functions[node.name] = _params(node, skip_self=False)
        elif isinstance(node, ast.ClassDef):
            names.append(node.name)
            if _is_enum(node):
                enums[node.name] = [t.id for s in node.body if isinstance(s, ast.Assign) for t in s.targets
                                    if isinstance(t, ast.Name)]
            if node.name in CLASSES_WITH_METHODS:
                methods[node.name] = {f.name: _params(f, skip_self=True) for f in node.body
                                      if isinstance(f, ast.FunctionDef) and not f.name.startswith("__")}
            if node.name in CLASSES_WITH_ATTRIBUTES:
                attributes[node.name] = sorted(
                    [s.target.id for s in node.body if isinstance(s, ast.AnnAssign)]
                    + [s.name for s in node.body if isinstance(s, ast.FunctionDef) and not s.name.startswith("_")])
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names += [t.id for t in targets if isinstance(t, ast.Name)]
    return {"functions": functions, "enums": enums, "methods": methods, "attributes": attributes,
            "names": sorted(set(names))}


def _read(git_dir, rev, paths):
    """(full commit, {module: source}) of ``paths`` at ``rev`` of the clone ``git_dir``."""
    commit = subprocess.run(["git", "-C", git_dir, "rev-parse", rev], check=True, capture_output=True,
                            text=True).stdout.strip()
    return commit, {module: subprocess.run(["git", "-C", git_dir, "show", f"{commit}:{path}"], check=True,
                                           capture_output=True, text=True).stdout for module, path in paths.items()}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("git_dir")
    parser.add_argument("commit", nargs="?", default="HEAD")
    parser.add_argument("--torch-neuronx", required=True, metavar="TORCH_NEURONX_GIT_DIR")
    parser.add_argument("--torch-neuronx-commit", default="HEAD")
    parser.add_argument("--torch-neuronx-repository", required=True, metavar="URL")
    args = parser.parse_args(argv)
    commit, sources = _read(args.git_dir, args.commit, STUBS)
    tables = {module: module_table(source) for module, source in sources.items()}
    torch_commit, torch_sources = _read(args.torch_neuronx, args.torch_neuronx_commit, TORCH_NEURONX_SOURCE)
    torch_tables = {}
    for module, source in torch_sources.items():
        functions = module_table(source)["functions"]
        torch_tables[module] = {"functions": {name: functions[name] for name in TORCH_NEURONX_FUNCTIONS}}
    header = (f'"""Generated by backends/nki/tools/vendor_signatures.py from github.com/aws-neuron/aws-neuron-sdk\n'
              f'at commit {commit} ({", ".join(STUBS.values())}),\n'
              f'and from {args.torch_neuronx_repository} at commit {torch_commit}\n'
              f'({", ".join(TORCH_NEURONX_SOURCE.values())}: {", ".join(TORCH_NEURONX_FUNCTIONS)}).\n\n'
              "Facts only: public names, parameter names, kinds and default expressions of NKI's API and of\n"
              "torch-neuronx's custom-op boundary.\n"
              'Do not edit by hand; rerun the script against a newer commit instead."""\n\n')
    body = (f"SOURCE_REPOSITORY = 'https://github.com/aws-neuron/aws-neuron-sdk'\nSOURCE_COMMIT = {commit!r}\n"
            f"SOURCE_PATHS = {STUBS!r}\n\nAPI = {pprint.pformat(tables, width=120, sort_dicts=True)}\n\n"
            f"TORCH_NEURONX_SOURCE_REPOSITORY = {args.torch_neuronx_repository!r}\n"
            f"TORCH_NEURONX_SOURCE_COMMIT = {torch_commit!r}\nTORCH_NEURONX_SOURCE_PATHS = {TORCH_NEURONX_SOURCE!r}\n\n"
            f"TORCH_NEURONX_API = {pprint.pformat(torch_tables, width=120, sort_dicts=True)}\n")
    OUT.write_text(header + body)
    print(f"wrote {OUT} from {commit} and {torch_commit}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
