"""``saorl serve``: the local engine behind the OpenAI-compatible HTTP server.

``saorl serve --model tiny-moe --port 8000`` builds (or loads, for a directory path) a causal LM,
wraps it in :class:`~saorl.engines.local.LocalEngine` and serves it with
:mod:`saorl.engines.server` until interrupted. ``--port 0`` picks a free port; the first line
printed on stdout is ``saorl serve: listening on http://HOST:PORT`` (scripts and tests read it).
"""

from __future__ import annotations

import argparse
import sys

from saorl.models.tiny import TINY_KINDS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default="tiny-moe", help=f"one of {TINY_KINDS} or a local HF model directory"
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer directory (default: the shipped one, or the model directory's own when it has one)",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0, help="initialisation seed for tiny models")
    parser.add_argument(
        "--no-stop-on-eos", action="store_true", help="do not stop at EOS (benchmarks, fixed-length tests)"
    )
    parser.add_argument("--verbose", action="store_true", help="log every HTTP request")


def load_model(name: str, seed: int = 0, device: str = "cpu"):
    """A tiny model by kind, or an HF causal LM from a local directory (no hub access)."""
    try:
        from saorl.models.loading import load_policy
    except ImportError:  # older trees without the loader
        load_policy = None
    if load_policy is not None:
        return load_policy(name, seed=seed, device=device)
    if name in TINY_KINDS:
        from saorl.models.tiny import build_tiny

        return build_tiny(name, seed=seed)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(name, local_files_only=True).eval()


def _load_tokenizer(args: argparse.Namespace):
    from pathlib import Path

    from saorl.models.tokenizer import load_tokenizer

    if args.tokenizer:
        return load_tokenizer(args.tokenizer)
    if args.model not in TINY_KINDS and (Path(args.model) / "tokenizer_config.json").exists():
        return load_tokenizer(args.model)
    return load_tokenizer()


def run(args: argparse.Namespace) -> int:
    from saorl.engines.local import LocalEngine
    from saorl.engines.server import make_server

    if args.max_batch_size < 1:
        print(f"saorl serve: --max-batch-size must be >= 1, got {args.max_batch_size}", file=sys.stderr)
        return 2
    tokenizer = _load_tokenizer(args)
    engine = LocalEngine(
        load_model(args.model, args.seed, args.device),
        tokenizer,
        max_batch_size=args.max_batch_size,
        device=args.device,
        stop_on_eos=not args.no_stop_on_eos,
    )
    server = make_server(
        engine, args.host, args.port, tokenizer=tokenizer, model_name=args.model, verbose=args.verbose
    )
    host, port = server.server_address[:2]
    print(f"saorl serve: listening on http://{host}:{port}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        engine.close()
    return 0
