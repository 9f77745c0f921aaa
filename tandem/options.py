"""Command-line options that also read `TANDEM_<OPTION>` environment variables.

Every option of every `tandem` command can be set from the environment (what compose and
Kubernetes use): `--max-tokens` reads `TANDEM_MAX_TOKENS`, `--nats` reads `TANDEM_NATS`, and
so on. An explicit flag wins over the environment, which wins over the default.
"""

from __future__ import annotations

import argparse
import os
from typing import Any


def env_name(flag: str) -> str:
    return "TANDEM_" + flag.lstrip("-").replace("-", "_").upper()


def add_option(parser: argparse.ArgumentParser, flag: str, **kwargs: Any) -> None:
    """`parser.add_argument(flag, ...)` with its default taken from the environment if set."""
    env = env_name(flag)
    raw = os.environ.get(env)
    if raw is not None:
        if kwargs.get("action") == "store_true":
            kwargs["default"] = raw.strip().lower() in ("1", "true", "yes", "on")
        elif kwargs.get("action") == "append":
            kwargs["default"] = [v for v in raw.split(",") if v]
        else:
            convert = kwargs.get("type", str)
            try:
                kwargs["default"] = convert(raw)
            except (TypeError, ValueError) as exc:
                raise SystemExit(f"error: {env}={raw!r} is not a valid value: {exc}") from exc
    help_text = kwargs.get("help", "")
    kwargs["help"] = f"{help_text} [env {env}]".strip()
    parser.add_argument(flag, **kwargs)


def add_model_options(parser: argparse.ArgumentParser) -> None:
    add_option(
        parser,
        "--model",
        default="smollm2-135m-instruct",
        help="served name, Hugging Face directory or .gguf file",
    )
    add_option(parser, "--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    add_option(parser, "--device", default="auto", choices=["auto", "cpu", "cuda"])
    add_option(parser, "--threads", type=int, default=None, help="torch threads (default: cores)")
