"""``LocalEngine.from_config``: the one constructor, and the sites that use it take the run's section."""


from saorl.config.engines import LocalEngineConfig
from saorl.engines import LocalEngine


def test_from_config_carries_every_setting_of_the_section(tiny_moe, tok):
    section = LocalEngineConfig(slots=3, prefix_cache_tokens=77, prefix_after_update="recompute",
                                pack_weights=False)
    eng = LocalEngine.from_config(section, tiny_moe, tok, version=5, stop_on_eos=False)
    try:
        assert eng.max_batch_size == 3 and eng.version == 5
        assert eng._prefixes.budget == 77 and eng._exact_prefix
        assert eng._packed is None and not eng._eos
    finally:
        eng.close()


def test_the_engine_defaults_are_the_sections(tiny_moe, tok):
    eng = LocalEngine(tiny_moe, tok)
    try:
        d = LocalEngineConfig()
        assert (eng.max_batch_size, eng._prefixes.budget, eng._exact_prefix) == (
            d.slots, d.prefix_cache_tokens, d.prefix_after_update == "recompute")
    finally:
        eng.close()


def test_evaluation_decodes_with_the_runs_engine_section(monkeypatch, tiny_moe, tok):
    """Evaluation builds its engine from ``rollout.engine`` (its prefix settings too), not from defaults."""
    from saorl.envs.registry import make_env_factory
    from saorl.stages.evaluate import evaluate

    built = []
    real = LocalEngine.from_config.__func__

    def spy(cls, section, *a, **k):
        eng = real(cls, section, *a, **k)
        built.append((section, eng._prefixes.budget, eng._exact_prefix, eng.max_batch_size))
        return eng

    monkeypatch.setattr(LocalEngine, "from_config", classmethod(spy))
    section = LocalEngineConfig(slots=2, prefix_cache_tokens=11, prefix_after_update="recompute")
    factory = make_env_factory("math_tool")
    tasks = factory().generate_tasks("test", 2, seed=0)
    metrics, trajs = evaluate(tiny_moe, tok, factory, tasks, max_new_tokens=4, max_total_tokens=256,
                              engine=section)
    assert built == [(section, 11, True, 2)]
    assert len(trajs) == 2 and "eval/accuracy" in metrics
