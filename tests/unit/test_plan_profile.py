"""`tandem plan profile`: the document it writes (a tiny grid on the tiny model), and the
checks on reading one back."""

from __future__ import annotations

import argparse
from pathlib import Path

import msgspec
import pytest
import torch

from shared.costs.model import CostModel
from shared.costs.profile import PROFILE_VERSION, load_profile
from tandem.cli import main
from tandem.plan.profile import STARTUP, Grid, fit, measure
from tests.unit.test_plan_simulate import profile as sample_profile

pytestmark = pytest.mark.unit

TINY = Grid(
    prefill_tokens=(16, 48),
    prefill_batches=(3,),
    decode_batches=(1, 4),
    decode_contexts=(32,),
    transfer_bytes=(1 << 12, 1 << 16),
)


def test_a_tiny_grid_gives_a_complete_document(tiny_model_dir: Path) -> None:
    args = argparse.Namespace(
        model=str(tiny_model_dir), dtype="float32", device="cpu", threads=1, repeats=1
    )
    threads = torch.get_num_threads()
    try:
        profile = measure(args, TINY)
    finally:
        torch.set_num_threads(threads)  # the command sets it for its process
    again = load_profile(msgspec.json.encode(profile))
    assert again == profile and again.version == PROFILE_VERSION
    assert [(p.tokens, p.batch) for p in profile.prefill] == [(16, 1), (48, 1), (48, 3)]
    assert [(p.batch, p.context) for p in profile.decode] == [(1, 32), (4, 32)]
    # both data planes, each from this process to a receiver process
    assert [(p.transport, p.bytes) for p in profile.transfer] == [
        ("tcp", 4096),
        ("tcp", 65536),
        ("ucx", 4096),
        ("ucx", 65536),
    ]
    # the engine thread's KV copies, at the prefill lengths
    assert [(p.op, p.tokens) for p in profile.kv_copy] == [
        (op, tokens) for tokens in (16, 48) for op in ("export", "import", "load", "checkpoint")
    ]
    every = [*profile.prefill, *profile.decode, *profile.transfer, *profile.kv_copy]
    assert all(p.seconds > 0 for p in every)
    # 2 layers x K and V x 2 KV heads x 16 dims x 4 bytes
    assert profile.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4
    assert profile.threads == 1 and profile.machine.cores >= 1 and profile.torch


def test_reading_refuses_what_is_not_a_profile_of_this_version() -> None:
    with pytest.raises(ValueError, match="version"):
        load_profile(b'{"version": 99}')
    with pytest.raises(ValueError, match="not JSON"):
        load_profile(b"{nope")
    with pytest.raises(ValueError, match="not a Tandem profile"):
        load_profile(b'{"version": 1, "model": "x"}')


def test_a_profile_without_kv_copies_still_reads_and_an_unknown_copy_does_not() -> None:
    """Profiles written before the KV copies were measured read as before (the copies then
    cost nothing); a copy of a kind this Tandem does not know is refused, not guessed at."""
    doc = msgspec.json.decode(msgspec.json.encode(sample_profile()))
    del doc["kv_copy"]
    old = load_profile(msgspec.json.encode(doc))
    assert old.kv_copy == [] and CostModel(old).kv_copy("import", 1000) == 0.0
    doc["kv_copy"] = [{"op": "import", "tokens": 100, "seconds": 0.01}]
    costs = CostModel(load_profile(msgspec.json.encode(doc)))
    assert costs.kv_copy("import", 100) == pytest.approx(0.01)
    assert costs.kv_copy("export", 100) == 0.0
    doc["kv_copy"] = [{"op": "teleport", "tokens": 100, "seconds": 0.01}]
    with pytest.raises(ValueError, match="not a Tandem profile"):
        load_profile(msgspec.json.encode(doc))


def test_bad_options_are_one_line_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "profile", "--repeats", "0"]) == 2
    assert "--repeats" in capsys.readouterr().err


def test_a_grid_fits_the_models_context() -> None:
    """A model of 512 positions is measured at 496 tokens at most (the startup grid asks
    for 1,024), each length once; a model of unknown context keeps the grid."""
    fitted = fit(STARTUP, 512)
    assert fitted.prefill_tokens == (64, 256, 496)
    assert fitted.decode_contexts == (128, 496)
    assert fitted.decode_batches == STARTUP.decode_batches
    assert fit(STARTUP, 0) == STARTUP
    assert fit(TINY, 40).prefill_tokens == (16, 24)
