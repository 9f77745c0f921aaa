"""Block hashes: deterministic, chained, keyed, identical across processes."""

from __future__ import annotations

import subprocess
import sys

import pytest

from shared.kv.block_hash import ROOT_HASH, block_hashes, chain_root, hash_block_tokens

pytestmark = pytest.mark.unit

TOKENS = list(range(100, 140))


def test_only_full_blocks_are_hashed() -> None:
    assert len(block_hashes(TOKENS, 16)) == 2
    assert block_hashes(TOKENS[:15], 16) == []


def test_chain_depends_on_whole_prefix() -> None:
    a = block_hashes(TOKENS, 16)
    changed = [7, *TOKENS[1:]]
    b = block_hashes(changed, 16)
    assert a[0] != b[0] and a[1] != b[1]  # changing block 0 renames every later block
    same_first = [*TOKENS[:16], 9, *TOKENS[17:]]
    c = block_hashes(same_first, 16)
    assert c[0] == a[0] and c[1] != a[1]


def test_chain_equals_manual_chaining() -> None:
    h0 = hash_block_tokens(ROOT_HASH, TOKENS[:16])
    h1 = hash_block_tokens(h0, TOKENS[16:32])
    assert block_hashes(TOKENS, 16) == [h0, h1]
    assert block_hashes(TOKENS[16:32], 16, parent=h0) == [h1]


def test_extra_key_separates_models() -> None:
    assert block_hashes(TOKENS, 16, b"model-a") != block_hashes(TOKENS, 16, b"model-b")


def test_hashes_equal_across_processes() -> None:
    code = (
        "from shared.kv.block_hash import block_hashes;"
        f"print(','.join(h.hex() for h in block_hashes({TOKENS!r}, 16, b'x')))"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        ).stdout.strip()
        for _ in range(2)
    }
    here = ",".join(h.hex() for h in block_hashes(TOKENS, 16, b"x"))
    assert outs == {here}


def test_a_cache_salt_starts_a_chain_of_its_own() -> None:
    ids = list(range(64))
    plain = block_hashes(ids, 16)
    a = block_hashes(ids, 16, parent=chain_root("tenant-a"))
    assert chain_root("") == ROOT_HASH and block_hashes(ids, 16, parent=chain_root("")) == plain
    assert not set(a) & set(plain)
    assert not set(a) & set(block_hashes(ids, 16, parent=chain_root("tenant-b")))
    assert a == block_hashes(ids, 16, parent=chain_root("tenant-a"))  # stable


def test_key_isolation_puts_the_key_digest_before_the_salt() -> None:
    from services.router.admission import salted_by_key
    from shared.sampling_params import SamplingParams

    params = SamplingParams(cache_salt="mine")
    assert salted_by_key(params, "d1g35t").cache_salt == "d1g35t:mine"
    assert salted_by_key(SamplingParams(), "d1g35t").cache_salt == "d1g35t:"
    assert salted_by_key(params, "") is params  # an open API: no key to isolate by
