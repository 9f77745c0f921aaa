"""Several models' block pools under one KV budget (shared/kv/shared_pool.py): bytes
counted across pools of different block sizes, an idle model's free memory taken back
for a busy one (never blocks in use), its cached blocks evicted and its pages released;
and two engines of different KV layouts sharing a budget, stepping in turn, each giving
the tokens it gives alone."""

from __future__ import annotations

import random

import pytest
import torch

from shared.buffers import PAGE
from shared.engine.engine import Engine, EngineConfig
from shared.errors import CapacityError
from shared.kv.paged_cache import KVLayout, PagedKVCache
from shared.kv.shared_pool import KVBudget, SharedBlockPool
from shared.model.loader import LoadedModel, load_model
from shared.sampling_params import SamplingParams
from tests.rss import status_kib

pytestmark = pytest.mark.unit


def pools(total: int = 3000) -> tuple[KVBudget, SharedBlockPool, SharedBlockPool]:
    budget = KVBudget(total)
    return budget, SharedBlockPool(budget, 100), SharedBlockPool(budget, 300)


def test_bytes_are_counted_across_pools_of_different_block_sizes() -> None:
    budget, a, b = pools()
    assert (a.num_blocks, b.num_blocks) == (30, 10)
    assert (a.num_free, b.num_free) == (30, 10)
    held = a.allocate(20)  # 2,000 of 3,000 bytes
    assert budget.committed == 2000 and a.num_used == 20
    assert (a.num_free, b.num_free) == (10, 3)  # B: 1,000 spare bytes, 3 blocks of 300
    assert not b.can_allocate(4)
    with pytest.raises(CapacityError):
        b.allocate(4)  # blocks in use are never taken
    assert budget.committed == 2000 and b.num_used == 0  # and a refusal changes nothing
    a.free(held)
    assert (a.num_free, b.num_free) == (30, 10)  # A's free blocks can come back to B


def test_a_busy_model_takes_back_an_idle_ones_free_memory() -> None:
    budget, a, b = pools()
    evicted: list[tuple[int, bytes]] = []
    released: list[int] = []
    a.on_evict = lambda block_id, h: evicted.append((block_id, h))
    a.on_release = released.append
    first = a.allocate(20)
    for i, block_id in enumerate(first):
        a.commit_hash(block_id, bytes([i]) * 16)
    a.free(first)  # free, cached: a later prompt could still find them
    assert a.lookup(bytes([0]) * 16) == first[0]
    got = b.allocate(10)  # all 3,000 bytes: 1,000 spare, then 2,000 from A
    assert len(got) == 10 and budget.committed == 3000
    assert len(released) == 20 and len(evicted) == 20  # A's pages and hashes went
    assert a.lookup(bytes([0]) * 16) is None
    assert a.num_free == 0 and b.num_free == 0
    b.free(got)
    assert a.num_free == 30  # and back again when B idles
    assert a.allocate(30) and budget.committed == 3000


def test_a_pool_uses_spare_bytes_before_evicting_its_own_cached_blocks() -> None:
    budget, a, _ = pools()
    cached = a.allocate(5)
    a.commit_hash(cached[0], b"x" * 16)
    a.free(cached)
    more = a.allocate(10)  # 2,500 bytes spare: fresh blocks, the cached one kept
    assert a.lookup(b"x" * 16) == cached[0] and not set(more) & set(cached)
    assert budget.committed == 1500


def test_random_operations_keep_the_budget_exact() -> None:
    budget, a, b = pools(6000)
    rng = random.Random(7)
    held: dict[int, list[list[int]]] = {0: [], 1: []}
    for _ in range(2000):
        which = rng.randrange(2)
        pool = (a, b)[which]
        if held[which] and rng.random() < 0.45:
            pool.free(held[which].pop(rng.randrange(len(held[which]))))
        else:
            n = rng.randrange(1, 6)
            if pool.can_allocate(n):
                ids = pool.allocate(n)
                assert len(set(ids)) == n and all(pool.ref_counts[i] == 1 for i in ids)
                held[which].append(ids)
            else:
                with pytest.raises(CapacityError):
                    pool.allocate(n)
        committed = sum((p.num_blocks - len(p.fresh)) * p.block_bytes for p in (a, b))
        assert budget.committed == committed <= budget.total
        for p, k in ((a, 0), (b, 1)):
            assert p.num_used == sum(map(len, held[k]))


def test_a_released_block_reads_as_zeros_and_the_others_keep_their_values() -> None:
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32)
    assert layout.bytes_per_block // 4 % PAGE == 0  # each block's piece is whole pages
    cache = PagedKVCache(layout, 8, torch.device("cpu"), lazy=True)
    assert not cache.kv.any()  # untouched memory reads as zeros
    cache.kv.fill_(1.5)
    cache.release_block(3)
    assert not cache.kv[:, :, 3].any()
    assert bool((cache.kv[:, :, 2] == 1.5).all()) and bool((cache.kv[:, :, 4] == 1.5).all())
    with pytest.raises(ValueError, match="CPU"):
        PagedKVCache(layout, 8, torch.device("meta"), lazy=True)


def test_memory_is_resident_only_while_blocks_hold_it() -> None:
    """The point of a lazy cache: 96 MB of blocks cost nothing until written, and their
    pages go back to the system when released."""
    layout = KVLayout(num_layers=4, num_kv_heads=4, head_dim=64, block_size=16, dtype=torch.float32)
    n = 96 * (1 << 20) // layout.bytes_per_block
    before = status_kib("RssAnon") * 1024
    cache = PagedKVCache(layout, n, torch.device("cpu"), lazy=True)
    assert status_kib("RssAnon") * 1024 - before < 16 << 20
    cache.kv.fill_(1.0)
    assert status_kib("RssAnon") * 1024 - before > 80 << 20
    for block_id in range(n):
        cache.release_block(block_id)
    assert status_kib("RssAnon") * 1024 - before < 16 << 20


GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(rng.randrange(20, 60))] for _ in range(n)]


def test_two_models_engines_share_a_budget_and_each_gives_its_own_tokens(
    tiny_model: LoadedModel, tiny_model_dir: object
) -> None:
    """The tiny Llama in float32 and in bfloat16 (two KV layouts): each engine's greedy
    tokens under the shared budget, stepping in turn, are its tokens alone; then the
    bf16 model, busy, takes the f32 model's idle memory and still gives the same."""
    bf16 = load_model(str(tiny_model_dir), dtype="bfloat16", device="cpu")
    alone = {
        name: Engine(m, EngineConfig(num_blocks=256)).generate(prompts(6, seed), GREEDY)
        for name, m, seed in (("f32", tiny_model, 1), ("bf16", bf16, 2))
    }
    f32_block = Engine(tiny_model, EngineConfig(num_blocks=1)).layout.bytes_per_block
    budget = KVBudget(40 * f32_block)  # 40 f32 blocks, 80 bf16 ones
    engines = {
        "f32": Engine(tiny_model, EngineConfig(), budget),
        "bf16": Engine(bf16, EngineConfig(), budget),
    }
    ids = {
        name: [engines[name].add_request(p, GREEDY) for p in prompts(6, seed)]
        for name, seed in (("f32", 1), ("bf16", 2))
    }
    got: dict[tuple[str, str], list[int]] = {}
    while any(e.has_unfinished() for e in engines.values()):
        for name, engine in engines.items():  # in turn, as the node's one engine thread does
            if engine.has_unfinished():
                for o in engine.step():
                    got.setdefault((name, o.request_id), []).extend(o.new_token_ids)
    for name in engines:
        assert [got[name, r] for r in ids[name]] == alone[name], name
    f32, b16 = engines["f32"], engines["bf16"]
    assert f32.pool.num_used == 0 and b16.pool.num_used == 0
    # bf16 alone now needs more than the budget has spare: f32's cached blocks make room
    long = prompts(8, seed=3)
    want = Engine(bf16, EngineConfig(num_blocks=256)).generate(long, GREEDY)
    assert budget.spare < 8 * 5 * b16.layout.bytes_per_block
    assert b16.generate(long, GREEDY) == want
    assert budget.committed <= budget.total
