"""The start-up estimate: each phase's seconds from the calibration (hand-computed cases), the
calibration itself on a tiny model, what ``saorl train`` prints and writes, and that a failing
calibration never stops a run."""

import json

import pytest
import torch

import saorl.stages.estimate as est
from saorl.config import load_config
from saorl.stages.estimate import CRITIC_FORWARD, CRITIC_PASS, Calibration, Shape, phase_estimates

SIZES = ["sft.steps=10", "sft.num_demos=20", "sft.batch_size=4", "value_pretrain.rollouts=16",
         "value_pretrain.steps=5", "value_pretrain.batch_size=4", "value_pretrain.curve=false",
         "run.eval_tasks=8", "env.num_test_tasks=8", "trainer.steps=10", "run.eval_every=5",
         "trainer.batch_size=4", "rollout.engine.slots=4", "rollout.concurrent_episodes=4"]
CAL = Calibration(sft_pass=0.5, fit_pass=0.4, rl_pass=1.0, per_token=0.01, opt=0.1, decode=0.02,
                  prefill_per_token=0.001, slots=4, took_s=1.0)
SHAPE = Shape(prompt=20, turns=1, generated=10, tokens=30, demo_tokens=25, demo_s=0.01)


def _rows(*overrides, cores=1, **kw):
    rows = phase_estimates(load_config(None, [*SIZES, *overrides]), CAL, SHAPE, cores=cores, **kw)
    return {r["phase"]: r for r in rows}


def test_each_phase_is_its_sizes_times_the_calibration():
    rows = _rows()
    assert rows["sft"]["seconds"] == pytest.approx(10 * (0.5 + 0.1) + 20 * 0.01)  # steps + demonstrations
    # 16 rollouts on 4 slots: 4 rounds of 10 decode steps, 16 prompts of 20 tokens; 1 fit of 5 steps
    gen16 = 4 * 10 * 0.02 + 16 * 20 * 0.001
    assert rows["value pretraining"]["seconds"] == pytest.approx(gen16 + 5 * (0.4 * CRITIC_PASS + 0.1))
    each = 2 * 10 * 0.02 + 8 * 20 * 0.001  # 8 episodes on 4 slots
    assert rows["evaluation"]["each"] == pytest.approx(each)
    assert rows["evaluation"]["seconds"] == pytest.approx(3 * each)  # steps 0, 5 and 10
    train = 1.0 * (1 + 2 * CRITIC_PASS + 2 * CRITIC_FORWARD) + 3 * 0.1  # policy, K=2 critic passes, 3 AdamW
    gen4 = 1 * 10 * 0.02 + 4 * 20 * 0.001
    assert rows["sao"]["each"] == pytest.approx(train + gen4)  # one core: generation and training add up
    assert rows["sao"]["seconds"] == pytest.approx(10 * (train + gen4))


def test_separate_cores_overlap_generation_and_a_wall_clock_cap_bounds_the_rl_phase():
    rows = _rows(cores=64)
    train = 1.0 * (1 + 2 * CRITIC_PASS + 2 * CRITIC_FORWARD) + 3 * 0.1
    assert rows["sao"]["each"] == pytest.approx(train)  # the slower stage
    capped = _rows("trainer.max_wall_s=20")
    assert capped["sao"]["seconds"] == 20 and "trainer.max_wall_s stops it" in capped["sao"]["note"]
    # 3.28 s a step and a 0.56 s evaluation every 5 steps: 5 steps fit in 20 s, so steps 0 and 5
    assert "about step 5" in capped["sao"]["note"] and capped["evaluation"]["size"] == "8 episodes, 2 times"


def test_what_a_run_skips_costs_nothing():
    rows = _rows(sft_cached=True, critic_cached=True)
    assert rows["sft"]["seconds"] == 0 and rows["sft"]["note"] == "cached"
    assert rows["value pretraining"]["seconds"] == 0
    rows = _rows("sft.enabled=false", "run.eval_at_start=false", "algo.name=grpo", "algo.group_size=4")
    assert set(rows) == {"evaluation", "grpo"}  # no SFT, no critic
    assert rows["evaluation"]["seconds"] == pytest.approx(2 * rows["evaluation"]["each"])
    assert rows["grpo"]["each"] == pytest.approx(1.0 + 0.1 + 1 * 10 * 0.02 + 4 * 20 * 0.001)
    assert "evaluation" not in _rows("run.eval_tasks=0")


def test_calibration_on_a_tiny_model_times_every_part_and_leaves_the_rng_alone(tmp_path):
    cfg = load_config(None, ["model.policy=tiny-dense", "sft.batch_size=4", "trainer.batch_size=2",
                             "rollout.engine.slots=2", "rollout.max_new_tokens=8", f"run.out_dir={tmp_path}"])
    shape = est.trajectory_shape(cfg)
    assert shape.prompt > 0 and shape.generated == min(shape.turns * 8, 512 - shape.prompt)
    assert shape.demo_tokens > shape.prompt and shape.demo_s > 0  # math_tool has demonstrations
    torch.manual_seed(3)
    expected = torch.rand(3)
    torch.manual_seed(3)
    cal = est.calibrate(cfg, "tiny-dense", shape)
    assert torch.equal(torch.rand(3), expected)
    for v in (cal.sft_pass, cal.fit_pass, cal.rl_pass, cal.per_token, cal.opt, cal.decode,
              cal.prefill_per_token):
        assert 0 < v < 60
    assert cal.slots == 2 and cal.took_s > 0


def test_a_calibration_on_a_borrowed_policy_leaves_it_as_a_load_is(tmp_path):
    from saorl.models.loading import load_policy
    from saorl.models.shelf import PolicyShelf

    cfg = load_config(None, ["model.policy=tiny-dense", "trainer.batch_size=2", "rollout.engine.slots=2",
                             "rollout.max_new_tokens=8", f"run.out_dir={tmp_path}"])
    shelf = PolicyShelf()
    est.calibrate(cfg, "tiny-dense", est.trajectory_shape(cfg), shelf)
    assert shelf.loads == 1 and len(shelf) == 1  # borrowed: held for the phases after
    model = shelf.take("tiny-dense", seed=cfg.seed)
    fresh = load_policy("tiny-dense", seed=cfg.seed)
    assert not model.training and all(p.grad is None for p in model.parameters())
    own, want = model.state_dict(), fresh.state_dict()
    assert own.keys() == want.keys() and all(torch.equal(own[k], want[k]) for k in own)  # bit for bit
    ids = torch.tensor([[1, 5, 9, 2]])
    assert torch.equal(model(input_ids=ids).logits, fresh(input_ids=ids).logits)  # its own forwards back


def test_a_server_engine_leaves_the_rollouts_generation_unestimated_but_not_the_trainers():
    cal = Calibration(sft_pass=None, fit_pass=0.4, rl_pass=1.0, per_token=0.01, opt=0.1, decode=0.02,
                      prefill_per_token=0.001, slots=4, took_s=1.0, rl_generation=False)
    cfg = load_config(None, [*SIZES, "sft.enabled=false"])
    rows = {r["phase"]: r for r in phase_estimates(cfg, cal, SHAPE, cores=1)}
    # evaluations and value pretraining decode on the trainer's local engine whatever the rollouts use
    assert rows["evaluation"]["each"] == pytest.approx(2 * 10 * 0.02 + 8 * 20 * 0.001)
    assert rows["value pretraining"]["seconds"] > 0
    assert rows["sao"]["note"].startswith("training only")
    assert rows["sao"]["each"] == pytest.approx(1.0 * (1 + 2 * CRITIC_PASS + 2 * CRITIC_FORWARD) + 3 * 0.1)


def test_the_run_prints_the_table_and_writes_it_or_says_why_not(tmp_path, monkeypatch):
    lines: list[str] = []
    cfg = load_config(None, ["model.policy=tiny-dense", "sft.enabled=false", "trainer.steps=4",
                             f"run.out_dir={tmp_path}"])
    assert est.start_up_estimate(cfg, tmp_path, log=lines.append) is None  # a tiny kind: not asked for
    assert lines == [] and not (tmp_path / "estimate.json").exists()
    cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"estimate": True})})
    rows = est.start_up_estimate(cfg, tmp_path, log=lines.append)
    assert [r["phase"] for r in rows] == ["value pretraining", "evaluation", "sao"]
    saved = json.loads((tmp_path / "estimate.json").read_text())
    assert saved["phases"] == rows and saved["calibration"]["rl_pass"] > 0
    assert lines[0].startswith("start-up estimate, from a ") and "sao " in lines[0]

    (tmp_path / "estimate.json").unlink()
    lines.clear()
    off = cfg.model_copy(update={"run": cfg.run.model_copy(update={"estimate": False})})
    assert est.start_up_estimate(off, tmp_path, log=lines.append) is None
    assert lines == [] and not (tmp_path / "estimate.json").exists()

    assert est.start_up_estimate(cfg, tmp_path, log=lines.append, resume=True) is None  # a resume: none
    assert lines == []

    def broken(*a, **k):
        raise RuntimeError("no memory for the calibration")

    monkeypatch.setattr(est, "calibrate", broken)
    assert est.start_up_estimate(cfg, tmp_path, log=lines.append) is None
    assert lines == ["start-up estimate skipped: RuntimeError: no memory for the calibration"]


def test_calibration_times_the_passes_with_activation_checkpointing_when_the_run_uses_it(monkeypatch):
    """With ``trainer.activation_checkpointing`` the calibration's passes recompute each layer as the
    run's do (a long sequence's activations then stay as small in the calibration as in the run):
    the first layer's MLP runs again in each backward pass, and not without it."""
    small = ["model.policy=tiny-dense", "sft.enabled=false", "rollout.engine.slots=2", "trainer.batch_size=2",
             "value_pretrain.batch_size=2", "rollout.max_new_tokens=8", "rollout.max_total_tokens=64"]
    shape = est.trajectory_shape(load_config(None, small))
    calls: dict[bool, list[int]] = {}
    load = est.load_policy
    monkeypatch.setattr(est, "CHEAP_PASS_S", float("inf"))  # each phase's pass timed for real, both runs
    for on in (False, True):
        cfg = load_config(None, [*small, f"trainer.activation_checkpointing={str(on).lower()}"])
        counter = calls[on] = [0, 0]  # forward pre-hook calls in eval mode, and in training mode

        def count(module, *_, counter=counter):
            counter[module.training] += 1

        loaded = []

        def counted(*a, loaded=loaded, **k):
            loaded.append(load(*a, **k))
            loaded[-1].model.layers[0].mlp.register_forward_pre_hook(count)
            return loaded[-1]

        monkeypatch.setattr(est, "load_policy", counted)
        est.calibrate(cfg, "tiny-dense", shape)
        (model,) = loaded
        assert not model.model.layers[0].gradient_checkpointing  # left as loaded (a shelf's policy too)
    passes = calls[False][1]  # each timed training pass calls the layer once without checkpointing
    assert passes == 2 + 2 * 2  # the best of two at full length, then two each for the fit and RL
    assert calls[True][1] == 2 * passes  # and again in its backward with it
    assert calls[True][0] == calls[False][0] > 0  # decoding (eval mode) is not checkpointed
