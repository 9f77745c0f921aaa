"""Log-probabilities of generated tokens, for requests that ask (`SamplingParams.logprobs`).

They are the model's own: a log-softmax of the raw logits, taken before penalties, logit
bias, temperature and top-k/top-p change them (vLLM's default, and what `transformers`'
`log_softmax` of the model's output gives), so they do not depend on how a token was
chosen. Only rows that ask pay: a batch without such requests does nothing here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from shared.engine.types import TokenLogprob

if TYPE_CHECKING:
    from shared.engine.sequence import Sequence


@torch.inference_mode()
def model_logprobs(logits: torch.Tensor, batch: list[Sequence]) -> tuple[list[int], torch.Tensor]:
    """The rows of `batch` that ask for logprobs and their log-softmax (a copy: the logits
    are processed in place afterwards)."""
    rows = [i for i, seq in enumerate(batch) if seq.params.logprobs is not None]
    if not rows:
        return rows, logits.new_empty(0)
    return rows, torch.log_softmax(logits[rows].float(), dim=-1)


PROMPT_ROWS = 512  # prompt positions per lm_head pass: a [rows, vocab] float32 at a time


@torch.inference_mode()
def prompt_logprobs(
    logits_of: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    targets: list[int],
    k: int,
) -> list[TokenLogprob]:
    """For each of `hidden`'s rows (prompt positions, in order), the logprob of the prompt
    token that follows it (`targets`, as many) and the top-k there; `logits_of` is the
    model's head. Slice by slice, so a long prompt never holds all its logits at once."""
    out: list[TokenLogprob] = []
    for a in range(0, len(targets), PROMPT_ROWS):
        b = min(a + PROMPT_ROWS, len(targets))
        lp = torch.log_softmax(logits_of(hidden[a:b]), dim=-1)
        chosen = lp.gather(1, torch.tensor(targets[a:b], device=lp.device)[:, None])[:, 0]
        if k:
            values, ids = torch.topk(lp, k, dim=-1)
            out += [
                TokenLogprob(c, i, v)
                for c, i, v in zip(chosen.tolist(), ids.tolist(), values.tolist(), strict=True)
            ]
        else:
            out += [TokenLogprob(c) for c in chosen.tolist()]
    return out


def chosen_logprobs(
    rows: list[int], logprobs: torch.Tensor, batch: list[Sequence], tokens: list[int]
) -> list[TokenLogprob | None]:
    """Per sequence of `batch`: its sampled token's logprob and its top-k alternatives'
    (most likely first), or None if it did not ask."""
    out: list[TokenLogprob | None] = [None] * len(batch)
    for j, i in enumerate(rows):
        k = batch[i].params.logprobs or 0
        row = logprobs[j]
        chosen = float(row[tokens[i]])
        if k:
            values, ids = torch.topk(row, k)
            out[i] = TokenLogprob(chosen, ids.tolist(), values.tolist())
        else:
            out[i] = TokenLogprob(chosen)
    return out


def wants_prompt_logprobs(seq: Sequence) -> bool:
    """Asked for, and not yet delivered (a resumed sequence delivered its first token)."""
    return seq.params.prompt_logprobs is not None and not seq.output_ids


def fill_prompt_logprobs(
    prefills: list[tuple[Sequence, int]],
    hidden: torch.Tensor,
    logits_of: Callable[[torch.Tensor], torch.Tensor],
) -> None:
    """After a packed forward of `prefills` (each sequence's next `n` pending tokens, their
    hidden states item after item in `hidden`): each asking sequence's prompt logprobs for
    the positions computed, kept on it until its first token goes out. A chunk past the
    positions it held before (a preempted sequence recomputing) replaces them."""
    offset = 0
    for seq, n in prefills:
        if wants_prompt_logprobs(seq):
            start = seq.num_computed
            count = max(0, min(n, len(seq.prompt_ids) - 1 - start))  # the last predicts output
            targets = seq.prompt_ids[start + 1 : start + 1 + count]
            k = seq.params.prompt_logprobs or 0
            rows = hidden[offset : offset + count]
            seq.prompt_logprobs = (seq.prompt_logprobs or [])[:start] + prompt_logprobs(
                logits_of, rows, targets, k
            )
        offset += n
