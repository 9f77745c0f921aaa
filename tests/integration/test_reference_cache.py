"""The stored chaos reference is trusted only where it still holds (e2e/reference_cache.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shared.model.loader import LoadedModel
from tests.e2e import reference_cache
from tests.e2e.chaos import chaos_requests

pytestmark = pytest.mark.integration


def test_stored_reference_is_refused_when_it_no_longer_holds(
    real_model: LoadedModel, real_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    requests = chaos_requests(real_model)
    stored = json.loads(reference_cache.FILE.read_text())
    assert stored["fingerprint"] == reference_cache.fingerprint(real_model_dir, requests), (
        "the stored reference is stale: run python -m tests.e2e.reference_cache"
    )
    monkeypatch.setattr(reference_cache, "FILE", tmp_path / "ref.json")

    def load_with(record: dict[str, object]) -> str:
        reference_cache.FILE.write_text(json.dumps(record))
        texts, why = reference_cache.load(real_model, real_model_dir, requests)
        assert texts is None
        return why

    other = dict(stored["fingerprint"], torch="0.0")
    assert "another model" in load_with(dict(stored, fingerprint=other))
    assert "wrong shape" in load_with(dict(stored, texts=stored["texts"][:-1]))
    # one token changed where the spot check looks: the run now disagrees
    i = reference_cache.spot_index(requests)
    tampered = [list(t) for t in stored["texts"]]
    tampered[i][5] += "x"
    assert "differs" in load_with(dict(stored, texts=tampered))
