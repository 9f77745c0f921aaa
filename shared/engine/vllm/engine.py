"""vLLM's v1 engine core behind Tandem's engine seam (shared/engine/interface.py).

The engine runs in-process on the node's engine thread (`VLLM_ENABLE_V1_MULTIPROCESSING=0`:
no engine-core process, no HTTP hop): `add_request`, `step` and `abort_request` of vLLM's
`LLMEngine` are called where the native engine's would be, and its outputs (deltas: new
token ids and text) become Tandem's `StepOutput`s, so the node's streams, spans, metrics
and the router's journal work unchanged.

What it does and does not do yet (issue 51):
- Requests: every sampling parameter Tandem takes. A `response_format` goes to vLLM's
  structured outputs as the JSON schema Tandem's grammar was built from, on vLLM's
  guidance backend (llguidance, as the native engine); a guided request does not resume
  (below). vLLM detokenizes and applies stop strings itself.
- Resume (`output_ids`): the tokens generated before join the prompt and the budgets shrink
  by them, so the context is recomputed. A greedy stream resumes exactly. A seeded one
  does not: vLLM's sampler draws from a per-request generator seeded at the request's
  start and advanced by every step's draw, and a resumed request starts a new one, so its
  later tokens are a valid sample of the same distribution but not the uninterrupted
  run's. Presence and frequency penalties count only the tokens generated after the
  resume (vLLM counts them over output, and the old output is now prompt). A guided
  request is refused on resume with a clear error: its grammar would start over.
- KV moves: none (kv.py says why): no hand-off from a prefill node (`add_snapshot`,
  `export` refuse), no checkpoints, no prefix loads across nodes. Its `hash_key` differs
  from every native engine's, so no native node hands it KV.
"""

from __future__ import annotations

import itertools
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from shared.engine.limits import RequestLimits
from shared.engine.types import EngineStats, SequenceState, StepOutput, TokenLogprob
from shared.engine.vllm.kv import NoBlockMoves, NoTailMoves, VllmPool
from shared.engine.vllm.params import to_vllm, token_logprobs, unsupported
from shared.errors import InvalidRequestError, WireFormatError
from shared.kv.paged_cache import KVLayout
from shared.kv.tail import TailBlock
from shared.sampling_params import SamplingParams

log = logging.getLogger("tandem.engine.vllm")
BLOCK_SIZE = 128  # tokens a KV block: vLLM's CPU default, named so the context fits its pool


@dataclass
class VllmConfig:
    """What a node asks of vLLM's engine (the native engine's options where they apply)."""

    model_dir: str
    served_name: str
    dtype: str = "float32"
    kv_cache_bytes: int = 512 << 20
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    enable_prefix_caching: bool = True


@dataclass
class Tracked:
    """A request as this adapter follows it: what its deltas are counted from."""

    prompt_len: int  # the client's prompt (a resume's earlier output is not part of it)
    already: int  # output tokens generated before this engine took the request
    params: SamplingParams
    produced: int = 0
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    started: bool = False  # its first token is out


def quiet_in_process() -> None:
    """The environment vLLM reads at import: engine core in this process, logs at WARNING.
    Set before vLLM is imported (it reads them once)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")


class VllmEngine:
    """One model on vLLM's engine, as a node sees an `EngineCore`."""

    def __init__(self, config: VllmConfig) -> None:
        quiet_in_process()
        from vllm import EngineArgs, LLMEngine
        from vllm.config import StructuredOutputsConfig

        self.config = config
        args = EngineArgs(
            model=config.model_dir,
            served_model_name=[config.served_name],
            dtype=config.dtype,
            enforce_eager=True,  # no compile step at start (minutes on CPU)
            block_size=BLOCK_SIZE,
            max_model_len=config.max_model_len or context_that_fits(config),
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            enable_prefix_caching=config.enable_prefix_caching,
            kv_cache_memory_bytes=config.kv_cache_bytes,
            disable_log_stats=True,
            # response_format: llguidance, the library Tandem's own grammars come from
            structured_outputs_config=StructuredOutputsConfig(backend="guidance"),
        )
        self.llm = LLMEngine.from_engine_args(args)
        self._core: Any = self.llm.engine_core.engine_core  # type: ignore[attr-defined]
        self._scheduler: Any = self._core.scheduler
        model_config = self.llm.model_config
        self._max_model_len = int(model_config.max_model_len)
        self._block_size = int(self.llm.vllm_config.cache_config.block_size)
        self._vocab = int(model_config.get_vocab_size())
        self._pool = VllmPool(self._scheduler.kv_cache_manager.block_pool)
        self._layout = KVLayout.of_config(
            model_config.hf_config, self._block_size, getattr(torch, config.dtype)
        )
        self.limits = RequestLimits(
            self._max_model_len, self._vocab, self._block_size, self._pool.num_blocks
        )
        self.exchange = NoBlockMoves()
        self.tails = NoTailMoves()
        self.stats = EngineStats()
        self.requests: dict[str, Tracked] = {}
        self._ids = itertools.count()
        log.info(
            "vLLM engine for %s: %d KV blocks of %d tokens, context %d",
            config.served_name, self._pool.num_blocks, self._block_size, self._max_model_len,
        )  # fmt: skip

    # ---- what it is ------------------------------------------------------------------------

    kind = "vllm"

    @property
    def served_name(self) -> str:
        return self.config.served_name

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def hash_key(self) -> str:
        return f"vllm/{self.config.served_name}/{self.config.dtype}"

    @property
    def layout(self) -> KVLayout:
        return self._layout

    @property
    def pool(self) -> VllmPool:
        return self._pool

    def serves(self, model: str) -> bool:
        return model in ("", self.config.served_name)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self._block_size)

    # ---- requests --------------------------------------------------------------------------

    def validate(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        output_ids: list[int] | None = None,
    ) -> None:
        self.limits.check(request_id, prompt_ids, params, output_ids, known=self.requests)
        why = unsupported(params, len(output_ids or []))
        if why is not None:
            raise InvalidRequestError(why, request_id=request_id, param="response_format")

    def add_request(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        output_ids: list[int] | None = None,
        tail: TailBlock | None = None,
    ) -> str:
        """Queue a request; a resumed one (`output_ids`) recomputes its context (see the
        module's docstring for what that preserves). `tail` is never given: this engine's
        `tails.fit` fits none."""
        request_id = request_id or f"req-{next(self._ids)}"
        self.validate(request_id, prompt_ids, params, output_ids)
        before = list(output_ids or [])
        vparams = to_vllm(params, len(before))
        if before:
            vparams.prompt_logprobs = None  # the client had them with the first token
        prompt = {"prompt_token_ids": [*prompt_ids, *before]}
        try:
            self.llm.add_request(request_id, prompt, vparams)
        except (ValueError, TypeError) as exc:  # vLLM's own checks, past ours
            raise InvalidRequestError(
                f"vLLM refused the request: {exc}", request_id=request_id
            ) from exc
        self.requests[request_id] = Tracked(len(prompt_ids), len(before), params)
        return request_id

    def add_snapshot(self, snapshot: SequenceState, kv_frame: bytes | memoryview) -> str:
        raise WireFormatError(
            "a vLLM engine takes no KV hand-off yet (no Tandem KV connector in it)",
            request_id=snapshot.request_id,
        )

    def export(self, request_id: str) -> tuple[SequenceState, memoryview]:
        raise WireFormatError(
            "a vLLM engine exports no KV yet (no Tandem KV connector in it)",
            request_id=request_id,
        )

    def abort(self, request_id: str) -> bool:
        if self.requests.pop(request_id, None) is None:
            return False
        self.llm.abort_request([request_id])
        return True

    def cancel_all(self) -> None:
        for request_id in list(self.requests):
            self.abort(request_id)

    # ---- steps -----------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        outputs = []
        for ro in self.llm.step():
            tracked = self.requests.get(ro.request_id)
            if tracked is None:  # aborted meanwhile
                continue
            out = self._output(ro, tracked)
            if out is not None:
                outputs.append(out)
        self.stats.steps += 1
        self.stats.last_batch_size = len(outputs)
        return outputs

    def _output(self, ro: Any, tracked: Tracked) -> StepOutput | None:
        done = ro.outputs[0]
        ids = [int(t) for t in done.token_ids]
        k = tracked.params.prompt_logprobs
        if ro.prompt_logprobs and k is not None and not tracked.prompt_logprobs:
            # all at once, with the first token; position 0 has none
            prompt = list(ro.prompt_token_ids or [])
            got = token_logprobs(ro.prompt_logprobs[1:], prompt[1:], k)
            tracked.prompt_logprobs = got or []
        if not ids and not ro.finished:
            return None
        first = not tracked.started
        tracked.started = True
        tracked.produced += len(ids)
        if first:
            cached = int(ro.num_cached_tokens or 0)
            self.stats.prefill_tokens += max(0, tracked.prompt_len + tracked.already - cached)
            self.stats.cached_prompt_tokens += cached
        else:
            self.stats.decode_tokens += len(ids)
        if ro.finished:
            self.requests.pop(ro.request_id, None)
        return StepOutput(
            request_id=ro.request_id,
            new_token_ids=ids,
            text=done.text,
            finished=bool(ro.finished),
            finish_reason=done.finish_reason if ro.finished else None,
            num_prompt_tokens=tracked.prompt_len,
            num_output_tokens=tracked.already + tracked.produced,
            num_cached_tokens=int(ro.num_cached_tokens or 0),
            logprobs=token_logprobs(done.logprobs, ids, tracked.params.logprobs),
            prompt_logprobs=(tracked.prompt_logprobs or None) if first and k is not None else None,
        )

    def has_unfinished(self) -> bool:
        return bool(self.llm.has_unfinished_requests())

    @property
    def num_running(self) -> int:
        return len(self._scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self._scheduler.waiting)

    @property
    def num_waiting_midstream(self) -> int:
        """Waiting requests with output already (preempted, or resumed here)."""
        return sum(1 for r in list(self._scheduler.waiting) if r.num_output_tokens > 0)

    def running_tokens(self) -> dict[str, int]:
        try:
            tracked = list(self.requests.items())
        except RuntimeError:  # the engine thread changed the table mid-copy: a scrape lost
            return {}
        return {rid: t.prompt_len + t.already + t.produced for rid, t in tracked if t.started}


def context_that_fits(config: VllmConfig) -> int:
    """The model's context, or less if the node's KV memory cannot hold one request of it:
    vLLM refuses to start then (the native engine starts, and refuses such a request)."""
    from transformers import AutoConfig

    from shared.model.architectures import max_context

    hf_config = AutoConfig.from_pretrained(config.model_dir)
    per_block = KVLayout.of_config(
        hf_config, BLOCK_SIZE, getattr(torch, config.dtype)
    ).bytes_per_block
    fits = (config.kv_cache_bytes // per_block - 2) * BLOCK_SIZE  # vLLM keeps a null block
    context = max_context(hf_config)
    if fits < context:
        log.warning(
            "%d MiB of KV hold %d tokens: the context is cut from %d to %d (--kv-cache-mb)",
            config.kv_cache_bytes >> 20, fits, context, max(fits, BLOCK_SIZE),
        )  # fmt: skip
    return max(BLOCK_SIZE, min(context, fits))
