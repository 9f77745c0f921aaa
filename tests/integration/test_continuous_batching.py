"""16 requests joining a running batch at different steps each get exactly their solo tokens."""

from __future__ import annotations

import pytest

from shared.engine.engine import Engine, EngineConfig
from shared.model.loader import LoadedModel
from shared.sampling_params import SamplingParams
from tests.integration.prompts import varied_prompts

pytestmark = pytest.mark.integration


def test_sixteen_staggered_requests_match_solo_runs(real_model: LoadedModel) -> None:
    base = varied_prompts(real_model)
    short = [p for p in base if len(p) < 400]
    prompts = [short[i % len(short)][: 5 + 7 * i] for i in range(16)]  # all different lengths
    params = [
        SamplingParams(max_tokens=6 + (i * 5) % 17, temperature=0, ignore_eos=True)
        for i in range(16)
    ]
    join_step = [0, 0, 1, 3, 3, 4, 6, 7, 7, 9, 10, 12, 13, 13, 15, 18]
    engine = Engine(real_model, EngineConfig(num_blocks=512))
    got: dict[str, list[int]] = {}
    rid_of: dict[int, str] = {}
    step, widest = 0, 0
    while len(rid_of) < 16 or engine.has_unfinished():
        for i in range(16):
            if join_step[i] == step:
                rid_of[i] = engine.add_request(prompts[i], params[i])
        outs = engine.step()
        widest = max(widest, len(outs))
        for o in outs:
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
        step += 1
    assert widest >= 8
    solo = Engine(real_model, EngineConfig(num_blocks=512, enable_prefix_caching=False))
    for i in range(16):
        alone = solo.generate([prompts[i]], params[i])[0]
        assert got[rid_of[i]] == alone, f"request {i} ({len(prompts[i])} prompt tokens)"
    assert engine.pool.num_used == 0
