"""Child process for the KV hand-off tests: prefill (and optionally decode) here, export to files.

Run as `python -m tests.integration.kv_worker OUT_DIR MODE`; MODE is `prefill` (greedy,
varied prompts, KV exported right after prefill) or `sampled` (seeded sampling, 10 decode
steps, then export mid-sequence).
"""

from __future__ import annotations

import sys
from pathlib import Path

import msgspec
import torch

from shared.connector.snapshots import to_wire
from shared.engine.engine import Engine, EngineConfig
from shared.engine.prefill_steps import prefill_and_export
from shared.model.loader import load_model
from shared.sampling_params import SamplingParams
from tests.integration.prompts import varied_prompts

GREEDY = SamplingParams(max_tokens=32, temperature=0)
SAMPLED = SamplingParams(max_tokens=40, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)


def main(out_dir: Path, mode: str) -> None:
    torch.set_num_threads(2)
    model = load_model(None)
    engine = Engine(model, EngineConfig(num_blocks=512))
    prompts = varied_prompts(model)[:4]
    if mode == "prefill":
        results = prefill_and_export(engine, [(f"r{i}", p, GREEDY) for i, p in enumerate(prompts)])
        for out, snapshot, frame in results:
            assert snapshot is not None and frame is not None
            (out_dir / f"{out.request_id}.snap").write_bytes(
                msgspec.msgpack.encode(to_wire(snapshot))
            )
            (out_dir / f"{out.request_id}.kv").write_bytes(frame)
    else:
        rid = engine.add_request(prompts[0], SAMPLED, request_id="s0")
        for _ in range(11):  # prefill + 10 decode steps
            engine.step()
        snapshot, frame = engine.export(rid)
        (out_dir / "s0.snap").write_bytes(msgspec.msgpack.encode(to_wire(snapshot)))
        (out_dir / "s0.kv").write_bytes(frame)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
