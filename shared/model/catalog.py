"""A models file: the models a cluster serves, each with its own dtype and request limits.

`tandem up --models-file F` and `tandem router --models-file F` read it (TOML):

    [[model]]
    name = "smollm2"                    # the served name: a request's `model`
    source = "smollm2-135m-instruct"    # the default model's name, an HF directory or a .gguf
    dtype = "float32"                   # optional: the command's --dtype otherwise

    [[model]]
    name = "smollm2-bf16"
    source = "smollm2-135m-instruct"
    dtype = "bfloat16"
    max_tokens_limit = 512              # optional: this model's own --max-tokens-limit
    max_prompt_tokens = 1024            # optional: and its own --max-prompt-tokens

Each entry becomes a `--model NAME=SOURCE` with its `--dtype` for that model's nodes, and
the router checks that model's requests against its limits. A mistake in the file is one
clear error naming the entry and the key, before anything starts.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

DTYPES = ("float32", "bfloat16", "float16")
KEYS = {"name", "source", "dtype", "max_tokens_limit", "max_prompt_tokens"}


class ModelsFileError(ValueError):
    """The models file cannot be read or says something invalid."""


@dataclass(frozen=True)
class ModelEntry:
    name: str | None  # None: the source's own served name (a plain `--model SOURCE`)
    source: str
    dtype: str | None = None  # None: the command's --dtype
    max_tokens_limit: int | None = None  # None: the router's --max-tokens-limit
    max_prompt_tokens: int | None = None  # None: the router's --max-prompt-tokens

    @property
    def option(self) -> str:
        """The `--model` value naming this model: NAME=SOURCE (SOURCE without a name)."""
        return self.source if self.name is None else f"{self.name}={self.source}"


def read_models_file(path: str | Path) -> list[ModelEntry]:
    """The file's models, in order; `ModelsFileError` says what is wrong with it."""
    try:
        doc = tomllib.loads(Path(path).read_text())
    except OSError as exc:
        raise ModelsFileError(f"models file {path}: {exc.strerror or exc}") from exc
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ModelsFileError(f"models file {path} is not valid TOML: {exc}") from exc
    extra = set(doc) - {"model"}
    if extra:
        raise ModelsFileError(f"models file {path}: unknown table(s) {sorted(extra)}")
    tables = doc.get("model")
    if not isinstance(tables, list) or not tables:
        raise ModelsFileError(f"models file {path} has no [[model]] entry")
    entries = [_entry(t, i + 1, path) for i, t in enumerate(tables)]
    names = [e.name or "" for e in entries]  # every entry of a file has its name
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ModelsFileError(f"models file {path}: model name(s) given twice: {twice}")
    return entries


def _entry(table: object, number: int, path: str | Path) -> ModelEntry:
    where = f"models file {path}, model {number}"
    if not isinstance(table, dict):
        raise ModelsFileError(f"{where}: not a table")
    unknown = set(table) - KEYS
    if unknown:
        raise ModelsFileError(f"{where}: unknown key(s) {sorted(unknown)}")
    name, source = table.get("name"), table.get("source")
    for key, value in (("name", name), ("source", source)):
        if not isinstance(value, str) or not value.strip():
            raise ModelsFileError(f"{where}: '{key}' is required and must be a non-empty string")
    assert isinstance(name, str) and isinstance(source, str)
    if "=" in name or "," in name or name != name.strip():
        raise ModelsFileError(f"{where}: 'name' may not contain '=', ',' or outer spaces")
    dtype = table.get("dtype")
    if dtype is not None and dtype not in DTYPES:
        raise ModelsFileError(f"{where}: 'dtype' must be one of {', '.join(DTYPES)}")
    limits: dict[str, int | None] = {}
    for key in ("max_tokens_limit", "max_prompt_tokens"):
        value = table.get(key)
        positive = isinstance(value, int) and not isinstance(value, bool) and value >= 1
        if value is not None and not positive:
            raise ModelsFileError(f"{where}: '{key}' must be a positive integer")
        limits[key] = value
    return ModelEntry(name, source, dtype, limits["max_tokens_limit"], limits["max_prompt_tokens"])
