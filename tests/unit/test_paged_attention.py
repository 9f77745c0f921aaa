"""The CPU paged decode-attention kernel: the same numbers as gather + SDPA, refusals of bad
tables, the switch, and the fallback when it cannot be built."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from shared.kv.paged_cache import PagedKVCache
from shared.model import paged_attention
from shared.model.loader import LoadedModel
from shared.model.runner import ModelRunner, kv_layout

BLOCKS, BLOCK, HEADS, DIM, REP = 64, 16, 3, 64, 3


def reference(
    q: torch.Tensor, kv: torch.Tensor, table: torch.Tensor, lengths: list[int]
) -> torch.Tensor:
    """Gather each sequence's blocks, mask keys past its length, SDPA."""
    batch, nblocks = table.shape
    shape = (batch, nblocks * BLOCK, HEADS, DIM)
    k = kv[0].index_select(0, table.reshape(-1)).view(shape).transpose(1, 2)
    v = kv[1].index_select(0, table.reshape(-1)).view(shape).transpose(1, 2)
    mask = torch.arange(nblocks * BLOCK)[None, :] < torch.tensor(lengths)[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :], scale=0.125)


@pytest.fixture(scope="module")
def kernel() -> paged_attention.Kernel:
    found = paged_attention.kernel(torch.device("cpu"), torch.float32)
    assert found is not None, "the kernel must build here (g++ is part of the dev setup)"
    return found


def test_matches_gather_and_sdpa_on_ragged_batches(kernel: paged_attention.Kernel) -> None:
    torch.manual_seed(0)
    kv = torch.randn(2, BLOCKS, BLOCK, HEADS, DIM)
    lengths = [1, 15, 16, 17, 100, 130]  # inside one block, at a boundary, across several
    nblocks = -(-max(lengths) // BLOCK)
    table = torch.randperm(BLOCKS)[: len(lengths) * nblocks].view(len(lengths), nblocks)
    q = torch.randn(len(lengths), HEADS, REP, DIM)
    out = kernel(q, kv, table, torch.tensor(lengths), 0.125)
    torch.testing.assert_close(out, reference(q, kv, table, lengths), atol=1e-5, rtol=1e-5)


def test_refuses_tables_that_point_outside_the_cache(kernel: paged_attention.Kernel) -> None:
    kv = torch.zeros(2, BLOCKS, BLOCK, HEADS, DIM)
    q = torch.zeros(1, HEADS, REP, DIM)
    with pytest.raises(RuntimeError, match="block id out of range"):
        kernel(q, kv, torch.tensor([[BLOCKS]]), torch.tensor([3]), 0.125)
    with pytest.raises(RuntimeError, match="length outside its table"):
        kernel(q, kv, torch.tensor([[0]]), torch.tensor([BLOCK + 1]), 0.125)
    with pytest.raises(RuntimeError, match="float32 only"):
        kernel(q.double(), kv.double(), torch.tensor([[0]]), torch.tensor([3]), 0.125)


def test_the_switch_and_where_it_applies(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    assert paged_attention.kernel(cpu, torch.bfloat16) is None  # float32 only
    assert paged_attention.kernel(torch.device("cuda"), torch.float32) is None
    monkeypatch.setenv("TANDEM_ATTENTION", "gather")
    assert paged_attention.kernel(cpu, torch.float32) is None
    monkeypatch.setenv("TANDEM_ATTENTION", "fast")
    with pytest.raises(ValueError, match="TANDEM_ATTENTION"):
        paged_attention.kernel(cpu, torch.float32)


def test_without_a_compiler_the_gather_path_serves(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(paged_attention, "_tried", False)
    monkeypatch.setattr(paged_attention, "_loaded", None)
    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path))  # nothing built here yet
    monkeypatch.setenv("CXX", "no-such-compiler")
    assert paged_attention.kernel(torch.device("cpu"), torch.float32) is None
    assert "no C++ compiler" in caplog.text


def test_runner_logits_agree_with_and_without_the_kernel(tiny_model: LoadedModel) -> None:
    cache = PagedKVCache(kv_layout(tiny_model, BLOCK), 32, tiny_model.device)
    runner = ModelRunner(tiny_model, cache)
    assert runner.paged_attention is not None
    torch.manual_seed(1)
    cache.kv.normal_()  # stands in for prompts already prefilled
    positions, tables = [5, 40, 77], [[3, 4, 5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    paged = runner.forward_decode([11, 12, 13], positions, tables)
    torch.manual_seed(1)
    cache.kv.normal_()
    runner.paged_attention = None
    gathered = runner.forward_decode([11, 12, 13], positions, tables)
    torch.testing.assert_close(paged, gathered, atol=1e-4, rtol=1e-4)
