"""Whether a sequence ends with the token it just appended, and why: "stop" (EOS, a stop
token, a stop string, a complete response format) or "length" (max_tokens, the model's
context). The detokenizer and the grammar matcher see the token here, in this order, so a
stop string or a grammar ends the text exactly where it should."""

from __future__ import annotations

from collections.abc import Collection

from shared.engine.guided import Guides
from shared.engine.sequence import Sequence


def stop_reason(
    seq: Sequence, tok: int, eos_ids: Collection[int], guides: Guides, max_model_len: int
) -> str | None:
    """The finish reason `tok` (already appended to `seq.output_ids`) gives, or None."""
    reason: str | None = None
    if tok in eos_ids and not seq.params.ignore_eos:
        reason = "stop"
    elif tok in seq.params.stop_token_ids:
        reason = "stop"  # its text is not part of the output, as EOS's is not
    else:
        if seq.detok is not None:
            seq.detok.add(tok)
            if seq.detok.stopped:
                reason = "stop"
        if guides.advance(seq, tok):
            reason = "stop"  # the response format is complete
    if reason is None and (
        len(seq.output_ids) >= seq.params.max_tokens or seq.num_tokens >= max_model_len
    ):
        reason = "length"
    return reason
