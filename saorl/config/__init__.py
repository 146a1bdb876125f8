"""The one config tree: pydantic models per component, YAML presets, dotted overrides.

A run's configuration is :class:`SaorlConfig`. It is built from, in order: the defaults below
(which work on a laptop CPU), a YAML file (a path, or the name of a preset shipped with saorl:
``sao_math_tool`` is ``configs/sao_math_tool.yaml``, see :func:`find_config`), then command-line overrides of
the form ``section.field=value`` whose values are parsed by YAML rules (``algo.eps_high=3.0``,
``model.critic=null``, ``env.options.difficulty=2``, ``run.name='[a, b]'``).

Every bad value fails at load, never mid-run, with :class:`ConfigError`: one paragraph naming the
file, the dotted path of the field and the reason (unknown keys get a "did you mean" hint).

The ``algo`` section holds a preset name plus optional overrides (``None`` = the preset's value);
its fields, documentation and rules are derived from :class:`saorl.algo.presets.AlgoPreset`, where
each setting is declared once. The section resolves the preset once, when it is validated, and
:attr:`AlgoConfig.preset` is that frozen preset, which the run passes to what it builds. Because
``None`` means "keep the preset's value", a preset field that is itself optional (``value_clip``)
can be changed to another number here but not switched off; pick a preset that has it off instead.

The tree is split by concern: :mod:`saorl.config.sections` (run, model, tasks, rollouts),
:mod:`saorl.config.engines` (``rollout.engine``: one section per engine kind, and the flat
spellings of before), :mod:`saorl.config.schema` (algorithm, trainer, runtime, stages and the root
:class:`SaorlConfig`), :mod:`saorl.config.loading` (files, presets, overrides, output); what
every section shares is in :mod:`saorl.config.base`.
"""

from saorl.config.engines import (
    HttpEngineConfig,
    LocalEngineConfig,
    SglangEngineConfig,
    VllmEngineConfig,
)
from saorl.config.loading import (
    PRESET_DIR,
    absolute_paths,
    apply_overrides,
    config_from_dict,
    config_to_dict,
    config_to_yaml,
    find_config,
    load_config,
    parse_override,
    preset_names,
    resolved_algo_dict,
    save_resolved,
)
from saorl.config.schema import (
    NOT_IN_CONFIG,
    AlgoConfig,
    RayConfig,
    RuntimeConfig,
    SaorlConfig,
    SFTConfig,
    TrainerConfig,
    ValuePretrainConfig,
)
from saorl.config.sections import (
    TRACKERS,
    ConfigError,
    DatasetConfig,
    EnvConfig,
    ModelConfig,
    RolloutConfig,
    RunConfig,
    plain_name,
)

__all__ = [
    "NOT_IN_CONFIG", "PRESET_DIR", "TRACKERS", "AlgoConfig", "ConfigError", "DatasetConfig", "EnvConfig",
    "HttpEngineConfig", "LocalEngineConfig", "ModelConfig", "RayConfig", "RolloutConfig", "RunConfig",
    "RuntimeConfig", "SFTConfig", "SaorlConfig", "SglangEngineConfig", "TrainerConfig", "ValuePretrainConfig",
    "VllmEngineConfig", "absolute_paths", "apply_overrides", "config_from_dict",
    "config_to_dict", "config_to_yaml", "find_config", "load_config", "parse_override", "plain_name",
    "preset_names", "resolved_algo_dict", "save_resolved",
]
