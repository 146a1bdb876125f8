"""``saorl check-server [CONFIG] [overrides...]``: check inference servers against a policy before
training on them.

For each server of ``rollout.engine.urls`` (or ``--url``): what the server says of itself (vLLM:
version, device, dtype, log-prob mode, saorl's plugin), whether a run would refuse it at start-up,
then the check every run makes after its publications (:class:`saorl.runtime.weights.servers.ServerCheck`):
one request under the run's temperature / top-k / top-p, its log-probs compared with the policy's
own for the same tokens, by the largest per-token gap. The server must be running the policy
(``model.policy`` or ``--policy``). With ``--reload`` it also publishes a perturbed copy of the
policy to the servers, checks that, then publishes the policy back and checks again: the in-place
reload a run does after every step (the directory, ``--weights-dir``, must be readable by the
servers under the same path; by default a temporary directory, removed afterwards), and leaves the
servers on the policy even when a check fails. ``--plugin-dir`` prints the directory to put on a vLLM server's
``PYTHONPATH`` for saorl's plugin, and exits.

Exit status: 0 every check passed; 2 a server a run would refuse (or a bad input); 3 a check failed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from saorl.run_paths import RunPaths

PLUGIN_DIR = Path(__file__).resolve().parents[1] / "engines" / "vllm_plugin"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("args", nargs="*", metavar="[CONFIG] KEY=VALUE",
                        help="the run's config and overrides (sampling, model.policy, rollout.engine)")
    parser.add_argument("--url", action="append", default=None,
                        help="a server's base URL (repeatable; default: rollout.engine.urls)")
    parser.add_argument("--policy", default=None, help="the policy the servers run (default: model.policy)")
    parser.add_argument("--engine", default=None, metavar="vllm|sglang",
                        help="the servers' kind (default: rollout.engine.kind, or vllm)")
    parser.add_argument("--reload", action="store_true",
                        help="also publish a perturbed copy and the policy back, checking each")
    parser.add_argument("--weights-dir", default=None,
                        help="where --reload writes the versions it publishes; the servers must read it "
                             "under the same path (default: a new directory in the system's temporary "
                             "directory, removed afterwards: fine for servers on this machine)")
    parser.add_argument("--plugin-dir", action="store_true",
                        help="print the directory of saorl's vLLM plugin (for PYTHONPATH) and exit")


def run(args: argparse.Namespace) -> int:
    if args.plugin_dir:
        print(PLUGIN_DIR)
        return 0
    from saorl.commands.common import fail, split_config_args

    path, overrides = split_config_args("saorl check-server", list(args.args))
    if args.policy:
        overrides.append(f"model.policy={args.policy}")
    cfg = _servers_config(path, overrides, args.url, args.engine)
    if args.reload and args.weights_dir is not None:
        where = Path(args.weights_dir)
        if RunPaths(where).config.exists():
            fail(f"saorl check-server: --weights-dir {where} holds a run (config.yaml); its weights "
                 "would be replaced: give another directory")
        try:
            where.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            fail(f"saorl check-server: --weights-dir {where} cannot be made: {e}")
    return _check(cfg, args)


def _servers_config(path: str | None, overrides: list[str], urls: list[str] | None, kind: str | None):
    """The run's config with ``rollout.engine`` the servers to check: of kind ``kind`` (default: the
    config's when the trainer updates its servers in place, else the first of ``IN_PLACE_KINDS``),
    at ``urls`` (default: the config's), with the config's knobs that kind has (``model``,
    ``verify_tol``, ...)."""
    import json
    import warnings

    from saorl.commands.common import fail, load_file_or_exit
    from saorl.config import ConfigError, load_config
    from saorl.config.engines import ENGINE_CONFIGS, IN_PLACE_KINDS
    from saorl.engines.kinds import updated_in_place

    if kind is not None and kind not in IN_PLACE_KINDS:
        fail(f"saorl check-server: --engine must be one of {', '.join(IN_PLACE_KINDS)} (servers the trainer "
             f"updates in place), got {kind!r}")

    at = [f"rollout.engine.urls=[{', '.join(urls)}]"] if urls else []
    first = None
    for attempt in ([*overrides, *at], overrides):  # a local engine has no urls: then without them
        try:
            with warnings.catch_warnings():  # flat knobs of a kind the config's engine is not
                warnings.simplefilter("ignore")
                first = load_config(path, attempt)
            break
        except ConfigError:
            continue  # e.g. a server's knob on a local engine: loaded again below, as the servers' kind
    engine = first.rollout.engine if first is not None else None
    in_place = engine is not None and updated_in_place(engine.kind)
    kind = kind or (engine.kind if in_place else IN_PLACE_KINDS[0])
    if engine is not None and engine.kind == kind and (engine.urls == urls or not urls):
        return first
    if engine is not None and not (urls or getattr(engine, "urls", None)):
        fail("saorl check-server: no server to check: give --url http://HOST:PORT or "
             "rollout.engine.urls='[http://HOST:PORT]'")
    knobs = ENGINE_CONFIGS[kind].model_fields
    carried = {} if engine is None else {k: v for k, v in engine.model_dump().items() if k in knobs}
    section = json.dumps({**carried, "kind": kind})
    return load_file_or_exit(path, [f"rollout.engine={section}", *overrides, *at])


def _check(cfg, args) -> int:
    from saorl.config.engines import VllmEngineConfig
    from saorl.models.codec import run_tokenizer
    from saorl.models.loading import load_policy, policy_source
    from saorl.runtime.parts import server_check
    from saorl.stages.preflight import check_servers, describe_servers

    urls = cfg.rollout.engine.urls
    infos = None
    if isinstance(cfg.rollout.engine, VllmEngineConfig):
        infos = describe_servers(cfg)  # one that does not answer: StartupError, exit 2
        for i in infos:
            plugin = "with" if i.plugin else "without"
            print(f"{i.url}: vLLM {i.version or '?'} on {i.device or '?'}, dtype {i.dtype or '?'}, "
                  f"{i.logprobs_mode or 'log-prob mode ?'}, {plugin} saorl's plugin")
    check_servers(cfg, infos)  # a server a run would refuse: StartupError, exit 2
    policy = load_policy(policy_source(cfg.model.policy), dtype=cfg.model.dtype, device=cfg.model.device,
                         seed=cfg.seed)
    check = server_check(cfg, run_tokenizer(cfg.model))
    s = check.sampling
    print(f"check: {len(check.prompt)}-token prompt, {s.max_new_tokens} new tokens, "
          f"temperature={s.temperature}, top_k={s.top_k}, top_p={s.top_p}; tolerance {check.tolerance:g} "
          "(largest per-token gap)")
    failed = _report("the policy as given", check, policy, urls)
    if args.reload and not failed:
        failed = _reload(cfg, args.weights_dir, policy, check, urls)
    print("every check passed" if not failed else "a check failed: see above", file=sys.stderr)
    return 3 if failed else 0


def _reload(cfg, weights_dir: str | None, policy, check, urls: list[str]) -> bool:
    """Publish a perturbed copy of ``policy`` and check it, then ``policy`` again and check that;
    True when a check failed. The servers are left on ``policy`` whatever happens."""
    import shutil
    import tempfile

    import torch

    from saorl.models.codec import run_tokenizer
    from saorl.runtime.parts import build_weight_sync

    temp = weights_dir is None
    root = Path(tempfile.mkdtemp(prefix="saorl-check-server-")) if temp else Path(weights_dir).resolve()
    if temp:
        root.chmod(0o755)  # mkdtemp makes it 0700: a server running as another user reads it too
    sync = build_weight_sync(cfg, root, policy, run_tokenizer(cfg.model))
    sync.check = None  # checked here, one line each
    original = {k: v.clone() for k, v in policy.state_dict().items()}
    perturbed_on_servers = False
    try:
        with torch.no_grad(), torch.random.fork_rng():
            torch.manual_seed(cfg.seed)
            for p in policy.parameters():
                p.add_(torch.randn_like(p) * 0.02)
        perturbed_on_servers = True
        sync.publish([policy.state_dict()], 1_000_000_001)
        failed = _report("a perturbed copy, reloaded in place", check, policy, urls)
        policy.load_state_dict(original)
        sync.publish([policy.state_dict()], 1_000_000_002)
        perturbed_on_servers = False
        return _report("the policy again, reloaded in place", check, policy, urls) or failed
    finally:
        try:
            if perturbed_on_servers:  # a failed publication: put the policy back before leaving
                policy.load_state_dict(original)
                sync.publish([policy.state_dict()], 1_000_000_003)
        finally:
            sync.close()
            if temp:
                shutil.rmtree(root, ignore_errors=True)


def _report(what: str, check, policy, urls: list[str]) -> bool:
    """One line per server; True when a check failed."""
    from saorl.runtime.weights.servers import WeightPublishError

    failed = False
    for url in urls:
        try:
            (gap, raw_gap, tokens, outside), first, ok = check.judge(policy, url)  # as a run judges
        except WeightPublishError as e:
            print(f"{url}: {what}: {e}")
            failed = True
            continue
        print(f"{url}: {what}: largest gap {gap:.3g} over {tokens} tokens ({outside} outside the kept set; "
              f"{raw_gap:.3g} to the raw distribution): {'ok' if ok else 'FAILED'}")
        if not ok:
            print("  " + check.explain(url, f"with {what}", *first))
        failed = failed or not ok
    return failed
