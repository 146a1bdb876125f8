"""``saorl serve``: the local engine behind the OpenAI-compatible HTTP server.

``saorl serve --model tiny-moe --port 8000`` builds (or loads, for a directory path, a ``.gguf``
file, a short model name such as ``smollm2-135m-instruct`` or a Hub id) a causal LM, wraps it in
:class:`~saorl.engines.local.LocalEngine` and serves it with :mod:`saorl.engines.serve.server`
(FastAPI on uvicorn; vLLM 0.32's OpenAI API) until interrupted. It binds 127.0.0.1 unless
``--host`` says otherwise. ``--port 0`` picks a free port; the first line printed on
stdout is ``saorl serve: listening on http://HOST:PORT`` (scripts and tests read it).

``--model RUN_DIR`` (a directory holding a run's ``config.yaml``) serves the run's final policy,
``RUN_DIR/final/policy``; a run without one (killed, or not finished yet) serves its last checkpoint
in the run's initial policy architecture, and says so on stderr with the step; a run with no
checkpoint either is refused, naming ``saorl train --resume RUN_DIR``.
As in vLLM: ``--served-model-name NAME [NAME ...]`` (default: ``--model`` as given) are the names
requests may use, ``--max-model-len`` the context (default: the model's
``max_position_embeddings``), ``--generation-config auto|vllm|DIR`` where the sampling defaults come
from (:mod:`saorl.engines.serve.served`; a default the engine cannot apply is refused at start-up).

``--enable-return-routed-experts`` records every request's MoE routes, for routing replay (saorl's
``return_routed_experts`` field, and the SGLang / vLLM emulations' ``routed_experts``);
``--moe-top-k`` / ``--router-noise`` perturb the engine's routing (an engine/trainer mismatch a
remote engine brings, made dialable). ``--weights-dir DIR`` enables weight updates from files under
DIR (off by default);
``--emulate vllm|sglang`` adds the routes of those servers that saorl's vLLM / SGLang clients use
(:mod:`saorl.engines.serve.emulation`), for tests and CPU runs of those code paths.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from saorl.config.engines import LocalEngineConfig
from saorl.run_paths import RunPaths

if TYPE_CHECKING:
    from saorl.models.source import ModelSource


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    parser.add_argument("--model", default="tiny-moe",
                        help="a tiny built-in kind (tiny-moe, tiny-dense), a local HF model directory, "
                             "a .gguf file, a short model name (smollm2-135m-instruct, gemma3-270m), a Hub "
                             "id, or a run directory that `saorl train` wrote (it serves the run's "
                             "final/policy)")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer directory or Hub id; none: the model's own (the shipped one for "
                             "tiny kinds)")
    parser.add_argument("--chat-template", default=None, metavar="FILE",
                        help="Jinja chat template for /v1/chat/completions when the tokenizer has none")
    parser.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                        help="the model names requests may use (responses carry the first); none: --model")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="context length, prompt + completion; none: the model's max_position_embeddings")
    parser.add_argument("--generation-config", default="auto", metavar="auto|vllm|DIR",
                        help="sampling defaults: the model's generation_config.json (auto), none (vllm), or "
                        "DIR/generation_config.json")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 exposes the server)")
    parser.add_argument("--port", type=int, default=8000, help="port to bind (0: any free port)")
    parser.add_argument("--max-batch-size", type=int, default=LocalEngineConfig().slots,
                        help="sequences decoded together (the local engine's slots)")
    parser.add_argument("--device", default="cpu", help="torch device: cpu, cuda, cuda:N or mps")
    parser.add_argument("--seed", type=int, default=0, help="initialisation seed for tiny models")
    parser.add_argument("--no-stop-on-eos", action="store_true",
                        help="do not stop at EOS (benchmarks, fixed-length tests)")
    parser.add_argument("--weights-dir", default=None, metavar="DIR",
                        help="allow weight updates from files under DIR (disabled without it)")
    parser.add_argument("--max-pending", type=int, default=512,
                        help="generations admitted at once; past it, 503 with Retry-After")
    parser.add_argument("--max-body-bytes", type=int, default=4 * 2**20, help="largest request body")
    parser.add_argument("--body-timeout", type=float, default=10.0,
                        help="seconds a request body may take to arrive")
    parser.add_argument("--header-timeout", type=float, default=10.0,
                        help="seconds a request's line and headers may take to arrive")
    parser.add_argument("--max-json-depth", type=int, default=32,
                        help="deepest nesting of arrays and objects in a JSON body")
    parser.add_argument("--backlog", type=int, default=2048, help="listen backlog (queued connections)")
    parser.add_argument("--emulate", default=None, metavar="vllm|sglang",
                        help="also serve the vLLM or SGLang routes saorl's clients use "
                        "(saorl.engines.serve.emulated)")
    parser.add_argument("--logprobs-mode", choices=["raw_logprobs", "processed_logprobs"],
                        default="raw_logprobs", help="with --emulate vllm: which log-probs to return, "
                        "as vLLM's --logprobs-mode")
    parser.add_argument("--enable-return-routed-experts", action="store_true",
                        help="record the MoE routes of every request (MoE models): saorl's "
                        "return_routed_experts, SGLang's and vLLM's routed_experts (routing replay)")
    parser.add_argument("--moe-top-k", type=int, default=None,
                        help="route each token to this many experts instead of the model's own (an "
                        "engine-side routing mismatch, MoE models)")
    parser.add_argument("--router-noise", type=float, default=0.0,
                        help="pick experts from router logits plus N(0, sigma^2) noise, sigma = this "
                        "(seeded by --seed; an engine-side routing mismatch, MoE models)")
    parser.add_argument("--verbose", action="store_true", help="log every HTTP request")


def load_model(name: str | ModelSource, seed: int = 0, device: str = "cpu"):
    """A tiny model by kind, or an HF causal LM from a model source (:func:`saorl.models.source.parse`)."""
    from saorl.models.loading import load_policy

    return load_policy(name, seed=seed, device=device)


def _load_tokenizer(args: argparse.Namespace, source: str):
    from saorl.models.codec import tokenizer_source
    from saorl.models.tokenizer import load_tokenizer

    # as runs choose it: --tokenizer, else the model's own (the shipped one for tiny kinds)
    tok = load_tokenizer(tokenizer_source(source, args.tokenizer),
                         "--tokenizer" if args.tokenizer else "--model")
    if args.chat_template:
        tok.chat_template = Path(args.chat_template).read_text(encoding="utf-8")
    return tok


def resolve_model(spec: str, device: str = "cpu") -> tuple[str, Callable[[], Any] | None]:
    """What ``--model`` serves: ``(source, loader)``. A run directory's final policy, or, for a run
    that did not finish, its last checkpoint (said on stderr, with the step), loaded into the
    run's initial policy by ``loader``; else ``spec`` itself (``loader`` None). ValueError naming
    ``saorl train --resume`` for a run directory with neither."""
    path = Path(spec).expanduser()
    if (path / "manifest.json").is_file() and not (path / "config.json").is_file():
        raise ValueError(f"--model {spec!r} is a checkpoint directory (manifest.json): it holds training "
                         "state, not a model directory; serve its run directory (its final policy, else "
                         "its last checkpoint), or evaluate the checkpoint with saorl eval")
    paths = RunPaths(path)
    if not paths.config.is_file() or (path / "config.json").is_file():
        return spec, None
    final = paths.final_policy
    if (final / "config.json").is_file():
        return str(final), None
    from saorl.commands.eval import TargetError, checkpoint_step, no_policy_yet, run_target, unfinished_note
    from saorl.runtime.checkpoint import latest_checkpoint
    from saorl.stages.sft import initial_policy_spec

    ckpt = latest_checkpoint(paths.checkpoints) if paths.checkpoints.is_dir() else None
    if ckpt is None:
        raise ValueError(no_policy_yet(path))
    try:
        target = run_target(path, [f"model.device={device}"], ckpt=ckpt)
    except TargetError as e:
        raise ValueError(str(e)) from None
    print(f"saorl serve: {unfinished_note(path, ckpt, checkpoint_step(ckpt))}", file=sys.stderr, flush=True)
    return initial_policy_spec(target.cfg), target.load


def _check(args: argparse.Namespace) -> str | None:
    for name in ("max_batch_size", "max_pending", "max_body_bytes", "max_json_depth", "backlog"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}"
    for name in ("body_timeout", "header_timeout"):
        if not getattr(args, name) > 0:
            return f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}"
    if args.moe_top_k is not None and args.moe_top_k < 1:
        return f"--moe-top-k must be >= 1, got {args.moe_top_k}"
    if not args.router_noise >= 0:
        return f"--router-noise must be >= 0, got {args.router_noise}"
    if args.weights_dir and not Path(args.weights_dir).is_dir():
        return f"--weights-dir {args.weights_dir!r} is not a directory"
    if args.chat_template and not Path(args.chat_template).is_file():
        return f"--chat-template {args.chat_template!r} is not a file"
    if args.max_model_len is not None and args.max_model_len < 2:
        return f"--max-model-len must be >= 2, got {args.max_model_len}"
    if args.generation_config not in ("auto", "vllm") and not Path(args.generation_config).is_dir():
        return f"--generation-config {args.generation_config!r} is neither auto, vllm nor a directory"
    if args.served_model_name is not None and not all(args.served_model_name):
        return "--served-model-name: every name must be non-empty"
    return None


def _served(args: argparse.Namespace, source: ModelSource, model, tokenizer):
    """The :class:`~saorl.engines.serve.served.ServedModel` of the options; ValueError for a context past
    the model's or defaults the engine cannot apply."""
    from saorl.engines.serve.served import ServedModel, generation_defaults, unhonoured_default

    most = int(model.config.max_position_embeddings)
    if args.max_model_len is not None and args.max_model_len > most:
        raise ValueError(f"--max-model-len {args.max_model_len} is past the model's max_position_embeddings "
                         f"({most})")
    defaults, eos_ids = generation_defaults(source.local, args.generation_config)  # local: None if tiny
    problem = unhonoured_default(defaults)
    if problem:
        raise ValueError(problem)
    eos = None if args.no_stop_on_eos else tokenizer.eos_token_id
    vocab = int(model.config.vocab_size)
    extra = () if args.no_stop_on_eos else tuple(e for e in eos_ids if e != eos and 0 <= e < vocab)
    names = tuple(args.served_model_name or (args.model,))
    return ServedModel(names, source.spec, args.max_model_len or most, defaults, eos, extra)


def run(args: argparse.Namespace) -> int:
    problem = _check(args)
    if problem:
        print(f"saorl serve: {problem}", file=sys.stderr)
        return 2
    from saorl.engines.local import LocalEngine
    from saorl.engines.serve.emulated import emulation_of
    from saorl.engines.serve.server import ServerLimits, bind, create_app, make_server
    from saorl.models.codec import check_vocab
    from saorl.models.source import parse

    try:
        emulation = emulation_of(args.emulate, "--emulate")
        source, loader = resolve_model(args.model, args.device)
    except ValueError as e:
        print(f"saorl serve: {e}", file=sys.stderr)
        return 2
    try:
        model_source = parse(source, "--model").resolve()  # classified and made local once, here
        tokenizer = _load_tokenizer(args, model_source.load_spec)
        model = loader() if loader is not None else load_model(model_source, args.seed, args.device)
    except (FileNotFoundError, NotADirectoryError) as e:  # ModelSourceError; a directory of other things
        print(f"saorl serve: {e}", file=sys.stderr)
        return 2
    check_vocab(tokenizer, model, "--model")
    try:
        served = _served(args, model_source, model, tokenizer)
        if args.moe_top_k is not None or args.router_noise:
            from saorl.models.routing import perturb_routing

            perturb_routing(model, top_k=args.moe_top_k, noise_std=args.router_noise, seed=args.seed)
        engine = LocalEngine.from_config(LocalEngineConfig(slots=args.max_batch_size), model, tokenizer,
                                         device=args.device, max_seq_len=served.max_model_len,
                                         stop_on_eos=not args.no_stop_on_eos,
                                         record_routes=args.enable_return_routed_experts)
    except ValueError as e:  # routing options on a dense model or past its experts; a context, a default
        print(f"saorl serve: {e}", file=sys.stderr)
        return 2
    limits = ServerLimits(max_pending=args.max_pending, max_body_bytes=args.max_body_bytes,
                          body_timeout_s=args.body_timeout, header_timeout_s=args.header_timeout,
                          max_json_depth=args.max_json_depth, backlog=args.backlog)
    extra = {"logprobs_mode": args.logprobs_mode} if emulation and emulation.logprobs_modes else {}
    app = create_app(engine, tokenizer=tokenizer, served=served, limits=limits,
                     weights_dir=args.weights_dir, emulate=args.emulate, **extra)
    try:
        sock = bind(args.host, args.port, args.backlog)
    except OSError as e:
        print(f"saorl serve: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        engine.close()
        return 2
    host, port = sock.getsockname()[:2]
    print(f"saorl serve: listening on http://{host}:{port}", flush=True)
    try:
        make_server(app, sock, verbose=args.verbose).run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        sock.close()
        engine.close()
    return 0
