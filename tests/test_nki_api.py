"""The NKI kernels and the emulator against AWS's published NKI API, and the custom-op boundary against
torch-neuronx's.

``backends/nki/aws_signatures.py`` is a table of the names, parameters and defaults of ``nki``,
``nki.language`` and ``nki.isa`` generated from AWS's API-reference stubs (github
aws-neuron/aws-neuron-sdk, ``nki/api/nki/**/__init__.py``; commit in the table), and of torch-neuronx's
``nki_op`` (its source, ``torch_neuronx/nki_hop.py``; repository and commit in the table), by
``backends/nki/tools/vendor_signatures.py``. Here every ``nki.`` / ``nl.`` / ``nisa.`` call in the
kernel sources (walked as an AST) must bind to the published signature, every name they use must
be published, and the emulator's functions must take the same parameters with the same defaults; every
``nki_op`` call must bind to torch-neuronx's signature, and the test double of it must take its parameters.
"""

import ast
import inspect
import pathlib

import pytest

from portable_ops.backends.nki import aws_signatures, emulator
from portable_ops.backends.nki.emulator import tensors
from portable_ops.backends.nki.emulator import isa as emulated_isa
from portable_ops.backends.nki.emulator import language as emulated_language
from portable_ops.backends.nki.emulator import torch_neuronx as emulated_torch_neuronx

API = aws_signatures.API
KERNEL_DIR = pathlib.Path(__file__).resolve().parents[1] / "backends" / "nki"
KERNEL_FILES = ("adam.py", "sgd.py", "grad_norm.py", "attention_tiles.py", "attention_forward.py",
                "attention_backward.py", "norms.py", "linear_cross_entropy.py", "rope.py", "paged_attention.py",
                "paged_kv_append.py")
EMULATED = {"nki": emulator, "nki.language": emulated_language, "nki.isa": emulated_isa}


def _signature(params) -> inspect.Signature:
    return inspect.Signature([inspect.Parameter(name, getattr(inspect.Parameter, kind),
                                                default=inspect.Parameter.empty if default is None else default)
                              for name, kind, default in params])


def _aliases(tree) -> dict[str, str]:
    """Local names of the NKI modules in a kernel file (``from .compat import nki, nisa, nl``)."""
    modules = {"nki": "nki", "nl": "nki.language", "nisa": "nki.isa"}
    found = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "compat":
            for alias in node.names:
                found[alias.asname or alias.name] = modules[alias.name]
    return found


def _dotted(node):
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id, *reversed(parts)]
    return None


def _uses(path):
    """(line, module, dotted name, call or None) for every reference to an NKI module's name."""
    tree = ast.parse(path.read_text())
    aliases = _aliases(tree)
    assert set(aliases.values()) >= {"nki.language", "nki.isa"}, f"{path.name} does not import NKI through compat"
    calls = {id(n.func): n for n in ast.walk(tree) if isinstance(n, ast.Call)}
    uses = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not isinstance(getattr(node, "ctx", None), ast.Load):
            continue
        parts = _dotted(node)
        if parts and parts[0] in aliases and len(parts) >= 2:
            uses.append((node.lineno, aliases[parts[0]], parts[1:], calls.get(id(node))))
    # the inner attribute of nisa.engine.gpsimd is also an Attribute node: keep the longest chains
    longest = {}
    for use in uses:
        key = (use[0], use[1], use[2][0])
        if key not in longest or len(use[2]) > len(longest[key][2]):
            longest[key] = use
    return list(longest.values())


@pytest.mark.parametrize("name", KERNEL_FILES)
def test_every_nki_call_in_the_kernels_binds_to_the_published_signature(name):
    path = KERNEL_DIR / name
    uses = _uses(path)
    assert uses, f"no NKI calls found in {name}"
    checked = 0
    for line, module, parts, call in uses:
        table = API[module]
        where = f"{name}:{line}: {module}.{'.'.join(parts)}"
        head = parts[0]
        published = set(table["functions"]) | set(table["enums"]) | set(table["names"])
        assert head in published, f"{where}: {head!r} is not in AWS's {module}"
        if head in table["enums"] and len(parts) > 1:
            assert parts[1] in table["enums"][head], f"{where}: {parts[1]!r} is not a member of {module}.{head}"
        if head == "tile_size" and len(parts) > 1:
            assert parts[1] in table["attributes"]["_TileSize"], f"{where}: not an nl.tile_size attribute"
        if call is not None and len(parts) == 1:
            assert head in table["functions"], f"{where}: called, but AWS's {module}.{head} is not a function"
            assert not any(isinstance(a, ast.Starred) for a in call.args) and all(k.arg for k in call.keywords), \
                f"{where}: *args/**kwargs cannot be checked statically"
            sig = _signature(table["functions"][head])
            try:
                sig.bind(*range(len(call.args)), **{k.arg: None for k in call.keywords})
            except TypeError as exc:
                pytest.fail(f"{where}{sig} does not bind: {exc}")
            checked += 1
    assert checked > 0


def test_a_call_that_does_not_bind_is_caught(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from .compat import nki, nisa, nl\n"
                   "def k(t):\n"
                   "    nisa.dma_copy(t, t, dst_rmw_op=nl.add)\n"  # the older API's keyword
                   "    nisa.activation(t, nl.exp, t, engine=None)\n")
    calls = [(parts, call) for _, module, parts, call in _uses(bad) if call is not None]
    failures = []
    for parts, call in calls:
        sig = _signature(API["nki.isa"]["functions"][parts[0]])
        try:
            sig.bind(*range(len(call.args)), **{k.arg: None for k in call.keywords})
        except TypeError:
            failures.append(parts[0])
    assert failures == ["dma_copy", "activation"]


def _published_default(source, module):
    """AWS's default expression, evaluated among the emulator's names (``engine.unknown`` -> the
    emulator's ``engine.unknown``, ``sbuf`` -> ``nl.sbuf``)."""
    namespace = {**vars(emulated_language), **vars(module)}
    return eval(source, namespace)  # noqa: S307  (expressions from the vendored table: literals and names)


def _defined_in(fn, module) -> bool:
    """``fn`` is ``module``'s own, not a helper it imports: the isa package's instructions are defined in its
    instruction-family modules."""
    family = module is emulated_isa and fn.__module__.startswith(module.__name__ + ".")
    return fn.__module__ == module.__name__ or family


@pytest.mark.parametrize("module_name", EMULATED)
def test_the_emulators_functions_take_the_published_parameters_and_defaults(module_name):
    module = EMULATED[module_name]
    table = API[module_name]["functions"]
    public = {name: fn for name, fn in vars(module).items()
              if inspect.isfunction(fn) and not name.startswith("_") and _defined_in(fn, module)}
    assert public, module_name
    invented = sorted(set(public) - set(table))
    assert not invented, f"emulator {module_name} defines functions AWS does not publish: {invented}"
    for name, fn in public.items():
        mine = list(inspect.signature(fn).parameters.values())
        theirs = table[name]
        assert [(p.name, p.kind.name) for p in mine] == [(n, k) for n, k, _ in theirs], \
            f"{module_name}.{name}{inspect.signature(fn)} vs AWS {_signature(theirs)}"
        for p, (_, _, default) in zip(mine, theirs):
            if default is None:
                assert p.default is inspect.Parameter.empty, f"{module_name}.{name}: {p.name} has a default, AWS none"
            else:
                expected = _published_default(default, module)
                assert p.default == expected or p.default is expected, \
                    f"{module_name}.{name}: {p.name}={p.default!r}, AWS {default} ({expected!r})"


def test_the_emulators_enums_and_tensor_methods_are_the_published_ones():
    for name, members in API["nki.isa"]["enums"].items():
        if hasattr(emulated_isa, name):
            assert [m.name for m in getattr(emulated_isa, name)] == members, name
    for name, params in API["nki.language"]["methods"]["NkiTensor"].items():
        if hasattr(tensors.Tensor, name):
            mine = list(inspect.signature(getattr(tensors.Tensor, name)).parameters)[1:]
            assert mine == [p for p, _, _ in params], f"NkiTensor.{name}"
    assert hasattr(tensors.Tensor, "reshape")


def test_every_name_the_kernels_use_exists_in_the_emulator():
    for name in KERNEL_FILES:
        for line, module, parts, _ in _uses(KERNEL_DIR / name):
            obj = EMULATED[module]
            for part in parts:
                assert hasattr(obj, part), f"{name}:{line}: emulator lacks {module}.{'.'.join(parts)}"
                obj = getattr(obj, part)


def test_the_table_says_where_it_came_from():
    assert aws_signatures.SOURCE_REPOSITORY == "https://github.com/aws-neuron/aws-neuron-sdk"
    assert len(aws_signatures.SOURCE_COMMIT) == 40
    assert set(API) == {"nki", "nki.language", "nki.isa"}
    assert "dma_copy" in API["nki.isa"]["functions"] and "ndarray" in API["nki.language"]["functions"]
    assert aws_signatures.TORCH_NEURONX_SOURCE_REPOSITORY.startswith("https://github.com/")
    assert len(aws_signatures.TORCH_NEURONX_SOURCE_COMMIT) == 40
    assert aws_signatures.TORCH_NEURONX_SOURCE_PATHS == {"torch_neuronx": "torch_neuronx/nki_hop.py"}


NKI_OP = aws_signatures.TORCH_NEURONX_API["torch_neuronx"]["functions"]["nki_op"]


def test_the_nki_op_double_takes_torch_neuronxs_parameters_and_defaults():
    mine = list(inspect.signature(emulated_torch_neuronx.nki_op).parameters.values())
    assert [(p.name, p.kind.name) for p in mine] == [(n, k) for n, k, _ in NKI_OP]
    for p, (_, _, default) in zip(mine, NKI_OP):
        assert (p.default is inspect.Parameter.empty if default is None else p.default == eval(default)), p.name  # noqa: S307


def test_every_nki_op_call_in_the_backend_binds_to_torch_neuronxs_signature():
    sig = _signature(NKI_OP)
    trees = {path.name: ast.parse(path.read_text()) for path in sorted(KERNEL_DIR.glob("*.py"))}
    calls = [(name, node) for name, tree in trees.items() for node in ast.walk(tree)
             if isinstance(node, ast.Call) and (_dotted(node.func) or [])[-1:] == ["nki_op"]]
    assert calls, "the backend registers its ops through nki_op"
    for name, call in calls:
        try:
            sig.bind(*range(len(call.args)), **{k.arg: None for k in call.keywords})
        except TypeError as exc:
            pytest.fail(f"{name}:{call.lineno}: nki_op{sig} does not bind: {exc}")
