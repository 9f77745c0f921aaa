"""`tandem plan project`: roofline profiles for hardware that is not here (the worked KV
example, parameter counts, the shape of the curves, the document and the command)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import msgspec
import pytest

from shared.costs.profile import load_profile
from tandem.plan import project
from tandem.plan.project import (
    Roofline,
    kv_transfer_example,
    load_hardware,
    load_model_shape,
)

pytestmark = pytest.mark.unit

H100 = load_hardware("h100")
LLAMA_8B = load_model_shape("llama-8b")
LLAMA_70B = load_model_shape("llama-70b")


def test_the_worked_kv_example_comes_out() -> None:
    # 80 layers x K and V x 8 KV heads x 128 dims x 2 bytes, 4,096 tokens, 50 GB/s
    assert LLAMA_70B.kv_bytes_per_token == 327_680
    nbytes, seconds = kv_transfer_example(H100, LLAMA_70B, 4096)
    assert nbytes == pytest.approx(1.342e9, rel=0.005)
    assert seconds == pytest.approx(26.8e-3, abs=0.5e-3)
    # the same through the transfer formula at network efficiency 1 and no latency
    ideal = msgspec.structs.replace(H100, network_efficiency=1.0, network_latency=0.0)
    assert Roofline(ideal, LLAMA_70B, 8).transfer(nbytes) == pytest.approx(seconds)
    # the shipped default efficiency makes it slower, not faster
    assert Roofline(H100, LLAMA_70B, 8).transfer(nbytes) > seconds


def test_parameter_counts_match_the_published_sizes() -> None:
    assert LLAMA_8B.parameters == pytest.approx(8.03e9, rel=0.03)
    assert LLAMA_70B.parameters == pytest.approx(70.6e9, rel=0.03)
    assert LLAMA_70B.forward_parameters < LLAMA_70B.parameters  # the table is only indexed


def test_a_tied_head_is_counted_once() -> None:
    config = json.loads((Path(project.__file__).parent / "models" / "llama-8b.json").read_text())
    untied = project.ModelShape.from_config(config, "untied")
    tied = project.ModelShape.from_config({**config, "tie_word_embeddings": True}, "tied")
    table = untied.vocab * untied.hidden
    assert untied.parameters - tied.parameters == table
    assert tied.forward_parameters == untied.forward_parameters


def test_decode_grows_with_batch_and_context_and_reads_the_weights_at_least() -> None:
    roof = Roofline(H100, LLAMA_70B, 8)
    floor = LLAMA_70B.parameters * 2 / (8 * H100.memory_bandwidth)
    batches, contexts = [1, 4, 16, 64, 256], [128, 1024, 8192, 32768]
    for context in contexts:
        times = [roof.decode(b, context) for b in batches]
        assert times == sorted(times) and len(set(times)) == len(times)
        assert all(t >= floor for t in times)
    for batch in batches:
        times = [roof.decode(batch, c) for c in contexts]
        assert times == sorted(times) and len(set(times)) == len(times)


def test_prefill_grows_about_linearly_with_tokens() -> None:
    roof = Roofline(H100, LLAMA_70B, 8)
    work = {n: roof.prefill(n) - H100.step_overhead for n in (1024, 2048, 4096, 8192)}
    for n in (1024, 2048, 4096):
        assert 1.9 < work[2 * n] / work[n] < 2.2  # the matmuls, plus a little attention
    # a short prompt still reads every weight once
    assert roof.prefill(1) >= roof.weight_bytes / (8 * H100.memory_bandwidth)
    # a batch of 4 is about 4 prompts' work
    assert roof.prefill(1024, 4) == pytest.approx(4 * work[1024] + H100.step_overhead, rel=0.02)


def test_the_projected_profile_reads_back_and_says_it_is_a_projection() -> None:
    profile = project.project(load_hardware("h200"), LLAMA_8B, model_config="llama-8b")
    again = load_profile(msgspec.json.encode(profile))
    assert again == profile
    assert again.projection is not None and "not a measurement" in again.projection.note
    assert again.projection.parameters == LLAMA_8B.parameters
    assert again.projection.memory_bandwidth == 4.8e12 and again.projection.gpus == 8
    assert again.dtype == "bfloat16" and again.threads == 0 and again.model == "llama-8b"
    assert again.machine.device == "cuda (projected)"
    assert again.kv_bytes_per_token == 131_072
    tokens = [p.tokens for p in profile.prefill if p.batch == 1]
    assert tokens[0] == 64 and tokens[-1] == 32768 and len(tokens) == 10
    assert any(p.batch > 1 for p in profile.prefill)
    assert {p.batch for p in profile.decode} == {1 << i for i in range(10)}
    assert {p.context for p in profile.decode} == {1 << i for i in range(7, 16)}
    sizes = [p.bytes for p in profile.transfer]
    assert sizes[0] == 64 << 10 and sizes[-1] == 8 << 30
    assert {p.transport for p in profile.transfer} == {"rdma"}
    every = [p.seconds for p in profile.prefill] + [p.seconds for p in profile.decode]
    assert all(s > 0 for s in every + [p.seconds for p in profile.transfer])


def test_a_measured_profile_without_the_field_still_reads() -> None:
    profile = project.project(H100, LLAMA_8B)
    raw = msgspec.to_builtins(profile)
    del raw["projection"]
    assert load_profile(msgspec.json.encode(raw)).projection is None


def _run(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    project.add_parser(sub)
    args = parser.parse_args(["project", *argv])
    return int(args.func(args))


def test_the_command_writes_a_profile_and_prints_a_summary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "p.json"
    assert _run("--hardware", "h100", "--model-config", "llama-70b", "--output", str(out)) == 0
    profile = load_profile(out.read_bytes())
    assert profile.projection is not None and profile.model == "llama-70b"
    lines = capsys.readouterr().out.splitlines()
    assert all("projection" in line for line in lines)
    summary = "\n".join(lines)
    assert "70.55 B" in summary and "327,680 bytes" in summary
    assert "1.34 GB" in summary and "26.8 ms" in summary


def test_the_command_reads_files_too(tmp_path: Path) -> None:
    hardware = tmp_path / "box.json"
    hardware.write_text(
        json.dumps(
            {
                "name": "Box",
                "gpus": 1,
                "peak_flops": 1e14,
                "memory_bandwidth": 1e12,
                "memory_bytes": 48e9,
                "interconnect_bandwidth": 12.5e9,
            }
        )
    )
    model = tmp_path / "tiny"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps(
            {
                "hidden_size": 64,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "intermediate_size": 128,
                "vocab_size": 100,
            }
        )
    )
    out = tmp_path / "p.json"
    assert (
        _run("--hardware", str(hardware), "--model-config", str(model), "--output", str(out)) == 0
    )
    profile = load_profile(out.read_bytes())
    assert profile.model == "tiny" and profile.kv_bytes_per_token == 2 * 2 * 64 * 2


@pytest.mark.parametrize(
    ("argv", "content", "message"),
    [
        (["--hardware", "b300"], None, "'b300' is neither a file nor a shipped hardware name"),
        (["--model-config", "{cfg}"], "{nope", "model config"),
        (["--model-config", "{cfg}"], "[1, 2]", "not a JSON object"),
        (["--model-config", "{cfg}"], '{"hidden_size": 64}', "lacks num_hidden_layers"),
        (["--hardware", "{cfg}"], '{"name": "x", "gpus": 0}', "hardware"),
        (["--model-config", "llama-70b", "--gpus", "1"], None, "do not fit"),
        (["--tokens", "0"], None, "--tokens"),
    ],
)
def test_bad_inputs_are_one_line_errors(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    content: str | None,
    message: str,
) -> None:
    cfg = tmp_path / "bad.json"
    if content is not None:
        cfg.write_text(content)
    out = tmp_path / "p.json"
    argv = [a.replace("{cfg}", str(cfg)) for a in argv]
    assert _run(*argv, "--output", str(out)) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1
    assert not out.exists()
