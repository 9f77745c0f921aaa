"""Incremental detokenisation and stop strings for streamed output.

Text is emitted only once it is stable: a token that ends inside a multi-byte character
decodes to U+FFFD until the next token completes it, and text that could be the start of a
stop string is held back until it is known not to be one, so a client never sees a partial
stop string or a broken character.
"""

from __future__ import annotations

from typing import Any

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, honouring stop strings."""

    def __init__(self, tokenizer: Any, prompt_tail: list[int], stop: tuple[str, ...]) -> None:
        self.tokenizer = tokenizer
        # A few prompt tokens give the decoder context for leading spaces of the first word.
        self.ids: list[int] = list(prompt_tail)
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # all stable output text so far
        self.emitted = 0  # chars of self.text already returned
        self.stopped = False

    def add(self, token_id: int) -> None:
        """Feed one generated token (not called for a final EOS token)."""
        if self.stopped:
            return
        self.ids.append(token_id)
        prefix = self.tokenizer.decode(
            self.ids[self.prefix_offset : self.read_offset], skip_special_tokens=True
        )
        full = self.tokenizer.decode(self.ids[self.prefix_offset :], skip_special_tokens=True)
        if len(full) > len(prefix) and not full.endswith(_REPLACEMENT):
            start = len(self.text)
            self.text += full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            self._check_stop(start)

    def _check_stop(self, new_from: int) -> None:
        if not self.stop:
            return
        window_start = max(0, new_from - self.hold)
        cut = -1
        for s in self.stop:
            at = self.text.find(s, window_start)
            if at != -1 and (cut == -1 or at < cut):
                cut = at
        if cut != -1:
            self.text = self.text[:cut]
            self.stopped = True

    def delta(self, final: bool) -> str:
        """New text since the last call (all of it when `final`)."""
        end = len(self.text) if (final or self.stopped) else max(0, len(self.text) - self.hold)
        end = max(end, self.emitted)
        out = self.text[self.emitted : end]
        self.emitted = end
        return out
