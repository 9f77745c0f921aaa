"""The simulator's hot modules compiled with mypyc, for simulations of large clusters.

A simulation decides with the router's and the engine scheduler's own Python, so its time
goes to that code (docs/benchmarks-log.md, "Simulator speed"). mypyc compiles those modules,
unchanged, into C extensions: the same decisions and the same records to the bit, about
2.6x as fast. `tandem plan compile` builds them (once per version of their sources, ~20 s
on 2 cores) into the cache (`TANDEM_CACHE`, default `~/.cache/tandem`, under
`simulator/`); `tandem plan simulate` and `search` then load them, and run the sources
when there is no build for the sources as they are (`TANDEM_SIM_COMPILED=off`: the
sources always).

The compiled modules must be imported before their sources are: two copies of a class
would not mix. So the `tandem` command loads them (`activate`, tandem/main.py) before it
imports anything else, for those two commands only; no service ever runs compiled code.
A build is keyed by the hash of every compiled source, of this module, mypyc's version
and Python's, so an edited source is never shadowed by an older build.

What the compiled modules' code must hold to: mypyc checks declared types at run time,
including mypy's narrowing (a field assigned None, then read back after a call that may
have set it, is taken to still be None: a TypeError). Their own tests run on the build
too (tests/integration/test_compiled_simulator.py).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType

from shared.model.convert import cache_root  # (imports none of MODULES)

ROOT = Path(__file__).resolve().parents[2]  # the checkout (or site-packages) holding the packages
# The modules compiled: the simulator and everything it decides with, each with the
# modules its classes cross into (a compiled class's instances go only where the code
# handling them is compiled too, or pure code that reads them as any object).
MODULES = (
    "shared.engine.sequence",
    "shared.engine.prefill_steps",
    "shared.engine.scheduler",
    "shared.kv.block_pool",
    "shared.costs.model",
    "services.router.nodes",
    "services.router.routing",
    "services.router.conditional",
    "services.router.placement",
    "tandem.bench.metrics",
    "tandem.plan.topology",
    "tandem.plan.simengine",
    "tandem.plan.simnodes",
    "tandem.plan.simprefill",
    "tandem.plan.simscale",
    "tandem.plan.simulator",
)
# `tandem plan ...` commands that only simulate (validate also runs a stack and a client)
PLAN_COMMANDS = ("simulate", "search")
ENV_SWITCH = "TANDEM_SIM_COMPILED"  # "on" (default: use a build if there is one) or "off"
BUILD_TIMEOUT = 1800.0  # seconds; ~20 s on 2 cores
PROGRESS_EVERY = 15.0  # seconds between lines of progress during a build
EXT = sysconfig.get_config_var("EXT_SUFFIX") or ".so"


def source(module: str) -> Path:
    return ROOT.joinpath(*module.split(".")).with_suffix(".py")


def key() -> str:
    """What a build depends on: every compiled source, how it is built (this module),
    mypyc's version, Python's."""
    digest = hashlib.sha256(Path(__file__).read_bytes())
    for module in MODULES:
        digest.update(module.encode() + b"\0" + source(module).read_bytes())
    digest.update(_mypyc_version().encode() + sys.version.encode())
    return digest.hexdigest()[:20]


def _mypyc_version() -> str:
    try:
        from mypy.version import __version__
    except ImportError:
        return "none"
    return __version__


def build_dir() -> Path:
    return cache_root() / "simulator" / key()


def wanted() -> bool:
    choice = os.environ.get(ENV_SWITCH, "on").strip().lower()
    if choice not in ("on", "off"):
        raise ValueError(f"{ENV_SWITCH} must be 'on' or 'off', not {choice!r}")
    return choice == "on"


def built() -> dict[str, Path] | None:
    """Every compiled module of the current sources by name (the group's runtime library
    too), or None when they are not built."""
    where = build_dir()
    if not (where / "complete").exists():
        return None
    found = {}
    for path in where.rglob(f"*{EXT}"):
        parts = path.relative_to(where).with_name(path.name[: -len(EXT)]).parts
        found[".".join(parts)] = path
    return found if all(m in found for m in MODULES) else None


class _Finder(importlib.abc.MetaPathFinder):
    """Finds the compiled modules before the sources' finders do."""

    def __init__(self, modules: dict[str, Path]) -> None:
        self.modules = modules

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        where = self.modules.get(fullname)
        if where is None:
            return None
        return importlib.util.spec_from_file_location(fullname, where)


def activate() -> bool:
    """Load the compiled modules from now on, if they are built for the current sources,
    wanted, and none of them was imported yet (then the sources stay): whether they will."""
    if not wanted() or any(m in sys.modules for m in MODULES):
        return False
    modules = built()
    if modules is None:
        return False
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder(modules))
    return True


def active() -> bool:
    """Whether the simulator running in this process is the compiled one."""
    module = sys.modules.get("tandem.plan.simulator")
    return module is not None and not (getattr(module, "__file__", "") or "").endswith(".py")


def activate_for(argv: Sequence[str]) -> bool:
    """`activate`, if the command line (without the program) runs a simulation."""
    if len(argv) >= 2 and argv[0] == "plan" and argv[1] in PLAN_COMMANDS:
        return activate()
    return False


BUILD_SCRIPT = r"""
import sys
from setuptools import setup
from mypyc.build import mypycify

work, files = sys.argv[1], sys.argv[2:]
# Tandem's own modules are read for their types; other packages are not (Any to mypyc:
# read as any Python object), which spares analysing torch and the rest (minutes).
with open(work + "/mypy.ini", "w") as config:
    config.write(
        "[mypy]\nignore_missing_imports = True\nfollow_imports = skip\n"
        "[mypy-shared.*,services.*,tandem.*,msgspec.*]\nfollow_imports = silent\n"
    )
flags = ["--config-file", work + "/mypy.ini"]
setup(
    name="tandem-simulator",
    ext_modules=mypycify(flags + files, opt_level="3", target_dir=work + "/c"),
    script_args=["build_ext", "--build-lib", work + "/out", "--build-temp", work + "/tmp",
                 "--parallel", "2"],
)
"""


def build(progress: Callable[[str], None] = print) -> Path:
    """Compile the modules for the current sources, unless they are built: where they
    are. Several processes may build at once: each in a directory of its own, the first
    one done renamed into place."""
    target = build_dir()
    if built() is not None:
        return target
    try:
        import mypyc.build  # noqa: F401  (a build needs it; loading the result does not)
    except ImportError as exc:
        raise RuntimeError(
            "compiling the simulator needs mypy: pip install 'tandem[plan]'"
        ) from exc
    if shutil.which(os.environ.get("CC", "cc")) is None:
        raise RuntimeError("no C compiler (set CC, or install gcc)")
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="build-", dir=target.parent))
    files = [str(source(m)) for m in MODULES]
    # mypy keeps its cache in the build's directory, not the checkout's
    env = {**os.environ, "MYPYPATH": str(ROOT), "MYPY_CACHE_DIR": str(work / "mypy")}
    progress(
        f"compiling the simulator's {len(MODULES)} modules with mypyc"
        " (once per version of their sources, ~20 s)"
    )
    started = time.monotonic()
    try:
        with subprocess.Popen(
            [sys.executable, "-c", BUILD_SCRIPT, str(work), *files],
            cwd=work,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        ) as proc:
            output = _wait(proc, started, progress)
        if proc.returncode != 0:
            tail = "\n".join(output[-30:])
            raise RuntimeError(f"the simulator's build failed (exit {proc.returncode}):\n{tail}")
        (work / "out" / "complete").write_text(key() + "\n")
        try:
            (work / "out").rename(target)
        except OSError:  # another build finished first: its result serves
            if built() is None:
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    progress(f"compiled in {time.monotonic() - started:.0f} s: {target}")
    return target


def _wait(
    proc: subprocess.Popen[str], started: float, progress: Callable[[str], None]
) -> list[str]:
    """Its output lines, once it ended (within BUILD_TIMEOUT), with a line of progress
    every PROGRESS_EVERY seconds meanwhile (mypy checks the sources, then the C compiler
    runs, both quietly)."""
    assert proc.stdout is not None
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout or ()), daemon=True)
    reader.start()
    while True:
        try:
            proc.wait(timeout=PROGRESS_EVERY)
            break
        except subprocess.TimeoutExpired:
            elapsed = time.monotonic() - started
            if elapsed > BUILD_TIMEOUT:
                proc.kill()
                proc.wait()
                raise RuntimeError(
                    f"the simulator's build took over {BUILD_TIMEOUT:.0f} s"
                ) from None
            stage = (
                "compiling C"
                if any("gcc" in ln or "cc " in ln for ln in lines)
                else "type-checking"
            )
            progress(f"  ... {elapsed:.0f} s ({stage})")
    reader.join(timeout=10)
    return [ln.rstrip("\n") for ln in lines]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "compile",
        help="compile the simulator with mypyc: simulate and search then run ~2.6x as fast",
    )
    p.add_argument("--check", action="store_true", help="only say whether it is compiled")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.check:
        there = built() is not None
        print(f"{'compiled' if there else 'not compiled'} for these sources: {build_dir()}")
        return 0 if there else 1
    try:
        build()
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def describe() -> str:
    """Which simulator this process runs, for the commands' output."""
    if active():
        return "the compiled simulator"
    if built() is None:
        return "the simulator's sources (`tandem plan compile` makes it ~2.6x faster)"
    return "the simulator's sources"
