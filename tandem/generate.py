"""`tandem generate`: run the engine alone on one prompt and print the completion as it streams."""

from __future__ import annotations

import argparse
import sys

from shared.errors import InvalidRequestError, TandemError
from shared.runtime.options import add_model_options, add_option
from shared.sampling_params import SamplingParams


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("generate", help="generate a completion locally (engine only, no services)")
    p.add_argument("prompt", help="the prompt text")
    add_model_options(p)
    add_option(p, "--max-tokens", type=int, default=64)
    add_option(p, "--chat", action="store_true", help="wrap the prompt in the chat template")
    add_option(p, "--temperature", type=float, default=0.0, help="0 = greedy")
    add_option(p, "--top-p", type=float, default=1.0)
    add_option(p, "--top-k", type=int, default=0)
    add_option(p, "--seed", type=int, default=None)
    add_option(p, "--stop", action="append", default=[], help="stop string (repeatable)")
    add_option(p, "--ignore-eos", action="store_true")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # The model stack (torch) loads only when this command runs: `tandem router` shares
    # the console script and must not pay for it.
    from shared.engine.engine import Engine, EngineConfig
    from shared.model.loader import load_model
    from shared.runtime.engine import configure_threads

    configure_threads(args.threads)
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
    )
    try:
        # Check what needs no model first: a typo should not cost a model load.
        params.validate()
        if not args.prompt:
            raise InvalidRequestError("prompt is empty", param="prompt")
        model = load_model(args.model, dtype=args.dtype, device=args.device)
        ids = (
            model.apply_chat_template([{"role": "user", "content": args.prompt}])
            if args.chat
            else model.encode(args.prompt)
        )
        engine = Engine(model, EngineConfig(max_num_seqs=1))
        engine.add_request(ids, params)
        while engine.has_unfinished():
            for out in engine.step():
                sys.stdout.write(out.text)
                sys.stdout.flush()
    except TandemError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write("\n")
    return 0
