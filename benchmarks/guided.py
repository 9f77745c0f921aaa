"""Structured output's cost: decode steps with every row under a JSON schema
(`response_format`, llguidance) against the same steps unconstrained, at batch 1 and 16;
the mask's own time per row and token; and what a new grammar costs to set up.

Every configuration runs once per round, in rotating order (A/B interleaving); the table
shows medians over rounds and ratios measured in the same run.

    python benchmarks/guided.py [--rounds 5] [--tokens 48]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict

import torch
from llguidance import LLMatcher

from shared.engine.engine import Engine, EngineConfig
from shared.grammar import grammar_for
from shared.model.loader import LoadedModel, load_model
from shared.sampling_params import SamplingParams
from tandem.plan.profile import cpu_flags

# An array of numbers: every row stays inside the grammar for the whole run (no early end).
SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 100, "maximum": 999}}
NESTED = {  # a richer schema, for the set-up time
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["street"],
        },
        "scores": {"type": "array", "items": {"type": "number"}},
    },
    "required": ["name", "tags"],
}
PROMPT = "Write a long list of three-digit numbers as JSON:"


def decode_step_ms(model: LoadedModel, batch: int, tokens: int, guide: str) -> tuple[float, float]:
    """Median decode-step time (ms) over `tokens` steps of `batch` sequences, and the
    median time (ms) the guide's masks took per step (0 unguided)."""
    engine = Engine(model, EngineConfig(num_blocks=2048, detokenize=False))
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True, guide=guide)
    ids = model.encode(PROMPT)
    for _ in range(batch):
        engine.add_request(ids, params)
    masks: list[float] = []
    constrain = engine.guides.constrain

    def timed(logits: torch.Tensor, seqs: list) -> None:  # type: ignore[type-arg]
        t = time.perf_counter()
        constrain(logits, seqs)
        masks.append(time.perf_counter() - t)

    engine.guides.constrain = timed  # type: ignore[method-assign]
    steps = []
    while engine.has_unfinished():
        decoding = not engine.scheduler.waiting
        t = time.perf_counter()
        engine.step()
        if decoding:
            steps.append(time.perf_counter() - t)
    return statistics.median(steps) * 1e3, (statistics.median(masks) * 1e3 if guide else 0.0)


def setup_ms(model: LoadedModel, schema: dict) -> float:  # type: ignore[type-arg]
    """A new grammar: compiled, checked, a matcher made and its first mask computed."""
    from shared.engine.guided import Guides

    guides = Guides(model.tokenizer, int(model.hf_model.config.vocab_size))
    guides._llg_tokenizer()  # once per node, not per request
    t = time.perf_counter()
    grammar = grammar_for({"type": "json_schema", "json_schema": {"schema": schema}})
    matcher = LLMatcher(guides._llg_tokenizer(), grammar, log_level=0)
    matcher.compute_bitmask()
    return (time.perf_counter() - t) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=48)
    args = ap.parse_args()
    model = load_model(None, dtype="float32", device="cpu")
    guide = grammar_for({"type": "json_schema", "json_schema": {"schema": SCHEMA}})
    configs = [(b, g) for b in (1, 16) for g in ("", guide)]
    steps: dict[tuple[int, bool], list[float]] = defaultdict(list)
    masks: dict[int, list[float]] = defaultdict(list)
    setups: dict[str, list[float]] = defaultdict(list)
    for r in range(args.rounds):
        for i in range(len(configs)):
            batch, g = configs[(i + r) % len(configs)]
            step, mask = decode_step_ms(model, batch, args.tokens, g)
            steps[(batch, bool(g))].append(step)
            if g:
                masks[batch].append(mask / batch)
        for name, schema in (("array", SCHEMA), ("nested", NESTED)):
            setups[name].append(setup_ms(model, schema))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; cpu flags: {cpu_flags()}")
    print(f"\nDecode step, median of {args.rounds} rounds x {args.tokens} tokens (ms)")
    print("| batch | plain | guided | guided/plain | mask per row and token |")
    print("|---:|---:|---:|---:|---:|")
    for batch in (1, 16):
        plain = statistics.median(steps[(batch, False)])
        guided = statistics.median(steps[(batch, True)])
        mask = statistics.median(masks[batch])
        print(f"| {batch} | {plain:.1f} | {guided:.1f} | {guided / plain:.2f}x | {mask:.2f} |")
    print("\nA new grammar: compile, check, matcher, first mask (ms, median)")
    for name, values in setups.items():
        print(f"- {name}: {statistics.median(values):.1f}")
    print(json.dumps({"steps": {f"{k[0]}/{k[1]}": v for k, v in steps.items()}}))


if __name__ == "__main__":
    main()
