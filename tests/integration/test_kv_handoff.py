"""Prefill in one process, KV as bytes, decode in another: tokens equal an uninterrupted run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from shared.bus.messages import SequenceSnapshot
from shared.connector.snapshots import from_wire
from shared.engine.engine import Engine, EngineConfig
from shared.engine.types import SequenceState
from shared.model.loader import LoadedModel
from tests.integration.kv_worker import GREEDY, SAMPLED
from tests.integration.prompts import varied_prompts

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def run_worker(out: Path, mode: str) -> None:
    subprocess.run(
        [sys.executable, "-m", "tests.integration.kv_worker", str(out), mode],
        cwd=ROOT,
        check=True,
        timeout=300,
    )


def drain(engine: Engine) -> dict[str, list[int]]:
    got: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
    return got


def load(out: Path, name: str) -> tuple[SequenceState, bytes]:
    """A snapshot as the wire carried it, mapped back to the engine's state."""
    snap = msgspec.msgpack.decode((out / f"{name}.snap").read_bytes(), type=SequenceSnapshot)
    return from_wire(snap), (out / f"{name}.kv").read_bytes()


def test_prefill_export_import_decode_across_processes(
    real_model: LoadedModel, tmp_path: Path
) -> None:
    run_worker(tmp_path, "prefill")
    prompts = varied_prompts(real_model)[:4]
    reference = Engine(real_model, EngineConfig(num_blocks=512)).generate(prompts, GREEDY)
    decode = Engine(real_model, EngineConfig(num_blocks=512))
    first: dict[str, list[int]] = {}
    for i in range(len(prompts)):
        snap, frame = load(tmp_path, f"r{i}")
        assert snap.prompt_ids == prompts[i] and snap.num_computed == len(prompts[i])
        first[snap.request_id] = list(snap.output_ids)
        decode.add_snapshot(snap, frame)
    rest = drain(decode)
    for i in range(len(prompts)):
        assert first[f"r{i}"] + rest.get(f"r{i}", []) == reference[i], f"prompt {i}"
    assert decode.pool.num_used == 0


def test_seeded_sampling_resumes_in_another_process(
    real_model: LoadedModel, tmp_path: Path
) -> None:
    run_worker(tmp_path, "sampled")
    prompt = varied_prompts(real_model)[0]
    reference = Engine(real_model, EngineConfig(num_blocks=512)).generate([prompt], SAMPLED)[0]
    snap, frame = load(tmp_path, "s0")
    assert len(snap.output_ids) == 11
    decode = Engine(real_model, EngineConfig(num_blocks=512))
    decode.add_snapshot(snap, frame)
    assert list(snap.output_ids) + drain(decode)["s0"] == reference
