"""Log lines carry at most MAX_FIELD_CHARS of any field: an id or message from outside
(a 256 KiB request id in a NATS message) cannot make every line it causes huge."""

from __future__ import annotations

import json
import logging

import pytest
import structlog

from shared.telemetry.logs import MAX_FIELD_CHARS, bind, get_logger, setup_logs


def test_huge_fields_are_cut_in_stdlib_and_structlog_lines(
    capsys: pytest.CaptureFixture[str],
) -> None:
    setup_logs("test", "node-1", json=True)
    try:
        huge = "x" * 256 * 1024
        bind(request_id=huge)
        logging.getLogger("tandem.test").warning("dropped %s: bad frame", huge)
        get_logger("tandem.test").warning("refused", transfer_id=huge, sizes=list(range(50_000)))
        lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    finally:
        logging.getLogger().handlers = []
        structlog.contextvars.clear_contextvars()
    assert len(lines) == 2
    for line in lines:
        assert len(json.dumps(line)) < 8 * MAX_FIELD_CHARS
        assert line["request_id"].startswith("xxx") and line["request_id"].endswith("more chars]")
    assert lines[0]["event"].startswith("dropped xxx")
    assert lines[1]["transfer_id"].endswith(f"[{256 * 1024 - MAX_FIELD_CHARS} more chars]")
    assert lines[1]["level"] == "warning" and lines[1]["node_id"] == "node-1"
