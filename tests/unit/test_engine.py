"""Engine behaviour on a tiny random Llama: batching, preemption, export, errors, prefix reuse."""

from __future__ import annotations

import random

import msgspec
import pytest
import torch

from shared.engine.engine import Engine, EngineConfig
from shared.engine.prefill_steps import prefill_and_export
from shared.engine.types import SequenceState
from shared.errors import CapacityError, InvalidRequestError, WireFormatError
from shared.model.loader import LoadedModel
from shared.sampling_params import SamplingParams, seeded

pytestmark = pytest.mark.unit

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(rng.randrange(3, 70))] for _ in range(n)]


def alone(model: LoadedModel, prompt: list[int], params: SamplingParams) -> list[int]:
    return Engine(model, EngineConfig(num_blocks=64)).generate([prompt], params)[0]


def run_to_end(engine: Engine) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out


def test_greedy_matches_transformers_generate(tiny_model: LoadedModel) -> None:
    engine = Engine(tiny_model, EngineConfig(num_blocks=64))
    ps = prompts(4, seed=1)
    ours = engine.generate(ps, GREEDY)
    for p, got in zip(ps, ours, strict=True):
        ref = tiny_model.hf_model.generate(
            torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=None
        )[0, len(p) :].tolist()
        assert got == ref


def test_requests_joining_at_different_steps_match_alone(tiny_model: LoadedModel) -> None:
    ps = prompts(16, seed=2)
    params = [
        SamplingParams(max_tokens=5 + i % 7, temperature=0, ignore_eos=True) for i in range(16)
    ]
    engine = Engine(tiny_model, EngineConfig(num_blocks=256))
    ids: dict[str, int] = {}
    got: dict[str, list[int]] = {}
    step = 0
    widest = 0
    pending = list(range(16))
    while pending or engine.has_unfinished():
        # one or two new requests join every other step while others are mid-decode
        if pending and step % 2 == 0:
            for i in pending[:2]:
                ids[engine.add_request(ps[i], params[i])] = i
            pending = pending[2:]
        outs = engine.step()
        widest = max(widest, len(outs))
        for o in outs:
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
        step += 1
    assert widest >= 6  # the batch really ran many sequences at once
    for rid, i in ids.items():
        assert got[rid] == alone(tiny_model, ps[i], params[i]), f"request {i}"
    assert engine.pool.num_used == 0


def test_preemption_under_block_pressure_keeps_tokens(tiny_model: LoadedModel) -> None:
    ps = prompts(6, seed=3)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    engine = Engine(tiny_model, EngineConfig(num_blocks=24, enable_prefix_caching=False))
    got = engine.generate(ps, params)
    assert engine.scheduler.num_preemptions > 0
    assert got == [alone(tiny_model, p, params) for p in ps]
    assert engine.pool.num_used == 0


def test_bad_input_is_rejected_and_engine_keeps_serving(tiny_model: LoadedModel) -> None:
    engine = Engine(tiny_model, EngineConfig(num_blocks=64))
    good = prompts(1, seed=4)[0]
    rid = engine.add_request(good, GREEDY)
    engine.step()
    cases: list[tuple[list[int], SamplingParams, str]] = [
        ([], GREEDY, "prompt"),
        ([5] * 600, GREEDY, "prompt"),  # tiny context is 512
        ([5] * 500, SamplingParams(max_tokens=100), "max_tokens"),
        ([5, 6], SamplingParams(max_tokens=0), "max_tokens"),
        ([5, 6], SamplingParams(max_tokens=-1), "max_tokens"),
        ([5, 6], SamplingParams(temperature=-1.0), "temperature"),
        ([5, 10**6], GREEDY, "prompt"),
    ]
    for prompt, params, param in cases:
        with pytest.raises(InvalidRequestError) as info:
            engine.add_request(prompt, params)
        assert info.value.param == param
    with pytest.raises(InvalidRequestError):
        engine.add_request([5, 6], GREEDY, request_id=rid)  # duplicate id
    tiny = Engine(tiny_model, EngineConfig(num_blocks=2))
    with pytest.raises(CapacityError):
        tiny.add_request([5] * 40, GREEDY)
    assert engine.num_waiting + engine.num_running == 1
    rest = run_to_end(engine)[rid]
    assert len(rest) == GREEDY.max_tokens - 1
    assert alone(tiny_model, good, GREEDY)[1:] == rest


def test_abort_frees_blocks(tiny_model: LoadedModel) -> None:
    engine = Engine(tiny_model, EngineConfig(num_blocks=64))
    rids = [engine.add_request(p, GREEDY) for p in prompts(3, seed=5)]
    engine.step()
    engine.step()
    assert engine.pool.num_used > 0
    for rid in rids:
        assert engine.abort(rid)
    assert not engine.abort("unknown")
    assert engine.pool.num_used == 0 and not engine.has_unfinished()


def test_prefix_cache_hit_gives_cold_tokens(tiny_model: LoadedModel) -> None:
    shared_prefix = prompts(1, seed=6)[0] * 3  # ~ several full blocks
    a = [*shared_prefix, 11, 12, 13]
    b = [*shared_prefix, 21, 22]
    engine = Engine(tiny_model, EngineConfig(num_blocks=64))
    engine.generate([a], GREEDY)
    rid = engine.add_request(b, GREEDY)
    seq = engine.requests[rid]
    got = run_to_end(engine)[rid]
    assert seq.num_cached_tokens >= 16
    assert got == alone(tiny_model, b, GREEDY)


def test_a_cache_salt_keeps_prefixes_apart(tiny_model: LoadedModel) -> None:
    """Requests share cached blocks only under the same cache salt (and unsalted only with
    unsalted); a salted hit still gives the cold tokens."""
    shared_prefix = prompts(1, seed=8)[0] * 3
    engine = Engine(tiny_model, EngineConfig(num_blocks=128))
    salted = msgspec.structs.replace(GREEDY, cache_salt="tenant-a")
    engine.generate([[*shared_prefix, 11]], salted)

    def cached(params: SamplingParams, tail: int) -> tuple[int, list[int]]:
        rid = engine.add_request([*shared_prefix, tail], params)
        seq = engine.requests[rid]
        got = run_to_end(engine)[rid]  # admitted (and its prefix looked up) on the way
        return seq.num_cached_tokens, got

    hits, got = cached(salted, 14)
    assert hits >= 16 and got == alone(tiny_model, [*shared_prefix, 14], GREEDY)
    other = msgspec.structs.replace(GREEDY, cache_salt="tenant-b")
    assert cached(other, 12)[0] == 0  # another tenant's salt: no hit
    assert cached(GREEDY, 13)[0] == 0  # unsalted: no hit on the salted blocks either


def test_export_import_continues_exactly(tiny_model: LoadedModel) -> None:
    ps = prompts(3, seed=7)
    params = SamplingParams(max_tokens=15, temperature=0.8, top_p=0.95, seed=11, ignore_eos=True)
    reference = Engine(tiny_model, EngineConfig(num_blocks=64)).generate(ps, params)
    prefill = Engine(tiny_model, EngineConfig(num_blocks=64))
    results = prefill_and_export(prefill, [(f"r{i}", p, params) for i, p in enumerate(ps)])
    assert prefill.pool.num_used == 0
    decode = Engine(tiny_model, EngineConfig(num_blocks=64))
    first: dict[str, int] = {}
    for out, snap, frame in results:
        assert snap is not None and frame is not None
        first[out.request_id] = out.new_token_ids[0]
        decode.add_snapshot(snap, frame)
    assert decode.num_running == 3  # joined the running batch directly
    rest = run_to_end(decode)
    for i in range(3):
        assert [first[f"r{i}"], *rest[f"r{i}"]] == reference[i]


def moved_mid_sequence(
    model: LoadedModel, prompt: list[int], params: SamplingParams, steps: int
) -> tuple[list[int], SequenceState, list[int]]:
    """Run a request `steps` steps on one engine, export it, continue it on another: the
    tokens made before, the snapshot it moved with, and the tokens made after."""
    first = Engine(model, EngineConfig(num_blocks=64))
    rid = first.add_request(prompt, params)
    produced: list[int] = []
    for _ in range(steps):
        produced.extend(first.step()[0].new_token_ids)
    snapshot, frame = first.export(rid)
    second = Engine(model, EngineConfig(num_blocks=64))
    second.add_snapshot(snapshot, frame)
    return produced, snapshot, run_to_end(second)[rid]


def test_seeded_sampling_resumes_mid_sequence(tiny_model: LoadedModel) -> None:
    prompt = prompts(1, seed=8)[0]
    params = SamplingParams(max_tokens=30, temperature=1.0, top_k=50, seed=99, ignore_eos=True)
    produced, _, rest = moved_mid_sequence(tiny_model, prompt, params, 11)
    assert produced + rest == alone(tiny_model, prompt, params)


def test_an_unseeded_request_gets_one_seed_that_travels_in_its_params(
    tiny_model: LoadedModel,
) -> None:
    """A request without a seed has one fixed as it is added (`seeded`, as the router
    fixes it at admission); it travels in the snapshot's params, the one place it is kept,
    so the sequence continued elsewhere samples as it would have here."""
    prompt = prompts(1, seed=10)[0]
    params = SamplingParams(max_tokens=24, temperature=1.0, ignore_eos=True)
    produced, snapshot, rest = moved_mid_sequence(tiny_model, prompt, params, 5)
    assert snapshot.params.seed is not None and params.seed is None
    assert seeded(snapshot.params) is snapshot.params  # fixed once: kept from then on
    assert produced + rest == alone(tiny_model, prompt, snapshot.params)
    assert len({seeded(params).seed for _ in range(3)}) == 3  # a new one each time


def test_stop_strings_and_eos(tiny_model: LoadedModel) -> None:
    engine = Engine(tiny_model, EngineConfig(num_blocks=64))
    prompt = prompts(1, seed=9)[0]
    full = engine.generate([prompt], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    text = tiny_model.tokenizer.decode(full[0], skip_special_tokens=True)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    rid = engine.add_request(prompt, SamplingParams(max_tokens=20, temperature=0, stop=(stop,)))
    streamed, reason = "", None
    while engine.has_unfinished():
        for o in engine.step():
            streamed += o.text
            reason = o.finish_reason
    assert reason == "stop"
    assert streamed == text[: text.index(stop)]
    assert rid not in engine.requests


def test_blocks_filled_on_one_engine_seed_another_with_cold_tokens(tiny_model: LoadedModel) -> None:
    """The kvcache path: blocks a node filled (prompt and generated) → bytes → another node."""
    rng = random.Random(9)
    prompt = [rng.randrange(3, 49152) for _ in range(70)]
    first = Engine(tiny_model, EngineConfig(num_blocks=64))
    first.exchange.collect_filled = True
    cold = first.generate([prompt], GREEDY)[0]
    hashes, blocks = first.exchange.take_filled_blocks()
    assert len(hashes) == (70 + 12 - 1) // 16  # every full block: prompt and generated ones
    assert first.exchange.take_filled_blocks() == ([], [])  # handed out once
    follow_up = prompt + cold + [rng.randrange(3, 49152) for _ in range(20)]
    cold_follow = alone(tiny_model, follow_up, GREEDY)

    second = Engine(tiny_model, EngineConfig(num_blocks=64))
    wanted = second.exchange.prompt_block_hashes(follow_up)
    assert wanted[: len(hashes)] == hashes  # the history's chain continues into the next turn
    assert second.exchange.cached_prefix_blocks(wanted) == 0
    assert second.exchange.import_cached_blocks(hashes, blocks) == len(hashes)
    assert second.pool.num_free == 64  # cached blocks are free (evictable), just findable
    assert second.exchange.cached_prefix_blocks(wanted) == len(hashes)
    assert second.exchange.import_cached_blocks(hashes, blocks) == 0  # already there
    rid = second.add_request(follow_up, GREEDY)
    got: list[int] = []
    cached = 0
    while second.has_unfinished():
        for o in second.step():
            got.extend(o.new_token_ids)
            cached = o.num_cached_tokens
    assert got == cold_follow
    assert cached == 16 * len(hashes) and rid


def test_import_cached_blocks_refuses_wrong_sizes(tiny_model: LoadedModel) -> None:
    engine = Engine(tiny_model, EngineConfig(num_blocks=8))
    h = engine.exchange.prompt_block_hashes(list(range(3, 40)))
    with pytest.raises(WireFormatError):
        engine.exchange.import_cached_blocks(h[:1], [b"x" * 10])
    assert engine.pool.num_free == 8 and engine.exchange.cached_prefix_blocks(h) == 0


def test_resume_after_delivered_tokens_continues_exactly(tiny_model: LoadedModel) -> None:
    """Failover: a request resubmitted with the tokens already delivered continues as if
    uninterrupted, greedy and seeded alike, whether or not its KV comes from a cache."""
    rng = random.Random(4)
    prompt = [rng.randrange(3, 49152) for _ in range(40)]
    for params in (GREEDY, SamplingParams(max_tokens=12, temperature=0.9, seed=7, ignore_eos=True)):
        full = alone(tiny_model, prompt, params)
        for cut in (1, 5, 11):
            engine = Engine(tiny_model, EngineConfig(num_blocks=64))
            engine.add_request(prompt, params, "r", output_ids=full[:cut])
            rest = run_to_end(engine)["r"]
            assert full[:cut] + rest == full
    engine = Engine(tiny_model, EngineConfig(num_blocks=64))
    with pytest.raises(InvalidRequestError):
        engine.add_request(prompt, GREEDY, "r", output_ids=[1] * 12)  # nothing left to make
    with pytest.raises(InvalidRequestError):
        engine.add_request(prompt, GREEDY, "r", output_ids=[10**9])
    assert not engine.has_unfinished()


def test_a_failed_prefill_batch_leaves_the_engine_clean(tiny_model: LoadedModel) -> None:
    """A batch that fails part-way (here: one request id twice, as when a failover's
    resubmission meets the original in one fetch) must not poison the next batch."""
    engine = Engine(tiny_model, EngineConfig(num_blocks=64))
    params = SamplingParams(max_tokens=4)
    a, b = prompts(2)
    with pytest.raises(InvalidRequestError):
        prefill_and_export(engine, [("dup", a, params), ("dup", b, params)])
    assert not engine.has_unfinished() and engine.pool.num_used == 0
    results = prefill_and_export(engine, [("next", b, params)])
    assert [out.request_id for out, _, _ in results] == ["next"]


def test_chunked_prefill_keeps_decodes_going_and_tokens_unchanged(
    tiny_model: LoadedModel,
) -> None:
    """A long prompt arriving while others decode is prefilled a chunk per step: the running
    sequences get a token every step meanwhile (no stall), and every output equals the
    sequence run alone."""
    rng = random.Random(7)
    short = [[rng.randrange(3, 49152) for _ in range(8)] for _ in range(3)]
    long = [rng.randrange(3, 49152) for _ in range(300)]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    config = EngineConfig(num_blocks=256, step_token_budget=40, prefill_chunk_tokens=32)
    engine = Engine(tiny_model, config)
    ids = [engine.add_request(p, params) for p in short]
    got: dict[str, list[int]] = {}
    for out in engine.step():  # the short ones prefill together, then decode
        got.setdefault(out.request_id, []).extend(out.new_token_ids)
    long_id = engine.add_request(long, params)
    steps_until_first = 0
    while long_id not in got:
        outs = engine.step()
        steps_until_first += 1
        assert {o.request_id for o in outs} >= set(ids)  # every running one got a token
        for out in outs:
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert steps_until_first >= 300 // 32  # it went in chunks of at most 32 tokens
    for out in run_to_end(engine).items():
        got.setdefault(out[0], []).extend(out[1])
    for rid, prompt in zip([*ids, long_id], [*short, long], strict=True):
        assert got[rid] == alone(tiny_model, prompt, params)
    assert engine.pool.num_used == 0


def burst_engine(model: LoadedModel, bursts: bool, running: int) -> tuple[Engine, list[str]]:
    """An engine chunking with a 24-token budget and `running` streams decoding."""
    config = EngineConfig(
        num_blocks=256, step_token_budget=24, prefill_chunk_tokens=16, prefill_bursts=bursts
    )
    engine = Engine(model, config)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts(running, seed=11)]
    while engine.num_waiting or engine.scheduler.prefilling:
        engine.step()
    return engine, ids


def test_a_burst_of_short_prompts_is_prefilled_whole_in_one_step(tiny_model: LoadedModel) -> None:
    """More short prompts wait than streams run: one step prefills them all whole beside the
    decodes (the running stream stalls once, not once per prompt); the tokens are those
    of each prompt run alone. A long prompt behind them is still chunked."""
    engine, running = burst_engine(tiny_model, bursts=True, running=1)
    rng = random.Random(5)
    short = [[rng.randrange(3, 49152) for _ in range(10 + i)] for i in range(4)]
    long = [rng.randrange(3, 49152) for _ in range(100)]
    ids = [engine.add_request(p, GREEDY) for p in [*short, long]]
    got: dict[str, list[int]] = {}

    def step() -> set[str]:
        outs = engine.step()
        for o in outs:
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
        return {o.request_id for o in outs}

    assert step() == {*running, *ids[:4]}  # the stream's token, and the burst's first tokens
    assert [s.request_id for s in engine.scheduler.waiting] == [ids[4]]
    steps = 1
    while ids[4] not in step():
        steps += 1
    assert steps >= 100 // 16  # the long one went a chunk a step
    for rid, tokens in run_to_end(engine).items():
        got.setdefault(rid, []).extend(tokens)
    for rid, prompt in zip(ids, [*short, long], strict=True):
        assert got[rid] == alone(tiny_model, prompt, GREEDY)
    assert engine.pool.num_used == 0


@pytest.mark.parametrize(("bursts", "running", "waiting"), [(False, 1, 4), (True, 3, 2)])
def test_no_burst_chunks_a_prompt_a_step(
    tiny_model: LoadedModel, bursts: bool, running: int, waiting: int
) -> None:
    """Switched off, or fewer short prompts waiting than streams running: the budget holds
    (24 tokens a step, decodes included), so the prompts start one step after another."""
    engine, _ = burst_engine(tiny_model, bursts=bursts, running=running)
    ids = [engine.add_request([7 + i] * 12, GREEDY) for i in range(waiting)]
    outs = engine.step()
    assert not {o.request_id for o in outs} & set(ids[1:])  # one prompt's chunk at most
    assert len(engine.scheduler.waiting) + len(engine.scheduler.prefilling) >= waiting - 1


def test_an_aborted_prompt_mid_chunks_frees_its_blocks(tiny_model: LoadedModel) -> None:
    config = EngineConfig(num_blocks=64, step_token_budget=24, prefill_chunk_tokens=16)
    engine = Engine(tiny_model, config)
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    engine.step()
    long_id = engine.add_request(list(range(10, 210)), GREEDY)
    engine.step()
    assert engine.scheduler.prefilling  # partly computed
    assert engine.abort(long_id)
    assert not engine.scheduler.prefilling
    run_to_end(engine)
    assert engine.pool.num_used == 0
