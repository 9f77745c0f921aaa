"""Lent cores (shared/runtime/core_share.py): a decode node steps on every core while the
prefill nodes sharing its host are idle, on its own share while one computes, and a
prefill node starts only once the decode node's wide step has ended (or after a bounded
wait). The launcher gives the file to the nodes that share cores, and to no others. The
nodes' use of it in a running stack: tests/e2e/test_up.py."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
import torch

from shared.runtime import core_share
from shared.runtime.core_share import CoreClaim, LentCores
from tandem.cli import build_parser
from tandem.launcher import Stack

pytestmark = pytest.mark.unit


@pytest.fixture
def threads() -> object:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_decode_steps_wide_only_while_every_prefill_node_idles(
    tmp_path: Path, threads: object
) -> None:
    path = tmp_path / "cores"
    lent = LentCores(path, base=1, lend=2)
    first, second = CoreClaim(path, 0), CoreClaim(path, 1)
    assert lent.before_step() == 2 and torch.get_num_threads() == 2
    lent.after_step()
    second.mem[second.slot] = 1  # what acquire sets first
    assert lent.before_step() == 1 and torch.get_num_threads() == 1
    assert lent.mem[0] == 0  # a narrow step does not hold prefill nodes back
    lent.after_step()
    second.release()
    assert lent.before_step() == 2
    lent.after_step()
    assert (lent.steps, lent.lent_steps) == (3, 2)
    for end in (lent, first, second):
        end.close()


def test_a_prefill_node_waits_for_the_wide_step_to_end(tmp_path: Path, threads: object) -> None:
    path = tmp_path / "cores"
    lent = LentCores(path, base=1, lend=2)
    claim = CoreClaim(path, 0)

    async def run() -> None:
        assert lent.before_step() == 2  # a wide step runs
        acquiring = asyncio.create_task(claim.acquire())
        await asyncio.sleep(0.1)
        assert not acquiring.done()  # it waits for the step
        lent.after_step()
        await asyncio.wait_for(acquiring, 1.0)
        assert lent.before_step() == 1  # the next step leaves the prefill node its core
        lent.after_step()
        claim.release()

    asyncio.run(run())
    assert claim.waited >= 0.1


def test_a_hung_decode_node_does_not_stop_prefills(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, threads: object
) -> None:
    monkeypatch.setattr(core_share, "CLAIM_WAIT", 0.2)
    path = tmp_path / "cores"
    lent = LentCores(path, base=1, lend=2)
    lent.before_step()  # and never ends
    claim = CoreClaim(path, 0)
    asyncio.run(asyncio.wait_for(claim.acquire(), 2.0))
    assert 0.2 <= claim.waited < 2.0 and claim.stuck
    claim.release()
    waited = claim.waited
    asyncio.run(asyncio.wait_for(claim.acquire(), 0.1))  # no second wait for a stuck byte
    assert claim.waited == waited
    claim.release()
    LentCores(path, base=1, lend=2)  # a decode node (re)starting clears what it left
    assert lent.mem[0] == 0
    asyncio.run(claim.acquire())
    assert not claim.stuck


def test_bad_settings_are_refused_and_no_symlink_is_followed(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="base"):
        LentCores(tmp_path / "a", base=3, lend=2)
    with pytest.raises(ValueError, match="at most"):
        CoreClaim(tmp_path / "a", 63)
    target = tmp_path / "target"
    target.write_bytes(b"keep")
    os.symlink(target, tmp_path / "link")
    with pytest.raises(OSError):
        CoreClaim(tmp_path / "link", 0)
    assert target.read_bytes() == b"keep"


def up_plan(*argv: str) -> dict[str, list[str]]:
    args = build_parser().parse_args(["up", *argv])
    return {c.name: c.argv for c in Stack(args).plan()}


def flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def test_the_launcher_shares_cores_between_one_decode_node_and_its_prefill_nodes() -> None:
    plan = up_plan("--split", "--prefill", "2")
    path = flag(plan["decode-1"], "--core-share")
    assert path is not None and not Path(path).exists()  # the nodes create it
    assert flag(plan["prefill-1"], "--core-share") == path
    assert [flag(plan[n], "--core-share-slot") for n in ("prefill-1", "prefill-2")] == ["0", "1"]
    assert flag(plan["decode-1"], "--lend-threads") == str(len(os.sched_getaffinity(0)))
    assert "--core-share" not in plan["router"] and "--core-share" not in plan["kvcache-1"]


@pytest.mark.parametrize(
    "flags",
    [
        ["--split", "--no-core-lending"],
        ["--split", "--pin-cores"],
        ["--split", "--decode", "2"],  # which of them would borrow: none
        ["--colocated"],  # nothing to borrow from
    ],
)
def test_no_lending_where_nodes_keep_cores_of_their_own(flags: list[str]) -> None:
    plan = up_plan(*flags)
    assert not any("--core-share" in argv for argv in plan.values())
