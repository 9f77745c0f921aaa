"""No unsafe deserialisation anywhere in the project's sources.

Serving stacks of this kind have shipped remote code execution through pickle on network
paths. This scans every Python file we ship or run (by syntax tree, so a word in a string or
comment is not a finding) and fails on: importing pickle-like modules (pickle, cPickle,
_pickle, dill, cloudpickle, marshal, shelve, jsonpickle), calling eval/exec/compile or
`__import__` of those modules, `yaml.load`/`yaml.load_all` without a safe loader,
`torch.load` without `weights_only=True`, and `numpy.load(..., allow_pickle=True)`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("tandem", "shared", "services", "benchmarks", "tests")
UNSAFE_MODULES = {
    "pickle",
    "cPickle",
    "_pickle",
    "dill",
    "cloudpickle",
    "marshal",
    "shelve",
    "jsonpickle",
}
UNSAFE_BUILTINS = {"eval", "exec", "compile"}
SAFE_YAML_LOADERS = {"SafeLoader", "CSafeLoader", "BaseLoader"}


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def _keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _is_true(node: ast.expr | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def findings(source: str, filename: str = "<source>") -> list[str]:
    """What is unsafe in one file, as `file:line: why`."""
    out = []
    for node in ast.walk(ast.parse(source, filename)):
        line = f"{filename}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            out += [f"{line}: imports {a.name}" for a in node.names if _root(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.module and _root(node.module):
            out.append(f"{line}: imports from {node.module}")
        elif isinstance(node, ast.Call):
            why = _unsafe_call(node)
            if why:
                out.append(f"{line}: {why}")
    return out


def _root(module: str) -> bool:
    return module.split(".")[0] in UNSAFE_MODULES


def _unsafe_call(call: ast.Call) -> str | None:
    name = _dotted(call.func)
    if name in UNSAFE_BUILTINS or name in {f"builtins.{b}" for b in UNSAFE_BUILTINS}:
        return f"calls {name}()"
    if name in ("__import__", "importlib.import_module") and call.args:
        arg = call.args[0]
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and _root(arg.value):
            return f"imports {arg.value} dynamically"
    if name.endswith("yaml.load") or name.endswith("yaml.load_all") or name == "load_all":
        loader = _keyword(call, "Loader") or (call.args[1] if len(call.args) > 1 else None)
        if loader is None or _dotted(loader).split(".")[-1] not in SAFE_YAML_LOADERS:
            return f"{name} without a safe Loader"
    if name == "torch.load" and not _is_true(_keyword(call, "weights_only")):
        return "torch.load without weights_only=True"
    if name in ("np.load", "numpy.load") and _is_true(_keyword(call, "allow_pickle")):
        return f"{name} with allow_pickle=True"
    return None


def test_project_sources_have_no_unsafe_deserialisation() -> None:
    files = [p for d in SCANNED for p in sorted((ROOT / d).rglob("*.py"))]
    assert len(files) > 50  # the scan really saw the project
    found = [f for p in files for f in findings(p.read_text(), str(p.relative_to(ROOT)))]
    assert not found, "\n".join(found)


@pytest.mark.parametrize(
    "snippet",
    [
        "import pickle",
        "import dill as d",
        "from marshal import loads",
        "from pickle import loads as l",
        "x = eval('1')",
        "exec(code)",
        "builtins.exec(code)",
        "m = __import__('pickle')",
        "import yaml\nyaml.load(s)",
        "import yaml\nyaml.load(s, Loader=yaml.Loader)",
        "import yaml\nyaml.load(s, yaml.UnsafeLoader)",
        "import torch\ntorch.load(f)",
        "import torch\ntorch.load(f, weights_only=False)",
        "import numpy as np\nnp.load(f, allow_pickle=True)",
    ],
)
def test_the_scan_catches_each_unsafe_form(snippet: str) -> None:
    assert findings(snippet), snippet


@pytest.mark.parametrize(
    "snippet",
    [
        "import yaml\nyaml.load(s, Loader=yaml.SafeLoader)",
        "import yaml\nyaml.safe_load(s)",
        "import torch\ntorch.load(f, weights_only=True)",
        "import numpy as np\nnp.load(f)",
        "text = 'import pickle; eval(x)'  # words in strings and comments are fine",
        "model.eval()",
        "import msgspec\nmsgspec.msgpack.decode(b)",
    ],
)
def test_safe_forms_pass(snippet: str) -> None:
    assert not findings(snippet), snippet
