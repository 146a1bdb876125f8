"""The experiment spec: shipped specs load and resolve; bad specs fail naming the field."""

from pathlib import Path

import pytest

from saorl.algo.presets import AdaptiveLambda
from saorl.experiments.runner import ExperimentRunner, Selection
from saorl.experiments.spec import (
    SpecError,
    arm_config,
    find_spec,
    load_spec,
    selected_arms,
    selected_seeds,
    spec_from_dict,
)

SHIPPED = ("math", "code", "stability", "mismatch", "levels", "shift", "noisy_obs", "lr_staleness", "real",
           "real_game")


def _spec(**kw):
    data = {"name": "t", "arms": {"a": ["algo.name=sao"], "b": ["algo.name=reinforce_rm"]},
            "budget": {"steps": 10, "max_wall_s": 30}} | kw
    return spec_from_dict(data, "t.yaml")


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_specs_resolve_with_one_sft_start(name, tmp_path):
    path = find_spec(name)
    spec = load_spec(path)
    for quick in (False, True):
        sel = Selection(selected_arms(spec, quick, None), selected_seeds(spec, quick, None), quick)
        runner = ExperimentRunner(spec, path, tmp_path, sel)
        runner.check_same_start()  # raises if arms of a seed would start from different SFT models
        budget = spec.quick.budget if quick and spec.quick.budget else spec.budget
        for arm in runner.trained_arms():
            cfg = runner.config(arm, sel.seeds[0])
            assert cfg.trainer.steps == budget.steps and cfg.trainer.max_wall_s == budget.max_wall_s
            assert cfg.run.out_dir == str(tmp_path)


def test_math_arms_are_the_comparison_asked_for():
    spec = load_spec(find_spec("math"))
    cfgs = {a: arm_config(spec, find_spec("math"), a, 0) for a in spec.arms}
    assert cfgs["grpo_async"].resolved_mode() == "async" and cfgs["grpo_sync"].resolved_mode() == "sync"
    assert cfgs["sao"].algo.preset.policy_loss == "dis"
    assert cfgs["vapo"].algo.preset.policy_loss == "ppo"
    assert {c.trainer.batch_size for c in cfgs.values()} == {4}
    assert {c.sft.seed for c in cfgs.values()} == {0}  # every seed starts from one SFT model
    assert {c.trainer.policy_lr for c in cfgs.values()} == {1e-4}
    assert spec.start_arm == "sft"


def test_a_relative_out_gives_the_caches_the_keys_a_run_uses(tmp_path, monkeypatch):
    from saorl.config import absolute_paths
    from saorl.stages.sft import cached_sft_dir
    from saorl.stages.value_pretrain import value_pretrain_key

    monkeypatch.chdir(tmp_path)
    spec = load_spec(find_spec("lr_staleness"))
    runner = ExperimentRunner(spec, find_spec("lr_staleness"), Path("out"), Selection(["sao_lr1e4_c16"], [0]))
    cfg = runner.config("sao_lr1e4_c16", 0)
    assert cfg.run.out_dir == str(tmp_path / "out")
    run_cfg = absolute_paths(cfg)  # what ``train`` keys its caches with
    assert value_pretrain_key(cfg, str(cached_sft_dir(cfg))) == value_pretrain_key(
        run_cfg, str(cached_sft_dir(run_cfg)))


def test_lr_staleness_arms_are_the_grid_their_names_say():
    spec = load_spec(find_spec("lr_staleness"))
    cfgs = {a: arm_config(spec, find_spec("lr_staleness"), a, 0) for a in spec.arms}
    grid = {(c.algo.name, c.trainer.policy_lr, c.rollout.concurrent_episodes)
            for a, c in cfgs.items() if a != "sao_advnorm"}
    assert grid == {(algo, lr, n) for algo in ("sao", "grpo_dis")
                    for lr in (1e-5, 3e-5, 1e-4) for n in (16, 64)}
    for arm, c in cfgs.items():
        assert c.trainer.batch_size == 4 and c.rollout.engine.slots == c.rollout.concurrent_episodes, arm
        assert c.algo.preset.advantage_norm == ("batch" if arm == "sao_advnorm" else "none"), arm
        assert (c.algo.preset.group_size == 4) == arm.startswith("grpo_dis"), arm
    # the advantage-normalisation arm differs from the reference in that setting alone
    ref, norm = cfgs["sao_lr1e4_c16"], cfgs["sao_advnorm"]
    assert norm.model_copy(update={"algo": ref.algo}) == ref
    assert spec.reference_arm(list(spec.arms)) == "sao_lr1e4_c16"


def test_mismatch_arms_differ_where_they_say():
    spec = load_spec(find_spec("mismatch"))
    algos = {a: arm_config(spec, find_spec("mismatch"), a, 0).algo.preset for a in spec.arms}
    assert algos["grpo_uncorrected"].behaviour == "trainer" and algos["grpo_rollout"].behaviour == "rollout"
    dis = algos["grpo_dis"]
    assert (dis.policy_loss, dis.eps_low, dis.eps_high) == ("dis", 0.3, 5.0)
    assert algos["grpo_dis_high028"] == dis.with_overrides(eps_high=0.28)
    assert algos["grpo_dis_low099"] == dis.with_overrides(eps_low=0.99)
    # the safeguard arm is SAO with the staleness-aware learning rate, and nothing else changed
    sao, guarded = (arm_config(spec, find_spec("mismatch"), a, 0) for a in ("sao", "sao_staleness_lr"))
    assert (sao.trainer.staleness_lr_ref, guarded.trainer.staleness_lr_ref) == (None, 5.0)
    assert guarded.model_copy(update={"trainer": sao.trainer, "run": sao.run}) == sao
    # its control is SAO at the hand-set rate the map's rule gives at this staleness, and nothing else
    fixed = arm_config(spec, find_spec("mismatch"), "sao_lr3e5", 0)
    assert (fixed.trainer.policy_lr, fixed.trainer.staleness_lr_ref) == (3e-5, None)
    assert fixed.trainer.model_copy(update={"policy_lr": sao.trainer.policy_lr}) == sao.trainer


def test_shift_whitening_arm_is_sao_with_batch_normalised_advantages_only():
    spec = load_spec(find_spec("shift"))
    sao, norm = (arm_config(spec, find_spec("shift"), a, 0) for a in ("sao", "sao_advnorm"))
    assert (sao.algo.preset.advantage_norm, norm.algo.preset.advantage_norm) == ("none", "batch")
    assert norm.algo.model_copy(update={"advantage_norm": sao.algo.advantage_norm}) == sao.algo
    assert norm.model_copy(update={"algo": sao.algo, "run": sao.run}) == sao


@pytest.mark.parametrize("data, field", [
    ({"budget": {"steps": 0}}, "budget.steps"),
    ({"arms": {}}, "arms"),
    ({"arms": {"a": ["sft.steps=5"]}}, "arms"),
    ({"arms": {"a": ["trainer.steps=5"]}}, "arms"),
    ({"arms": {"a": ["seed=3"]}}, "arms"),
    ({"plots": ["accuracy", "nope"]}, "plots"),
    ({"seeds": []}, "seeds"),
    ({"bogus": 1}, "bogus"),
    ({"quick": {"arms": ["zzz"]}}, "quick.arms"),
    ({"start_arm": "a"}, "start_arm"),
    ({"name": "a/b"}, "name"),
    ({"reference": "zzz"}, "reference"),
    ({"wall_marks_s": [300, 0]}, "wall_marks_s"),
    ({"quick": {"wall_marks_s": [-5]}}, "quick.wall_marks_s"),
])
def test_bad_spec_names_the_field(data, field):
    with pytest.raises(SpecError) as e:
        _spec(**data)
    assert field in str(e.value) and "t.yaml" in str(e.value)


def test_missing_budget_and_bad_yaml(tmp_path):
    p = tmp_path / "x.yaml"
    p.write_text("name: x\narms: {a: []}\n")
    with pytest.raises(SpecError, match="budget: required field missing"):
        load_spec(p)
    p.write_text("name: [unclosed\n")
    with pytest.raises(SpecError, match="YAML error"):
        load_spec(p)
    with pytest.raises(SpecError, match=r"known experiments: .*math"):
        find_spec("no-such-experiment")


def test_bad_arm_override_is_a_config_error_naming_the_arm():
    spec = _spec(arms={"a": ["algo.naem=sao"]})
    with pytest.raises(SpecError, match=r"algo.naem.*did you mean name"):
        arm_config(spec, None, "a", 0)
    spec = _spec(arms={"a": ["algo.eps_low=2"]})
    with pytest.raises(SpecError, match=r"arm 'a'.*algo.eps_low"):
        arm_config(spec, None, "a", 0)


def test_selection_and_layering():
    spec = _spec(seeds=[3, 5], start_arm="s", overrides=["trainer.policy_lr=2e-4"],
                 quick={"overrides": ["sft.steps=7"], "budget": {"steps": 2}, "seeds": 1, "arms": ["b"]})
    assert selected_seeds(spec, False, None) == [3, 5]
    assert selected_seeds(spec, True, None) == [3]
    assert selected_seeds(spec, False, 4) == [3, 5, 6, 7]
    assert selected_arms(spec, False, None) == ["a", "b", "s"]
    assert selected_arms(spec, True, None) == ["b", "s"]
    assert selected_arms(spec, False, ["s", "a"]) == ["a", "s"]
    with pytest.raises(SpecError, match="unknown arm"):
        selected_arms(spec, False, ["c"])
    cfg = arm_config(spec, None, "b", 5, quick=True, extra=["trainer.policy_lr=3e-4"])
    assert (cfg.seed, cfg.sft.steps, cfg.trainer.steps, cfg.trainer.max_wall_s) == (5, 7, 2, None)
    assert cfg.algo.name == "reinforce_rm" and cfg.trainer.policy_lr == 3e-4


def test_base_is_found_relative_to_spec(tmp_path):
    (tmp_path / "base.yaml").write_text("trainer:\n  batch_size: 12\n")
    spec = _spec(base="base.yaml")
    assert arm_config(spec, tmp_path / "spec.yaml", "a", 0).trainer.batch_size == 12
    with pytest.raises(SpecError, match=r"base config 'missing\.yaml' not found"):
        arm_config(_spec(base="missing.yaml"), tmp_path / "spec.yaml", "a", 0)
    assert Path(find_spec("math")).name == "math.yaml"


def test_cost_lines_and_switch_steps():
    from saorl.experiments.plan import cost_lines, switch_steps

    capped = load_spec(find_spec("lr_staleness"))  # a wall-clock cap per run bounds the time
    lines = cost_lines(capped, list(capped.arms)[:2], [0], quick=True)
    assert lines[0].startswith("full version: may take up to 13 arms x 2 seeds x 400 s = 2h53m of RL")
    assert lines[1].startswith("this run: may take up to 2 arms x 1 seeds x 60 s = 2m00s")
    spec = load_spec(find_spec("shift"))  # equal steps, no cap: a count of steps, no time bound claimed
    arms = list(spec.arms)
    lines = cost_lines(spec, arms, [0, 1, 2, 3, 4], quick=False)
    assert lines == ["full version: 5 trained arms x 5 seeds x 300 steps (no wall-clock limit in the spec, "
                     "so no time bound)"]
    quick_line = cost_lines(spec, arms[:2], [0], quick=True)[1]
    assert quick_line.startswith("this run: may take up to 2 arms x 1 seeds")
    # the command line's budget overrides (resolved into the arms' configs) are what this run costs
    lines = cost_lines(capped, list(capped.arms), [0, 1], quick=False, budget=(5, 30.0))
    assert lines[1].startswith("this run: may take up to 13 arms x 2 seeds x 30 s = 13m00s of RL (5 steps")
    assert len(cost_lines(capped, list(capped.arms), [0, 1], quick=False, budget=(100, 400.0))) == 1
    no_cap = cost_lines(capped, list(capped.arms), [0, 1], quick=False, budget=(7, None))
    assert no_cap[1] == ("this run: 13 trained arms x 2 seeds x 7 steps (no wall-clock limit in the spec, "
                         "so no time bound)")
    assert switch_steps(arm_config(spec, find_spec("shift"), "sao", 0, quick=True)) == [0, 10, 20]
    assert switch_steps(arm_config(spec, find_spec("shift"), "sao", 0)) == [0, 100, 200]
    assert switch_steps(arm_config(load_spec(find_spec("math")), find_spec("math"), "sao", 0)) == []


def test_reference_arm_is_named_or_the_first_selected():
    assert _spec().reference_arm() == "a"
    assert _spec(reference="b").reference_arm() == "b"
    assert _spec(reference="b").reference_arm(["a"]) == "a"  # the reference was not run
    assert _spec().reference_arm(["b"]) == "b"


def test_the_help_names_every_shipped_experiment(capsys):
    from saorl.cli import main

    with pytest.raises(SystemExit):
        main(["experiment", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    shipped = sorted(p.stem for p in (Path(__file__).parents[2] / "configs" / "experiments").glob("*.yaml"))
    assert {"claims", "lr_staleness", "levels"} <= set(shipped)
    assert f"an experiment name ({', '.join(shipped)}) or a spec YAML" in out


def test_claims_paper_arms_are_sao_with_the_papers_knobs_only():
    spec = load_spec(find_spec("claims"))
    sao, paper, warm = (arm_config(spec, find_spec("claims"), a, 0)
                        for a in ("sao", "sao_paper", "sao_paper_warmup"))
    assert paper.algo.preset.with_overrides(name="sao", lam_policy=0.95) == sao.algo.preset
    assert paper.algo.preset.lam_policy == AdaptiveLambda(alpha=1.5)
    warmups = [c.trainer.critic_warmup_steps for c in (sao, paper, warm)]
    assert warmups == [0, 0, 10]
    assert warm.model_copy(update={"trainer": paper.trainer, "run": paper.run}) == paper


@pytest.mark.parametrize("name", ["real", "real_game"])
def test_real_arms_are_the_comparison_asked_for(name):
    path = find_spec(name)
    spec = load_spec(path)
    assert spec.seeds == list(range(8)) and spec.verdicts and spec.reference == "sao"
    assert spec.wall_marks() == [300, 600, 900, 1200, 1800]
    assert spec.wall_marks(quick=True) != spec.wall_marks()  # a tiny run's seconds
    cfg = {a: arm_config(spec, path, a, 0) for a in spec.arms}
    shape = {a: (c.algo.name, c.resolved_mode(), c.algo.preset.behaviour, c.algo.preset.group_size)
             for a, c in cfg.items()}
    assert {a: shape[a] for a in ("sao", "sao_paper", "grpo", "grpo_dis_async", "grpo_async")} == {
        "sao": ("sao", "async", "rollout", 1), "sao_paper": ("sao_paper", "async", "rollout", 1),
        "grpo": ("grpo", "sync", "rollout", 4), "grpo_dis_async": ("grpo_dis", "async", "rollout", 4),
        "grpo_async": ("grpo", "async", "trainer", 4)}
    for c in cfg.values():  # a pretrained model, held-out sets of 128, equal batches and budgets
        assert c.model.policy == "smollm2-135m-instruct"
        assert (c.env.num_test_tasks, c.run.eval_tasks, c.trainer.batch_size) == (128, 128, 8)
        assert (c.trainer.steps, c.trainer.max_wall_s) == (60, 1800)
        assert c.rollout.concurrent_episodes == 16
    assert cfg["sao"].env.type == ("reasoning_gym" if name == "real" else "textarena")
    if name == "real_game":
        assert set(spec.arms) == {"sao", "sao_paper", "grpo", "grpo_dis_async", "grpo_async"}
        return
    # the warm-up pair: the paper's SAO with one knob each, nothing else
    paper, steps, lr = cfg["sao_paper"], cfg["sao_paper_warmup_steps"], cfg["sao_paper_warmup_lr"]
    assert [(c.trainer.critic_warmup, c.trainer.critic_warmup_steps) for c in (paper, steps, lr)] == \
        [("steps", 0), ("steps", 10), ("lr", 10)]
    for c in (steps, lr):
        assert c.algo == paper.algo
        assert c.model_copy(update={"trainer": paper.trainer, "run": paper.run}) == paper
