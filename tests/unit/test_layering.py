"""The layout's rules, checked on the source: who may import whom, and what the light
processes load.

- `shared/` imports no service and not the `tandem` command; a service imports no other
  service and not the `tandem` command (services meet only through `shared/`).
- No import cycle between modules: function-level imports count, and so do `TYPE_CHECKING`
  ones (they never run, but two modules that name each other's types are one design).
- The engine and the planes meet only in `shared/connector/`: the engine imports nothing of
  the bus, the data plane or the kvcache client, and none of those imports the engine.
- Prefill and decode nodes reach the engine only through its interface
  (shared/engine/interface.py, its types, and `prefill_steps` over it); the one engine they
  run is built for them by shared/runtime/engine.py.
- Prefill and decode nodes move KV only through the connector: they import neither the
  data plane, nor the kvcache client, nor the hand-off and checkpoint messages.
- The router and the kvcache node load neither torch nor transformers' model code.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("shared", "services", "tandem")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path) -> set[str]:
    """Modules of the project a file imports, anywhere in it."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in found if name.split(".")[0] in PACKAGES}


def graph(names: bool = False) -> dict[str, set[str]]:
    """Module → the project's modules it imports (`names`: and the names it imports from
    them, as `module.name`)."""
    files = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")]
    modules = {module_name(p): p for p in files}
    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        # `from a.b import c` names module a.b.c if it exists, else the object c of a.b
        found = imports(path)
        edges[name] = {
            m for m in found if (m in modules or (names and m.rpartition(".")[0] in modules))
        } - {name}
    return edges


def test_shared_and_services_import_no_service_and_not_the_command() -> None:
    bad = []
    for name, deps in graph().items():
        top = name.split(".")
        for dep in deps:
            dtop = dep.split(".")
            if top[0] in ("shared", "services") and dtop[0] == "tandem":
                bad.append(f"{name} -> {dep}")
            if top[0] == "shared" and dtop[0] == "services":
                bad.append(f"{name} -> {dep}")
            if top[0] == "services" and dtop[0] == "services" and dtop[1] != top[1]:
                bad.append(f"{name} -> {dep}")
    assert not bad, "\n".join(sorted(bad))


ENGINE = ("shared.engine",)
PLANES = ("shared.bus", "shared.transport", "shared.kvclient")


def under(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def crossings(edges: dict[str, set[str]]) -> list[str]:
    """Imports between the engine and the planes, either way."""
    bad = []
    for name, deps in edges.items():
        for dep in deps:
            if (under(name, ENGINE) and under(dep, PLANES)) or (
                under(name, PLANES) and under(dep, ENGINE)
            ):
                bad.append(f"{name} -> {dep}")
    return sorted(bad)


def test_engine_and_planes_meet_only_in_the_connector() -> None:
    assert crossings(graph()) == []


def test_the_crossing_finder_finds_both_ways() -> None:
    edges = {
        "shared.engine.engine": {"shared.bus.messages", "shared.kv.tail"},
        "shared.kvclient.client": {"shared.engine.types"},
        "shared.connector.snapshots": {"shared.engine.types", "shared.bus.messages"},
    }
    assert crossings(edges) == [
        "shared.engine.engine -> shared.bus.messages",
        "shared.kvclient.client -> shared.engine.types",
    ]


NODES = ("services.prefill", "services.decode")
SEAM = ("shared.engine.interface", "shared.engine.types", "shared.engine.prefill_steps")


def past_the_seam(edges: dict[str, set[str]]) -> list[str]:
    """Imports of engine internals (or the model stack) by a prefill or decode node."""
    inside = ("shared.engine", "shared.model")
    return sorted(
        f"{name} -> {dep}"
        for name, deps in edges.items()
        if under(name, NODES)
        for dep in deps
        if under(dep, inside) and not under(dep, SEAM)
    )


def test_nodes_use_the_engine_only_through_its_interface() -> None:
    assert past_the_seam(graph()) == []


def test_the_seam_check_finds_a_reach_past_it() -> None:
    edges = {
        "services.decode.worker": {"shared.engine.interface", "shared.engine.engine"},
        "services.prefill.worker": {"shared.model.loader", "shared.engine.types"},
        "services.router.app": {"shared.engine.engine"},
    }
    assert past_the_seam(edges) == [
        "services.decode.worker -> shared.engine.engine",
        "services.prefill.worker -> shared.model.loader",
    ]


KV_PLANES = (
    "shared.transport",
    "shared.kvclient",
    "shared.bus.messages.DecodeAssignment",
    "shared.bus.messages.SequenceSnapshot",
    "shared.bus.messages.CheckpointRecord",
)


def kv_moves_outside_the_connector(edges: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{name} -> {dep}"
        for name, deps in edges.items()
        if under(name, NODES)
        for dep in deps
        if under(dep, KV_PLANES)
    )


def test_nodes_move_kv_only_through_the_connector() -> None:
    assert kv_moves_outside_the_connector(graph(names=True)) == []


def test_the_kv_moves_check_finds_one() -> None:
    edges = {
        "services.decode.worker": {"shared.transport.base", "shared.connector.planes"},
        "services.prefill.handoff": {"shared.bus.messages.DecodeAssignment"},
        "shared.connector.sender": {"shared.bus.messages.DecodeAssignment"},
    }
    assert kv_moves_outside_the_connector(edges) == [
        "services.decode.worker -> shared.transport.base",
        "services.prefill.handoff -> shared.bus.messages.DecodeAssignment",
    ]


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles() -> None:
    edges = graph()
    # a package's __init__ importing nothing of its own keeps package edges out of this
    assert cycles(edges) == []


def test_the_cycle_finder_finds_one() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# the console script too: `tandem router` runs through tandem.cli, which names every command
@pytest.mark.parametrize("module", ["services.router.main", "services.kvcache.main", "tandem.cli"])
def test_light_services_load_no_torch(module: str) -> None:
    code = (
        f"import {module}, sys; "
        "heavy = [m for m in sys.modules if m == 'torch' or m.startswith('transformers.models')]; "
        "print(heavy)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
