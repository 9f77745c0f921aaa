"""The `tandem` console script: one sub-command per tool or service."""

from __future__ import annotations

import argparse
import sys

from services.decode import main as decode_main
from services.kvcache import main as kvcache_main
from services.prefill import main as prefill_main
from services.router import main as router_main
from tandem import __version__, generate, purge, up
from tandem.autoscale import command as autoscale_command
from tandem.bench import cli as bench_cli
from tandem.plan import cli as plan_cli


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tandem", description="Tandem: disaggregated LLM inference server"
    )
    parser.add_argument("--version", action="version", version=f"tandem {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    generate.add_parser(sub)
    up.add_parser(sub)
    router_main.add_parser(sub)
    prefill_main.add_parser(sub)
    decode_main.add_parser(sub)
    kvcache_main.add_parser(sub)
    bench_cli.add_parser(sub)
    plan_cli.add_parser(sub)
    autoscale_command.add_parser(sub)
    purge.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
