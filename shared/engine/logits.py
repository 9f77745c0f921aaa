"""Logits processing before sampling: penalties, logit bias and the minimum length.

Applied per row, only to sequences whose parameters ask for it (`processes_logits`), so a
batch of plain requests pays nothing. Each depends only on the sequence's prompt and output
so far, which a resumed sequence has: a failover samples what the lost node would have.

- repetition_penalty (transformers' semantics): the logit of every token in the prompt or
  the output is divided by the penalty when positive, multiplied by it when negative;
- presence_penalty and frequency_penalty (OpenAI's): the logit of every token generated so
  far drops by presence + frequency x its count;
- logit_bias: added to the listed tokens' logits;
- min_tokens: EOS and stop tokens cannot be sampled before that many tokens exist.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

import torch

from shared.sampling_params import SamplingParams

if TYPE_CHECKING:
    from shared.engine.sequence import Sequence as Seq


@torch.inference_mode()  # the logits are inference tensors (the forward made them)
def process_batch(logits: torch.Tensor, batch: list[Seq], eos_ids: Collection[int]) -> None:
    """Process the rows (one per sequence of `batch`) that ask for it, in place."""
    for i, seq in enumerate(batch):
        if seq.params.processes_logits:
            process_row(logits[i], seq.params, seq.prompt_ids, seq.output_ids, eos_ids)


def process_row(
    row: torch.Tensor,
    params: SamplingParams,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    eos_ids: Collection[int],
) -> None:
    """Apply the row's processors to `row` (a `[vocab]` logits tensor) in place."""
    device = row.device
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted({*prompt_ids, *output_ids}), device=device)
        scores = row[seen]
        p = params.repetition_penalty
        row[seen] = torch.where(scores < 0, scores * p, scores / p)
    if (params.presence_penalty or params.frequency_penalty) and output_ids:
        ids, counts = torch.unique(
            torch.tensor(list(output_ids), device=device), return_counts=True
        )
        row[ids] -= params.frequency_penalty * counts.to(row.dtype) + params.presence_penalty
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias], device=device)
        row[ids] += torch.tensor([b for _, b in params.logit_bias], dtype=row.dtype, device=device)
    if len(output_ids) < params.min_tokens:
        banned = {*params.stop_token_ids} | ({*eos_ids} if not params.ignore_eos else set())
        if banned:
            row[torch.tensor(sorted(banned), device=device)] = float("-inf")
