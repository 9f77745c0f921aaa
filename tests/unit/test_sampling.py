"""Sampler: greedy, top-k/top-p cuts, seeded draws that depend only on (seed, position)."""

from __future__ import annotations

import pytest
import torch

from shared.engine.sampling import sample, sample_row, seeded_uniform
from shared.errors import InvalidRequestError
from shared.sampling_params import SamplingParams, new_seed

pytestmark = pytest.mark.unit


def test_seeded_uniform_is_a_pure_function_in_range() -> None:
    draws = [seeded_uniform(42, p) for p in range(1000)]
    assert draws == [seeded_uniform(42, p) for p in range(1000)]
    assert all(0.0 <= u < 1.0 for u in draws)
    assert len(set(draws)) == 1000
    assert draws != [seeded_uniform(43, p) for p in range(1000)]
    assert 0.45 < sum(draws) / len(draws) < 0.55


def test_greedy_and_top_k_one_pick_argmax() -> None:
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    assert sample_row(logits, SamplingParams(temperature=0), 1, 0) == 1
    assert sample_row(logits, SamplingParams(temperature=5.0, top_k=1), 1, 0) == 1


def test_top_p_keeps_only_the_head() -> None:
    logits = torch.tensor([10.0, 9.0, 0.0, 0.0])  # p(0) ~ 0.73, p(1) ~ 0.27, rest ~ 0
    params = SamplingParams(temperature=1.0, top_p=0.5, seed=1)
    assert {sample_row(logits, params, 1, pos) for pos in range(200)} == {0}
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1)
    assert {sample_row(logits, params, 1, pos) for pos in range(200)} == {0, 1}


def test_top_k_cut() -> None:
    logits = torch.zeros(50)
    params = SamplingParams(temperature=1.0, top_k=3)
    picks = {sample_row(logits, params, 5, pos) for pos in range(300)}
    assert len(picks) == 3


def test_frequencies_follow_the_distribution() -> None:
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = probs.log()
    params = SamplingParams(temperature=1.0)
    n = 4000
    counts = torch.bincount(
        torch.tensor([sample_row(logits, params, 9, pos) for pos in range(n)]), minlength=3
    )
    assert torch.allclose(counts.double() / n, probs.double(), atol=0.03)


def test_a_token_of_zero_probability_is_never_drawn() -> None:
    """Without a cut the draw walks the vocabulary in its own order (no sort); a banned
    token (-inf, as min_tokens makes EOS) has no mass there, first, last or between."""
    logits = torch.tensor([float("-inf"), 0.0, float("-inf"), 0.5, float("-inf")])
    params = SamplingParams(temperature=1.0)
    picks = {sample_row(logits, params, 7, pos) for pos in range(500)}
    assert picks == {1, 3}


def test_batch_sample_matches_rows_and_is_reproducible() -> None:
    torch.manual_seed(0)
    logits = torch.randn(5, 100)
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.7, seed=3),
        SamplingParams(temperature=1.2, top_p=0.8),
        SamplingParams(temperature=0.9, top_k=10),
        SamplingParams(temperature=1.0),  # no cut: the unsorted draw
    ]
    seeds, positions = [1, 3, 4, 5, 6], [10, 11, 12, 13, 14]
    out = sample(logits, params, seeds, positions)
    assert out == sample(logits, params, seeds, positions)
    assert out == [sample_row(logits[i], params[i], seeds[i], positions[i]) for i in range(5)]


def test_the_edges_of_the_ranges_are_valid() -> None:
    for kwargs in ({"temperature": 2.0}, {"temperature": 0.0}, {"seed": 2**63 - 1}, {"seed": 0}):
        SamplingParams(**kwargs).validate()  # type: ignore[arg-type]
    assert all(0 <= new_seed() < 2**63 for _ in range(100))


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"seed": -1}, "seed"),
        ({"temperature": 2.01}, "temperature"),  # the router's bound is the nodes' too
        ({"seed": 2**63}, "seed"),
        ({"stop": ("",)}, "stop"),
    ],
)
def test_validation_names_the_parameter(kwargs: dict[str, object], param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs).validate("r1")  # type: ignore[arg-type]
    assert info.value.param == param and info.value.request_id == "r1"
