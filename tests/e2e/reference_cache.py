"""The chaos workload's uninterrupted reference, kept in the repository between runs.

Computing it (32 greedy streams of ~205 tokens in one engine) costs ~3.5 minutes of CI on
2 cores, and its result is the same every run on the same model, torch and workload. The
file keeps it under a fingerprint of exactly those. A run trusts the file only if the
fingerprint matches *and* a spot check holds: the request with the longest prompt is run
again, alone, now, and its first tokens must be the stored ones (float rounding can differ
on another CPU, which no fingerprint shows). Otherwise the whole reference is computed as before and
the run says why; `python -m tests.e2e.reference_cache` rewrites the file.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import torch
import transformers

from shared.model.loader import LoadedModel
from tests.e2e.chaos import Request, chaos_requests, reference

FILE = Path(__file__).resolve().parent / "data" / "chaos_reference.json"
FORMAT = 1
SPOT_TOKENS = 48  # enough to catch different rounding; all 200 would cost ~30 s


def fingerprint(model_dir: Path, requests: list[Request]) -> dict[str, Any]:
    """What the reference depends on besides the engine (checked by the spot check)."""
    work = json.dumps([[r.prompt_ids, r.max_tokens] for r in requests]).encode()
    return {
        "format": FORMAT,
        "model": model_dir.name,  # the converted copy's name carries its source's digest
        "dtype": "float32",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "workload": hashlib.sha256(work).hexdigest(),
    }


def spot_index(requests: list[Request]) -> int:
    """The request the spot check runs again: the longest prompt, the likeliest to drift."""
    return max(range(len(requests)), key=lambda i: len(requests[i].prompt_ids))


def load(
    model: LoadedModel, model_dir: Path, requests: list[Request]
) -> tuple[list[list[str]] | None, str]:
    """The stored reference if it still holds here, else None; and why, in words."""
    try:
        stored = json.loads(FILE.read_text())
    except (OSError, ValueError) as exc:
        return None, f"no usable stored reference ({exc})"
    if stored.get("fingerprint") != fingerprint(model_dir, requests):
        return None, "stored reference is for another model, torch or workload"
    texts = stored.get("texts")
    if not isinstance(texts, list) or len(texts) != len(requests):
        return None, "stored reference has the wrong shape"
    i = spot_index(requests)
    again = Request(requests[i].prompt_ids, SPOT_TOKENS)
    if reference(model, [again])[0] != texts[i][:SPOT_TOKENS]:
        return None, f"request {i} run now differs from the stored reference"
    return texts, f"stored reference (request {i}'s first {SPOT_TOKENS} tokens checked again now)"


def save(model_dir: Path, requests: list[Request], texts: list[list[str]]) -> None:
    FILE.parent.mkdir(exist_ok=True)
    record = {"fingerprint": fingerprint(model_dir, requests), "texts": texts}
    FILE.write_text(json.dumps(record, ensure_ascii=False, indent=0) + "\n")


def main() -> int:
    """Compute the reference on this machine and store it (minutes)."""
    from shared.model.convert import converted_dir
    from shared.model.loader import load_model
    from shared.model.source import resolve_model

    model_dir = converted_dir(resolve_model(None))
    model = load_model(None, dtype="float32", device="cpu")
    requests = chaos_requests(model)
    print(f"computing the reference of {len(requests)} requests...", file=sys.stderr)
    save(model_dir, requests, reference(model, requests))
    print(f"wrote {FILE}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
