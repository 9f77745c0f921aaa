"""What vLLM's engine brings reaches users (issue 51): architectures the native engine does
not serve run through the whole stack on `--engine vllm`. A tiny random Qwen3 and a tiny
random Qwen3-MoE (4 experts, 2 a token; tests/tiny_models.py), one vLLM decode node each
behind one router, answer greedy completions exactly as `transformers`' `generate` does on
the same weights."""

from __future__ import annotations

import random
from pathlib import Path

import aiohttp
import pytest
import torch
import transformers

from shared.bus.server import free_port
from tests.e2e.conftest import running_stack, wait_for_every_node
from tests.e2e.test_vllm_engine import need_vllm
from tests.tiny_models import FAMILIES, MOE, save_tiny

pytestmark = pytest.mark.e2e

MODELS = {"tiny-qwen3": FAMILIES["qwen3"], "tiny-qwen3-moe": MOE["qwen3-moe"]}
NEW_TOKENS = 16


def reference(path: Path, prompts: list[list[int]]) -> list[str]:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    texts = []
    for prompt in prompts:
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
            eos_token_id=None, pad_token_id=0,
        )[0, len(prompt) :].tolist()  # fmt: skip
        texts.append(tokenizer.decode(out))
    return texts


async def test_tiny_qwen3_and_moe_on_vllm_answer_as_transformers_does(
    real_model_dir: Path, tmp_path: Path
) -> None:
    need_vllm()
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in (5, 23, 61)]
    dirs = {name: save_tiny(kind, extra, tmp_path / name, real_model_dir)
            for name, (kind, extra) in MODELS.items()}  # fmt: skip
    expected = {name: reference(path, prompts) for name, path in dirs.items()}
    assert all(len(set(texts)) > 1 for texts in expected.values())  # prompts lead apart
    argv = ["--engine", "vllm", "--decode", "1", "--port", str(free_port()),
            "--kv-cache-mb", "64", "--heartbeat-ttl", "2"]  # fmt: skip
    for name, path in dirs.items():
        argv += ["--model", f"{name}={path}"]
    with running_stack(argv, tmp_path / "stack.log") as stack:
        wait_for_every_node(stack, timeout=300)
        got: dict[str, list[str]] = {name: [] for name in dirs}
        async with aiohttp.ClientSession() as s:
            for name in dirs:
                for prompt in prompts:
                    body = {"model": name, "prompt": prompt, "max_tokens": NEW_TOKENS,
                            "temperature": 0, "ignore_eos": True}  # fmt: skip
                    async with s.post(stack.url + "/v1/completions", json=body) as resp:
                        assert resp.status == 200, await resp.text()
                        got[name].append((await resp.json())["choices"][0]["text"])
    assert got == expected
