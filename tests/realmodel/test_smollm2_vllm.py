"""SmolLM2-135M-Instruct on a real vLLM 0.32.0 CPU server: the converted directory loads in vLLM's
own transformers (< 5.20); ``saorl check-server --reload`` passes (log-probs as given, a perturbed
copy and the policy reloaded in place, the tied head included); a sync SAO run publishes every
version to the server, verified there, and the server's log-probs are the trainer's to float32
round-off (``mismatch/kl_s0`` <= 1e-6 on every step)."""

import pytest
from realmodel import NAME
from server import VllmServer
from train_runs import KL_S0_MAX, steps

from saorl.config import load_config
from saorl.training import train

GAP_MAX = 1e-3
"""The largest per-token log-prob gap of a published version's check on the server: the run's own
float32 tolerance (``rollout.engine.verify_tol``'s default). 30 float32 layers and a 49,152-token
head round off more than the tiny test models (< 1e-5, tests/vllm): measured 2.4e-5 to 1.3e-4 here
over 3 runs, with ``mismatch/kl_s0`` 6.8e-12 to 1.2e-9 and the DIS ratios within 2.3e-4 of 1."""

RATIO_TOL = 1e-2
"""How far a DIS ratio of a sync run may sit from 1. Not float32 round-off alone: at top-p 0.95
the server may keep one token more or less at a position where the nucleus's edge is decided by
round-off (docs/engines.md: the server check leaves such positions out), which moves that
position's log-prob by the edge token's share of the mass. vLLM's CPU numerics depend on how
requests were batched, so it happens in some runs only: one CI run beside other jobs (load 5+)
measured a ratio of 1.0059 at step 2 (``mismatch/kl_s0`` 3.6e-7, check gap 8.9e-4, every token
kept), and the same test rerun passed within 1e-3. ``mismatch/kl_s0`` and the check's gap above
stay the exactness tests; this one catches a gross mismatch (another model's or raw log-probs:
ratios off by far more than 1%)."""

pytestmark = pytest.mark.vllm_real


@pytest.fixture(scope="module")
def server(smollm2, vllm_python, tmp_path_factory):
    log = tmp_path_factory.mktemp("vllm-log") / "smollm2.log"
    srv = VllmServer(vllm_python, smollm2, log, startup_timeout_s=900).start()
    print(f"\n[vllm] {NAME} server up in {srv.startup_s:.0f}s at {srv.url}", flush=True)
    yield srv
    left = srv.stop()
    assert not left, f"processes of the vLLM server survived: {left}"


def test_check_server_reload_passes_on_the_real_model(server, tmp_path, capsys, monkeypatch):
    from saorl.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["check-server", "--url", server.url, f"model.policy={NAME}", "rollout.engine.model=policy",
                 "rollout.temperature=0.7", "rollout.top_k=20", "--reload"]) == 0
    out = capsys.readouterr().out
    assert out.count(": ok") == 3, out  # as given, a perturbed copy reloaded, the policy reloaded back
    print(f"\nRESULT check-server {NAME}:\n{out}")


def test_a_sync_sao_run_of_the_real_model_on_vllm_is_exact(server, tmp_path):
    cfg = load_config(None, [
        f"model.policy={NAME}", "sft.enabled=false", "value_pretrain.enabled=false", "runtime.mode=sync",
        "trainer.steps=2", "trainer.batch_size=2", "trainer.policy_lr=1e-6", "trainer.critic_lr=5e-6",
        "env.num_test_tasks=4", "env.options.max_turns=2", "run.eval_at_start=false",
        "run.eval_every=1000", "run.eval_tasks=2", "run.samples_every=1000", "run.progress=false",
        "run.report_to=[]", f"run.out_dir={tmp_path}", "rollout.concurrent_episodes=2",
        "rollout.max_new_tokens=12", "rollout.engine=vllm", f"rollout.engine.urls=[{server.url}]",
        "rollout.engine.model=policy", "rollout.engine.verify_every=1", "rollout.temperature=0.9",
        "rollout.top_p=0.95"])
    run_dir, last = train(cfg, tmp_path / "run")
    rows = steps(run_dir)
    keys = ("step", "mismatch/kl_s0", "weights/verify_max_gap", "policy/ratio_max", "policy/ratio_min",
            "policy/dis_kept_frac", "mismatch/tokens_s0")
    print(f"\nRESULT sync vllm {NAME}: {[{k: r.get(k) for k in keys} for r in rows]}", flush=True)
    assert [r["step"] for r in rows] == [1, 2] and last["policy/version"] == 2
    assert all(r["mismatch/tokens_s0"] > 0 for r in rows)
    for r in rows:  # sync: exact sampling, and every published version verified on the server
        assert r["mismatch/kl_s0"] <= KL_S0_MAX and r["weights/verify_max_gap"] < GAP_MAX
        assert abs(r["policy/ratio_max"] - 1) < RATIO_TOL and abs(r["policy/ratio_min"] - 1) < RATIO_TOL
        assert r["policy/dis_kept_frac"] == 1.0
