"""A journal entry holds its request's current job and the response's shape, nothing that
repeats the job: a resume by another router takes it over under a new attempt whose job
is what the entry then holds (services/router/resume.py), and what the next takeover, or
the janitor, reads the attempt from."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import pytest

from services.router.resume import claim
from shared.bus.ids import RequestId, attempt_id
from shared.bus.messages import JournalEntry, NodeInfo, PrefillJob, decode, encode
from shared.sampling_params import SamplingParams

pytestmark = pytest.mark.unit


class Journal:
    def __init__(self) -> None:
        self.claims: list[tuple[JournalEntry, int]] = []

    async def claim(self, entry: JournalEntry, revision: int) -> bool:
        self.claims.append((entry, revision))
        return True


def parts(journal: Journal, node_id: str) -> Any:
    config = SimpleNamespace(node_id=node_id, first_token_timeout=60.0)
    return cast(Any, SimpleNamespace(config=config, journal=journal))


async def test_a_takeover_journals_the_new_attempts_job() -> None:
    rid = RequestId("cmpl-1")
    job = PrefillJob(attempt_id=attempt_id(rid), prompt_ids=[1, 2, 3],
                     params=SamplingParams(max_tokens=9, seed=5), decode_node="d1",
                     model="m")  # fmt: skip
    entry = JournalEntry(request_id=rid, router_id="r-gone", job=job, chat=True,
                         output_ids=[7, 8, 9])  # fmt: skip
    assert entry.attempt_id == job.attempt_id
    journal = Journal()
    d2 = NodeInfo(node_id="d2", role="decode")
    claimed, new = await claim(parts(journal, "r2"), entry, 4, job, d2, [7, 8])
    assert journal.claims == [(claimed, 4)]
    assert claimed.job == new and claimed.attempt_id == new.attempt_id != job.attempt_id
    assert new.decode_node == "d2" and new.output_ids == claimed.output_ids == [7, 8]
    assert new.params == job.params and new.model == "m"  # the seed and model carried
    assert claimed.router_id == "r2" and claimed.chat and claimed.state == "resumed"
    # what the next router reads back: the same, the attempt from the job
    again = decode(encode(claimed), JournalEntry)
    assert again.attempt_id == new.attempt_id and again.job == new


def test_an_entry_without_a_job_has_no_attempt() -> None:
    assert JournalEntry(request_id=RequestId("r")).attempt_id == ""
