"""Tandem's `SamplingParams` as vLLM's, and what vLLM's engine cannot take from them (yet).

Only this module and engine.py import vLLM; both are imported only by a node started with
`--engine vllm`, from an environment that has it (`make vllm`)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from shared.engine.types import TokenLogprob
from shared.sampling_params import SamplingParams

if TYPE_CHECKING:
    import vllm


def schema_of(guide: str) -> Any | None:
    """The JSON schema a `response_format` grammar was built from (shared/grammar.py makes
    every one as llguidance's `{"grammars": [{"json_schema": ...}]}`), or None for a grammar
    of another shape."""
    try:
        grammar = json.loads(guide)
    except ValueError:
        return None
    parts = grammar.get("grammars") if isinstance(grammar, dict) else None
    if not isinstance(parts, list) or len(parts) != 1 or not isinstance(parts[0], dict):
        return None
    if set(parts[0]) != {"json_schema"}:
        return None
    return parts[0]["json_schema"]


def unsupported(params: SamplingParams, already: int = 0) -> str | None:
    """Why vLLM's engine under Tandem refuses these parameters, or None.

    A `response_format` goes to vLLM as the JSON schema it came from (its guidance
    backend builds the same llguidance grammar). A guided request cannot resume after
    `already` tokens: the tokens would join the prompt and vLLM would start the grammar
    over, and its API has no way to advance a request's grammar past them."""
    if not params.guide:
        return None
    if schema_of(params.guide) is None:
        return "this response_format grammar has no JSON schema vLLM's engine could follow"
    if already:
        return (
            "a response_format request cannot resume on an --engine vllm node (its grammar "
            "would start over after the tokens already sent)"
        )
    return None


def to_vllm(params: SamplingParams, already: int = 0) -> vllm.SamplingParams:
    """vLLM's parameters for a request that generated `already` tokens before (a resumed
    one: its output so far joins the prompt, and the budgets shrink by it). Deltas out, so
    each step returns only its new tokens and text."""
    from vllm import SamplingParams as VllmParams
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    kwargs: dict[str, Any] = {
        "max_tokens": max(1, params.max_tokens - already),
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else 0,
        "seed": params.seed,
        "stop": list(params.stop) or None,
        "stop_token_ids": list(params.stop_token_ids) or None,
        "ignore_eos": params.ignore_eos,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "repetition_penalty": params.repetition_penalty,
        "logit_bias": dict(params.logit_bias) or None,
        "min_tokens": max(0, params.min_tokens - already),
        "logprobs": params.logprobs,
        "prompt_logprobs": params.prompt_logprobs,
        "output_kind": RequestOutputKind.DELTA,
    }
    if params.guide:
        kwargs["structured_outputs"] = StructuredOutputsParams(json=schema_of(params.guide))
    return VllmParams(**kwargs)


def token_logprobs(
    positions: Any, token_ids: list[int], k: int | None
) -> list[TokenLogprob] | None:
    """vLLM's per-position logprob maps (token id -> Logprob with a rank) as Tandem's: the
    chosen token's logprob, then the `k` most likely tokens' in rank order."""
    if positions is None or k is None:
        return None
    out = []
    for chosen, entries in zip(token_ids, positions, strict=False):
        if entries is None:
            out.append(TokenLogprob(logprob=0.0))
            continue
        ranked = sorted(
            ((lp.rank, tok, lp.logprob) for tok, lp in entries.items() if lp.rank is not None),
            key=lambda e: e[0],
        )
        top = [(tok, lp) for rank, tok, lp in ranked if rank <= k][:k]
        mine = entries.get(chosen)
        out.append(
            TokenLogprob(
                logprob=float(mine.logprob) if mine is not None else float("-inf"),
                top_ids=[int(t) for t, _ in top],
                top_logprobs=[float(lp) for _, lp in top],
            )
        )
    return out
