"""What a prefill node could gain by sending a prompt's KV while it still computes the rest
(issue 23: "prefill nodes can start sending the first chunks' KV before the whole prompt
is done, if that helps — measure").

Today a prefill node sends a prompt's KV once the whole prompt is computed, so the first
token waits for prefill + export + transfer + import. Sent a piece at a time as the pieces
are computed (per chunk of `--chunk` tokens, or per layer as Mooncake and Dynamo do on
GPUs), the transfer of every piece but the last overlaps the compute: that is the most it
can save. The export and import copies stay where they are (engine-thread work either
way), and on a CPU node the send's own CPU still comes from the cores that compute.

For each profile (one measured here with `tandem plan profile --threads 1`, and the
projected H100/H200 nodes with an 8B and a 70B model) and prompt length, it prints the
phases of the first token's path from the profile's costs and that bound, in seconds and
as a share of the time to first token.

    .venv/bin/python benchmarks/early_send.py --profile full-t1.json [--chunk 512]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = (1500, 4096)
PROJECTED = (("h100", "llama-8b", 1), ("h100", "llama-70b", 4), ("h200", "llama-70b", 4))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", required=True, help="a `tandem plan profile` JSON of this host")
    ap.add_argument("--chunk", type=int, default=512, help="tokens per piece sent early")
    ap.add_argument("--transport", default=None, help="the profile's transport (default: first)")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from shared.costs.model import CostModel
    from shared.costs.profile import read_profile
    from tandem.plan.project import load_hardware, load_model_shape, project

    sources = [(f"measured: {Path(args.profile).name}", read_profile(args.profile), args.chunk, 1)]
    for hardware, model, gpus in PROJECTED:
        shape = load_model_shape(model)
        profile = project(load_hardware(hardware), shape, gpus=gpus)
        # on a GPU, pieces go out per layer: all but one layer's share overlaps
        sources.append((f"projected: {hardware} x{gpus}, {model}", profile, 0, shape.layers))
    print("| profile | prompt | prefill s | export s | KV MB | transfer s | import s "
          "| TTFT s | early sending saves at most |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, profile, chunk, layers in sources:
        costs = CostModel(profile, args.transport if name.startswith("measured") else None)
        for tokens in PROMPTS:
            prefill = costs.prefill(tokens)
            export, imp = costs.kv_copy("export", tokens), costs.kv_copy("import", tokens)
            transfer = costs.kv_transfer(tokens)
            last = costs.kv_transfer(min(tokens, chunk)) if chunk else transfer / layers
            ttft = prefill + export + transfer + imp
            saved = max(0.0, transfer - last)
            print(
                f"| {name} | {tokens:,} | {prefill:.3f} | {export:.3f} | "
                f"{tokens * costs.kv_bytes_per_token / 1e6:,.0f} | {transfer:.4f} | {imp:.3f} | "
                f"{ttft:.3f} | {saved * 1e3:.1f} ms ({saved / ttft:.1%}) |"
            )
    print(f"\n(measured: pieces of {args.chunk} tokens; projected: one layer's share last)")


if __name__ == "__main__":
    main()
