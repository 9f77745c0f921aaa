"""Each test's time, kept from run to run, so that a slower suite shows where it slowed.

The suite writes every test's seconds (setup, call and teardown) to `test-durations.json`
(`TANDEM_DURATIONS_FILE` to put it elsewhere) when it ends, through tests/conftest.py.
`python -m tests.durations [FILE]` prints the time per test file, slowest first, beside
the committed baseline (tests/durations-baseline.json, a whole run on a 2-core host) and
their ratio; `.ci/run` prints it after every run, so each CI log carries its own figures
and their comparison. Run it with `--save-baseline` to make FILE the new baseline.
"""

from __future__ import annotations

import argparse
import json
import os
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASELINE = ROOT / "tests" / "durations-baseline.json"


def output_path() -> Path:
    return Path(os.environ.get("TANDEM_DURATIONS_FILE") or ROOT / "test-durations.json")


def write(seconds: dict[str, float], path: Path) -> None:
    doc = {
        "total": round(sum(seconds.values()), 2),
        "tests": {k: round(v, 3) for k, v in seconds.items()},
    }
    path.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")


def per_file(path: Path) -> dict[str, float]:
    tests = json.loads(path.read_text())["tests"]
    files: dict[str, float] = defaultdict(float)
    for nodeid, seconds in tests.items():
        files[nodeid.split("::", 1)[0]] += seconds
    return dict(files)


def table(run: dict[str, float], base: dict[str, float]) -> str:
    lines = [f"{'seconds':>8} {'baseline':>8} {'ratio':>6}  file"]
    for name, seconds in sorted(run.items(), key=lambda kv: -kv[1]):
        before = base.get(name)
        ratio = f"{seconds / before:6.2f}" if before else f"{'new':>6}"
        shown = f"{before:8.1f}" if before is not None else f"{'-':>8}"
        lines.append(f"{seconds:8.1f} {shown} {ratio}  {name}")
    total, total_base = sum(run.values()), sum(base.get(n, 0.0) for n in run)
    lines.append(f"{total:8.1f} {total_base:8.1f} {'':>6}  (all files; baseline of the same)")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("file", nargs="?", default=str(output_path()))
    p.add_argument("--save-baseline", action="store_true")
    args = p.parse_args()
    path = Path(args.file)
    if not path.exists():
        print(f"no durations file at {path}: did the suite run?")
        return 1
    if args.save_baseline:
        BASELINE.write_text(path.read_text())
        print(f"baseline saved: {BASELINE}")
        return 0
    base = per_file(BASELINE) if BASELINE.exists() else {}
    print(table(per_file(path), base))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
