"""What a benchmark sends: length distributions and prompts of an exact token count.

A length spec is `N` or `fixed:N`, `uniform:A:B` (inclusive), or `mix:SHORT:LONG:FRACTION`
(FRACTION of requests get LONG tokens, the rest SHORT: the long-prompt/short-prompt mix).

Prompts are random words drawn from the model's own vocabulary: tokens that decode to
" word" (a space, lower-case ASCII letters) and encode back to themselves. Such words join
with spaces into text that tokenizes to exactly one token per word, so the same prompt can
be sent as token ids (`--prompt-format tokens`, the default: exact by construction, and no
tokenizer work on the server) or as text (`--prompt-format text`, for servers that take
only strings) with the same length either way. Random words also keep prompts from sharing
prefixes, so prefix caching cannot flatter either side of a comparison.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from shared.errors import ModelLoadError


@dataclass(frozen=True)
class LengthDist:
    kind: str  # fixed | uniform | mix
    low: int  # fixed: the length; uniform: lower bound; mix: the short length
    high: int  # uniform: upper bound; mix: the long length; fixed: = low
    fraction: float = 0.0  # mix: share of long ones

    def sample(self, rng: random.Random) -> int:
        if self.kind == "uniform":
            return rng.randint(self.low, self.high)
        if self.kind == "mix":
            return self.high if rng.random() < self.fraction else self.low
        return self.low

    def __str__(self) -> str:
        if self.kind == "uniform":
            return f"uniform:{self.low}:{self.high}"
        if self.kind == "mix":
            return f"mix:{self.low}:{self.high}:{self.fraction:g}"
        return f"fixed:{self.low}"


def parse_lengths(spec: str) -> LengthDist:
    """argparse `type=`: a length spec (see the module docstring) or ValueError."""
    parts = spec.strip().split(":")
    try:
        if len(parts) == 1 or (parts[0] == "fixed" and len(parts) == 2):
            n = int(parts[-1])
            dist = LengthDist("fixed", n, n)
        elif parts[0] == "uniform" and len(parts) == 3:
            dist = LengthDist("uniform", int(parts[1]), int(parts[2]))
        elif parts[0] == "mix" and len(parts) == 4:
            dist = LengthDist("mix", int(parts[1]), int(parts[2]), float(parts[3]))
        else:
            raise ValueError("unknown form")
    except ValueError as exc:
        raise ValueError(
            f"bad length spec {spec!r} (N, fixed:N, uniform:A:B or mix:SHORT:LONG:FRACTION)"
        ) from exc
    if dist.low < 1 or dist.high < dist.low or not 0 <= dist.fraction <= 1:
        raise ValueError(f"bad length spec {spec!r}: lengths ≥ 1, A ≤ B, 0 ≤ FRACTION ≤ 1")
    return dist


@dataclass
class RequestSpec:
    prompt_ids: list[int]
    prompt_text: str
    max_tokens: int


def word_vocabulary(tokenizer: Any) -> tuple[list[int], list[str]]:
    """Token ids (and their text) that are one lower-case word each, stable under re-encoding."""
    n = len(tokenizer)
    texts = tokenizer.batch_decode([[i] for i in range(n)])
    candidates = [
        (i, t)
        for i, t in enumerate(texts)
        if len(t) > 2 and t[0] == " " and t[1:].isascii() and t[1:].isalpha() and t[1:].islower()
    ]
    special = set(getattr(tokenizer, "all_special_ids", []))
    encoded = tokenizer([t for _, t in candidates], add_special_tokens=False)["input_ids"]
    words = [(i, t) for (i, t), ids in zip(candidates, encoded, strict=True) if ids == [i]]
    words = [(i, t) for i, t in words if i not in special]
    if len(words) < 100:
        raise ModelLoadError(f"the tokenizer has only {len(words)} single-token words")
    return [i for i, _ in words], [t for _, t in words]


def load_bench_tokenizer(name: str) -> Any:
    """The tokenizer of a Tandem model name/path, else a Hugging Face id or directory."""
    from transformers import AutoTokenizer

    from shared.model.convert import converted_dir
    from shared.model.source import resolve_model

    try:
        return AutoTokenizer.from_pretrained(converted_dir(resolve_model(name)))
    except ModelLoadError:
        try:
            return AutoTokenizer.from_pretrained(name)
        except Exception as exc:  # hub, path and format errors all mean "no tokenizer"
            raise ModelLoadError(f"no tokenizer for {name!r}: {exc}") from exc


@dataclass
class Workload:
    prompt_lengths: LengthDist
    output_lengths: LengthDist
    vocab_ids: list[int]
    vocab_text: list[str]

    def requests(self, n: int, seed: int | str) -> list[RequestSpec]:
        """n requests; the same (workload, seed) gives the same requests in every run."""
        words = random.Random(f"{seed}/words")
        out = []
        for length, max_tokens in sample_lengths(self.prompt_lengths, self.output_lengths, n, seed):
            picks = [words.randrange(len(self.vocab_ids)) for _ in range(length)]
            out.append(
                RequestSpec(
                    prompt_ids=[self.vocab_ids[k] for k in picks],
                    prompt_text="".join(self.vocab_text[k] for k in picks),
                    max_tokens=max_tokens,
                )
            )
        return out


def sample_lengths(
    prompt: LengthDist, output: LengthDist, n: int, seed: int | str
) -> list[tuple[int, int]]:
    """(prompt tokens, max_tokens) of n requests. Drawn apart from the prompts' words, so
    `tandem plan simulate` gets the very lengths `tandem bench serve` sends for a seed
    without the tokenizer's vocabulary."""
    rng = random.Random(seed)
    return [(prompt.sample(rng), output.sample(rng)) for _ in range(n)]
