"""The CPU kernels: paged decode attention gives gather + SDPA's numbers, the fused small ops
give transformers' (rotary bit for bit), bad tables are refused, the switch works, and the
portable ops serve when the kernels cannot be built."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from shared.kv.paged_cache import PagedKVCache
from shared.model import cpu_kernels
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
def ops() -> Any:
    found = cpu_kernels.load(torch.device("cpu"), torch.float32)
    assert found is not None, "the kernels must build here (g++ is part of the dev setup)"
    return found


@pytest.fixture(scope="module")
def kernel(ops: Any) -> Any:
    return ops.paged_decode_attention


def test_matches_gather_and_sdpa_on_ragged_batches(kernel: Any) -> None:
    torch.manual_seed(0)
    kv = torch.randn(2, BLOCKS, BLOCK, HEADS, DIM)
    lengths = [1, 15, 16, 17, 100, 130]  # inside one block, at a boundary, across several
    nblocks = -(-max(lengths) // BLOCK)
    table = torch.randperm(BLOCKS)[: len(lengths) * nblocks].view(len(lengths), nblocks)
    q = torch.randn(len(lengths), HEADS, REP, DIM)
    out = kernel(q, kv, table, torch.tensor(lengths), 0.125)
    torch.testing.assert_close(out, reference(q, kv, table, lengths), atol=1e-5, rtol=1e-5)


def test_refuses_tables_that_point_outside_the_cache(kernel: Any) -> None:
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
    assert cpu_kernels.load(cpu, torch.bfloat16) is None  # float32 only
    assert cpu_kernels.load(torch.device("cuda"), torch.float32) is None
    monkeypatch.setenv("TANDEM_CPU_KERNELS", "off")
    assert cpu_kernels.load(cpu, torch.float32) is None
    monkeypatch.setenv("TANDEM_CPU_KERNELS", "fast")
    with pytest.raises(ValueError, match="TANDEM_CPU_KERNELS"):
        cpu_kernels.load(cpu, torch.float32)


def test_without_a_compiler_the_gather_path_serves(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(cpu_kernels, "_tried", False)
    monkeypatch.setattr(cpu_kernels, "_loaded", None)
    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path))  # nothing built here yet
    monkeypatch.setenv("CXX", "no-such-compiler")
    assert cpu_kernels.load(torch.device("cpu"), torch.float32) is None
    assert "no C++ compiler" in caplog.text


def test_runner_logits_agree_with_and_without_the_kernels(tiny_model: LoadedModel) -> None:
    cache = PagedKVCache(kv_layout(tiny_model, BLOCK), 32, tiny_model.device)
    runner = ModelRunner(tiny_model, cache)
    assert runner.kernels is not None
    torch.manual_seed(1)
    cache.kv.normal_()  # stands in for prompts already prefilled
    positions, tables = [5, 40, 77], [[3, 4, 5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    paged = runner.forward_decode([11, 12, 13], positions, tables)
    torch.manual_seed(1)
    cache.kv.normal_()
    runner.kernels = None
    gathered = runner.forward_decode([11, 12, 13], positions, tables)
    torch.testing.assert_close(paged, gathered, atol=1e-4, rtol=1e-4)


def test_rope_store_rotates_like_transformers_and_stores(ops: Any) -> None:
    torch.manual_seed(2)
    n, q_heads, kv_heads, dim = 5, 6, 2, 64
    q, k, v = (
        torch.randn(n, q_heads, dim),
        torch.randn(n, kv_heads, dim),
        torch.randn(n, kv_heads, dim),
    )
    cos, sin = torch.randn(n, dim), torch.randn(n, dim)

    def rotate_half(x: torch.Tensor) -> torch.Tensor:  # transformers' convention
        return torch.cat((-x[..., dim // 2 :], x[..., : dim // 2]), dim=-1)

    want_q = q * cos[:, None] + rotate_half(q) * sin[:, None]
    want_k = k * cos[:, None] + rotate_half(k) * sin[:, None]
    cache = torch.zeros(2, 4, BLOCK, kv_heads, dim)
    slots = torch.tensor([3, 17, 18, 40, 63])
    ops.rope_store(q, k, v, cos, sin, cache, slots)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)  # bit for bit
    flat = cache.view(2, -1, kv_heads, dim)
    assert torch.equal(flat[0, slots], want_k) and torch.equal(flat[1, slots], v)
    with pytest.raises(RuntimeError, match="slot out of range"):
        ops.rope_store(q, k, v, cos, sin, cache, torch.tensor([0, 1, 2, 3, 64]))


def test_norms_and_silu_match_transformers_within_rounding(ops: Any) -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(3)
    norm = LlamaRMSNorm(576, eps=1e-5)
    with torch.no_grad():
        norm.weight.normal_()
    h, x = torch.randn(7, 576), torch.randn(7, 576)
    torch.testing.assert_close(ops.rms_norm(h, norm.weight, 1e-5), norm(h))
    residual = h.clone()
    out = ops.add_rms_norm(residual, x, norm.weight, 1e-5)
    torch.testing.assert_close(residual, h + x)  # the residual stream, updated in place
    torch.testing.assert_close(out, norm(h + x))


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("shape", [(200, 96), (37, 100)])  # 100: a tail past 16 lanes
def test_small_linear_multiplies_as_torch_does_and_alike_at_every_row_count(
    ops: Any, rows: int, shape: tuple[int, int]
) -> None:
    torch.manual_seed(rows)
    weight, x = torch.randn(*shape), torch.randn(8, shape[1])
    got = ops.small_linear(x[:rows].contiguous(), weight)
    torch.testing.assert_close(got, F.linear(x[:rows], weight), atol=1e-4, rtol=1e-4)
    alone = ops.small_linear(x[:1].contiguous(), weight)
    assert torch.equal(got[:1], alone)  # a row's sums do not depend on the others


def test_small_linear_refuses_what_it_does_not_take(ops: Any) -> None:
    weight = torch.randn(16, 32)
    with pytest.raises(RuntimeError, match="1 to 8 rows"):
        ops.small_linear(torch.randn(9, 32), weight)
    with pytest.raises(RuntimeError, match="x \\[rows, in\\] and weight \\[out, in\\]"):
        ops.small_linear(torch.randn(2, 31), weight)
    with pytest.raises(RuntimeError, match="contiguous float32"):
        ops.small_linear(torch.randn(2, 32, dtype=torch.float64), weight)
