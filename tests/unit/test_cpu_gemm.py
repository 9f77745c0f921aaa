"""The linear layers through oneDNN-packed weights (shared/model/cpu_gemm.py): the same
products as torch's linear within rounding, where the path applies, and the switch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from shared.engine.engine import Engine, EngineConfig
from shared.kv.paged_cache import PagedKVCache
from shared.model import cpu_gemm, cpu_kernels
from shared.model.loader import LoadedModel
from shared.model.runner import ModelRunner, kv_layout
from shared.sampling_params import SamplingParams

pytestmark = pytest.mark.unit

CPU = torch.device("cpu")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 16, 300])
def test_a_packed_linear_multiplies_as_torch_does(bias: bool, rows: int) -> None:
    if not cpu_gemm.available():
        pytest.skip("this torch has no oneDNN linear (the torch path serves)")
    torch.manual_seed(rows)
    module = torch.nn.Linear(96, 200, bias=bias)
    x = torch.randn(rows, 96)
    packed = cpu_gemm.PackedLinear(module)
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), module(x), atol=1e-5, rtol=1e-5)
    module.weight.data.zero_()  # a copy: the module's own weight is left as it was used
    assert packed(x).abs().sum() > 0


def test_the_switch_and_where_it_applies(monkeypatch: pytest.MonkeyPatch) -> None:
    module = torch.nn.Linear(8, 8)
    assert cpu_gemm.linears([module], CPU, torch.bfloat16) == {module: module}  # float32 only
    assert cpu_gemm.linears([module], torch.device("cuda"), torch.float32) == {module: module}
    monkeypatch.setenv("TANDEM_CPU_GEMM", "torch")
    assert cpu_gemm.linears([module], CPU, torch.float32) == {module: module}
    monkeypatch.setenv("TANDEM_CPU_GEMM", "fast")
    with pytest.raises(ValueError, match="TANDEM_CPU_GEMM"):
        cpu_gemm.linears([module], CPU, torch.float32)
    monkeypatch.setenv("TANDEM_CPU_GEMM", "onednn")
    got = cpu_gemm.linears([module], CPU, torch.float32)[module]
    assert isinstance(got, cpu_gemm.PackedLinear) == cpu_gemm.available()
    monkeypatch.setenv("TANDEM_CPU_GEMM", "auto")
    got = cpu_gemm.linears([module], CPU, torch.float32)[module]
    kinds = (cpu_gemm.PackedLinear, cpu_gemm.TunedLinear)
    assert isinstance(got, kinds) == cpu_gemm.available()


def timings(torch_wins_at: set[int], ratio: float = 0.5) -> tuple[cpu_gemm.Timer, list[int]]:
    """A timer that reports torch's linear as taking `ratio` of oneDNN's time at the row
    counts given (and twice it elsewhere), and the row counts it was asked about."""
    asked: list[int] = []

    def timer(by_torch: object, by_onednn: object) -> tuple[float, float]:
        rows = by_torch.rows  # type: ignore[attr-defined]
        asked.append(rows)
        return (ratio if rows in torch_wins_at else 2.0), 1.0

    return timer, asked


def test_auto_takes_torchs_linear_up_to_the_rows_where_it_was_faster(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if not cpu_gemm.available():
        pytest.skip("this torch has no oneDNN linear (the torch path serves)")
    monkeypatch.setenv("TANDEM_CPU_GEMM", "auto")
    torch.manual_seed(0)
    a, b, other = torch.nn.Linear(64, 32), torch.nn.Linear(64, 32), torch.nn.Linear(32, 64)
    timer, asked = timings({1, 4})
    got = cpu_gemm.linears([a, b, other], CPU, torch.float32, timer)
    assert asked == [1, 4, 32] * 2  # once per weight shape, from one row up
    tuned = got[a]
    assert isinstance(tuned, cpu_gemm.TunedLinear) and tuned.torch_rows == 8
    tuned.packed = lambda x: torch.full((x.shape[0], 32), 7.0)  # type: ignore[assignment]
    with torch.inference_mode():
        for rows in (1, 8):  # torch's product, from the module's own weight
            x = torch.randn(rows, 64)
            torch.testing.assert_close(tuned(x), a(x))
        assert bool((tuned(torch.randn(9, 64)) == 7.0).all())  # the packed copy's
    # oneDNN faster at one row: the packed copy at every size, and no more timing
    timer, asked = timings(set())
    assert isinstance(cpu_gemm.linears([a], CPU, torch.float32, timer)[a], cpu_gemm.PackedLinear)
    assert asked == [1]
    # torch faster but within the margin: a near tie keeps oneDNN
    timer, asked = timings({1, 4, 32}, ratio=0.95)
    assert isinstance(cpu_gemm.linears([a], CPU, torch.float32, timer)[a], cpu_gemm.PackedLinear)
    # faster at every size timed: up to 64 rows, and oneDNN beyond
    timer, asked = timings({1, 4, 32})
    tuned = cpu_gemm.linears([a], CPU, torch.float32, timer)[a]
    assert isinstance(tuned, cpu_gemm.TunedLinear) and tuned.torch_rows == 64


def test_auto_takes_the_kernel_up_to_the_rows_where_it_was_faster(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the kernels given, each shape is also timed with small_linear against what the
    rows would take otherwise; calls up to the last row count it won go to it."""
    if not cpu_gemm.available():
        pytest.skip("this torch has no oneDNN linear (the torch path serves)")
    kernels = cpu_kernels.load(CPU, torch.float32)
    assert kernels is not None, "the kernels must build here (g++ is part of the dev setup)"
    monkeypatch.setenv("TANDEM_CPU_GEMM", "auto")
    torch.manual_seed(0)
    module = torch.nn.Linear(64, 32, bias=False)

    def timer(a: Any, b: Any) -> tuple[float, float]:
        """The kernel wins at every row count timed; torch's linear never wins."""
        if a.func is kernels.small_linear:
            return 0.5, 1.0
        return 2.0, 1.0

    tuned = cpu_gemm.linears([module], CPU, torch.float32, timer, kernels=kernels)[module]
    assert isinstance(tuned, cpu_gemm.TunedLinear)
    assert (tuned.kernel_rows, tuned.torch_rows) == (cpu_gemm.KERNEL_ROW_BUCKETS[-1][0], 0)
    tuned.packed = lambda x: torch.full((x.shape[0], 32), 7.0)  # type: ignore[assignment]
    with torch.inference_mode():
        for rows in range(1, tuned.kernel_rows + 1):  # the kernel's product
            x = torch.randn(rows, 64)
            torch.testing.assert_close(tuned(x), module(x), atol=1e-5, rtol=1e-5)
        beyond = torch.randn(tuned.kernel_rows + 1, 64)
        assert bool((tuned(beyond) == 7.0).all())  # the packed copy's
    # a layer with a bias: the kernel takes none
    biased = torch.nn.Linear(64, 32)
    got = cpu_gemm.linears([biased], CPU, torch.float32, timer, kernels=kernels)[biased]
    assert isinstance(got, cpu_gemm.PackedLinear)


def test_timing_calls_go_over_copies_of_the_weight_in_turn() -> None:
    """Each timed call multiplies by the next copy (plain or packed, by any path), so a
    weight is used again only after every other copy: it has left the cache by then."""
    if not cpu_gemm.available():
        pytest.skip("this torch has no oneDNN linear (the torch path serves)")
    torch.manual_seed(0)
    module = torch.nn.Linear(64, 32, bias=False)
    packed = cpu_gemm.PackedLinear(module)
    weight_bytes = 64 * 32 * 4
    copies = cpu_gemm.Copies(module, packed, cache_bytes=5 * weight_bytes // 2)
    assert len(copies.weights) == len(copies.packed) == 5  # twice the cache, rounded up
    assert copies.weights[0].data_ptr() == module.weight.data_ptr()  # the module's own
    assert copies.packed[0] is packed
    for i, weight in enumerate(copies.weights[1:], start=1):
        weight.mul_(i + 1)  # copy i now multiplies by i + 1: its product tells it apart
    x = torch.randn(3, 64)
    by_torch, by_onednn = copies.by_torch(x), copies.by_onednn(x)
    assert (by_torch.rows, by_onednn.rows) == (3, 3)
    scales = []
    with torch.inference_mode():
        want = module(x)
        for _ in range(5):
            scales.append(round(float((by_torch() / want).median())))
            torch.testing.assert_close(by_onednn(), want, atol=1e-5, rtol=1e-5)
    # the two paths take turns 1, 2, 3, ...: torch's calls get copies 1, 3, 0, 2, 4
    assert scales == [2, 4, 1, 3, 5]
    assert len(cpu_gemm.Copies(module, packed, cache_bytes=0).weights) == 1
    big = cpu_gemm.Copies(module, packed, cache_bytes=1 << 40)
    assert len(big.weights) == cpu_gemm.MAX_COPIES
    assert cpu_gemm.last_level_cache_bytes() > 0


def test_the_runner_uses_it_and_its_logits_agree(tiny_model: LoadedModel) -> None:
    """Every linear layer of the runner goes through it (the transformers model's modules
    are not changed), and a decode step's logits agree with torch's linear."""
    if not cpu_gemm.available():
        pytest.skip("this torch has no oneDNN linear (the torch path serves)")
    cache = PagedKVCache(kv_layout(tiny_model, 16), 32, tiny_model.device)
    runner = ModelRunner(tiny_model, cache)
    layers = len(runner.layers)
    assert len(runner.linear) == 1 + 7 * layers
    kinds = (cpu_gemm.PackedLinear, cpu_gemm.TunedLinear)
    assert all(isinstance(f, kinds) for f in runner.linear.values())
    assert all(isinstance(m, torch.nn.Linear) for m in runner.linear)
    torch.manual_seed(3)
    cache.kv.normal_()
    positions, tables = [5, 40], [[3, 4, 5], [9, 10, 11]]
    packed = runner.forward_decode([11, 12], positions, tables)
    runner.linear = {m: m for m in runner.linear}
    torch.testing.assert_close(
        runner.forward_decode([11, 12], positions, tables), packed, atol=1e-4, rtol=1e-4
    )


def test_greedy_tokens_are_the_same_either_way(
    tiny_model: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompts = [[5, 9, 200, 31, 7], list(range(40, 140))]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    with_auto = Engine(tiny_model, EngineConfig(num_blocks=64)).generate(prompts, params)
    monkeypatch.setenv("TANDEM_CPU_GEMM", "onednn")
    with_onednn = Engine(tiny_model, EngineConfig(num_blocks=64)).generate(prompts, params)
    assert with_onednn == with_auto
    monkeypatch.setenv("TANDEM_CPU_GEMM", "torch")
    engine = Engine(tiny_model, EngineConfig(num_blocks=64))
    assert all(f is m for m, f in engine.runner.linear.items())
    assert engine.generate(prompts, params) == with_onednn


FREED_HEAP = """
import torch
from shared.model.cpu_gemm import release_freed_memory

def rss_mb():
    return int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) // 1024

big = torch.empty(16 << 20, dtype=torch.uint8)
big.fill_(1)
del big  # freed from mmap: glibc now serves blocks of a few MB from its heap
blocks = [torch.ones(1 << 20) for _ in range(64)]  # 4 MB each, like the timing's copies
kept = blocks[1::2]
del blocks  # half freed, in holes below live blocks: not trimmed by free() itself
freed = rss_mb()
release_freed_memory()
print(freed - rss_mb())
"""


def test_the_timings_freed_copies_go_back_to_the_os() -> None:
    """Freed heap blocks of a few MB stay resident until trimmed (3.7 GB a node on a host
    with a 300 MB L3); `release_freed_memory` hands the 128 MB freed here back."""
    out = subprocess.run(
        [sys.executable, "-c", FREED_HEAP],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).parents[2],
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout.split()[-1]) >= 96  # MB back of the 128 freed


def test_the_timing_flushes_at_most_llc_timed_max(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 300 MB L3 is timed as LLC_TIMED_MAX: at most twice that in copies of a weight."""
    monkeypatch.setattr(cpu_gemm, "last_level_cache_bytes", lambda: 300 << 20)
    seen: list[int] = []
    real = cpu_gemm.Copies

    def copies(module: Any, packed: Any, cache_bytes: int) -> Any:
        seen.append(cache_bytes)
        return real(module, packed, cache_bytes)

    monkeypatch.setattr(cpu_gemm, "Copies", copies)
    monkeypatch.setattr(cpu_gemm, "_TUNED", {})
    linear = torch.nn.Linear(64, 48)
    cpu_gemm.linears([linear], CPU, torch.float32)
    assert seen == [cpu_gemm.LLC_TIMED_MAX]
