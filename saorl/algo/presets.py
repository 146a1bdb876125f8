"""Named algorithms as data: each ``AlgoPreset`` says which advantage estimator, which policy loss
and which defaults an algorithm uses, and every setting is declared here once, with its
documentation and its rule (``saorl.config`` derives the ``algo`` config section from them).

Plain data, no torch: the config (and so ``saorl config`` and every command's start-up) reads the
presets without paying for the tensor libraries. The trainer looks the estimator and the loss up in
:mod:`saorl.algo.registry` by the preset's strings and never branches on the algorithm's name.

Presets (choices the paper leaves open are marked *chosen*):

- ``sao``: async single rollout, skip-observation GAE, DIS with the band ε = 0.3 / 5.0 that a
  public reproduction reported for math (*reported, unverified*), critic with frozen attention,
  K = 2 critic steps per policy step on λ_critic = 1 returns, value pretraining, γ = 1.
  λ_policy = 0.95 (*chosen*: the usual PPO value; the paper gives none).
- ``grpo``: sync groups of 8, group-normalised advantage, PPO clip 0.2 / 0.2 against the rollout
  policy, no critic.
- ``grpo_dis``: ``grpo`` with SAO's DIS loss and band, so only the loss differs.
- ``vapo``: sync groups of 8, value-based PPO with clip-higher 0.2 / 0.28, decoupled GAE
  (λ_critic = 1, length-adaptive λ_policy with α = 0.05), value pretraining, positive-example LM
  loss with coefficient 0.1, K = 1. ``skip_observation = False`` (*chosen*): VAPO as published
  runs plain token-level GAE (it was defined for single-turn math and says nothing about
  observation tokens), so the comparison isolates what SAO adds. No attention freezing.
- ``ppo``: textbook PPO on single rollouts, sync: GAE with λ = 0.95 for both advantages and
  critic targets, PPO clip 0.2 / 0.2, value clip 0.2 (*chosen*, common in LLM PPO), K = 1,
  plain token GAE, no freezing, no value pretraining.
- ``reinforce_rm``: async single rollout, REINFORCE with a running-mean baseline (momentum 0.9,
  *chosen*). It uses the DIS loss with SAO's band (*chosen*) so that only the baseline differs
  from ``sao``.

Every preset takes its policy-loss ratio against the rollout log-probs the engine recorded
(``behaviour = "rollout"``), an off-policy correction in itself; ``behaviour = "trainer"`` takes it
against the trainer's own log-probs at the start of the step (ratio 1: nothing corrected), the
uncorrected baseline as commonly deployed.

Fields that an algorithm does not use keep neutral values (``critic_updates = 0`` without a
critic, ``skip_observation = False`` without GAE); ``lam_policy`` is ignored when ``vapo_alpha``
is set.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, get_args, get_origin, get_type_hints

Mode = Literal["async", "sync"]
AdvantageKind = Literal["gae", "grpo", "running_mean"]
PolicyLossKind = Literal["dis", "ppo"]
Behaviour = Literal["rollout", "trainer"]
AdvantageValues = Literal["after_update", "before_update"]
AdvantageNorm = Literal["none", "batch"]


class SettingError(ValueError):
    """A bad algorithm setting; ``field`` names it, ``reason`` says why (``saorl.config`` reports
    it under ``algo.<field>``)."""

    def __init__(self, preset: str, field: str, reason: str) -> None:
        super().__init__(f"AlgoPreset {preset!r}: {field} {reason}")
        self.preset, self.field, self.reason = preset, field, reason


def _about(doc: str, rule: str = "", check: Callable[[Any], bool] | None = None) -> dict[str, Any]:
    """A preset field's documentation and value rule, declared once with the field
    (``saorl.config`` derives the ``algo`` config section from them)."""
    return {"doc": doc, "rule": rule, "check": check}


@dataclass(frozen=True)
class AlgoPreset:
    """One algorithm's choices and defaults. Construction validates every field."""

    name: str = field(metadata=_about("Algorithm preset name.", "a non-empty string", bool))
    mode: Mode = field(metadata=_about(
        "``async``: single-rollout asynchronous loop; ``sync``: generate a batch, then train."))
    advantage: AdvantageKind = field(metadata=_about(
        "Advantage estimator: ``gae`` (critic), ``grpo`` (group-normalised score) or ``running_mean``."))
    policy_loss: PolicyLossKind = field(metadata=_about(
        "Policy loss: ``dis`` (SAO's double-sided mask) or ``ppo`` (clipped surrogate)."))
    behaviour: Behaviour = field(metadata=_about(
        "What the policy loss's ratio is taken against: ``rollout``, the log-probs the engine recorded "
        "when it sampled (an off-policy correction); ``trainer``, the trainer's own log-probs at the start "
        "of the step (ratio 1 there: nothing corrected, as commonly deployed)."))
    group_size: int = field(metadata=_about(
        "Rollouts per prompt (1 = single rollout; ``grpo`` needs at least 2).", ">= 1", lambda v: v >= 1))
    use_critic: bool = field(metadata=_about("Train a value model (required by ``advantage = gae``)."))
    critic_updates: int = field(metadata=_about(
        "K: critic optimizer steps per policy step, on the same batch (>= 1 with a critic).", ">= 0",
        lambda v: v >= 0))
    freeze_critic_attention: bool = field(metadata=_about(
        "Train only the critic's MLP / expert projections and value head."))
    skip_observation: bool = field(metadata=_about(
        "GAE over action tokens only, skipping observation tokens (False: through every response token)."))
    value_pretrain: bool = field(metadata=_about(
        "Fit the critic on rollouts of the initial policy before RL."))
    gamma: float = field(metadata=_about("Discount per chain step.", "in [0, 1]", lambda v: 0.0 <= v <= 1.0))
    lam_policy: float = field(metadata=_about(
        "GAE λ for the policy's advantages when ``vapo_alpha`` is None (the fixed λ).", "in [0, 1]",
        lambda v: 0.0 <= v <= 1.0))
    lam_critic: float = field(metadata=_about(
        "GAE λ for the critic's targets; 1 = Monte-Carlo returns.", "in [0, 1]", lambda v: 0.0 <= v <= 1.0))
    vapo_alpha: float | None = field(metadata=_about(
        "When set, λ_policy = 1 − 1/(α·l) per trajectory, l = its action-token count (the model's own "
        "tokens; observation tokens do not count).", "> 0 or None",
        lambda v: v is None or v > 0))
    eps_low: float = field(metadata=_about(
        "Lower band / clip: ratios below 1 − eps_low are masked (DIS) or clipped (PPO).", "in [0, 1)",
        lambda v: 0.0 <= v < 1.0))
    eps_high: float = field(metadata=_about(
        "Upper band / clip: ratios above 1 + eps_high are masked (DIS) or clipped (PPO).", "> 0",
        lambda v: v > 0.0))
    value_clip: float | None = field(metadata=_about(
        "PPO value clipping range, or None for the plain squared error.", "> 0 or None",
        lambda v: v is None or v > 0))
    lm_loss_coef: float = field(metadata=_about(
        "Weight of the positive-example LM loss (0 disables it).", ">= 0", lambda v: v >= 0.0))
    entropy_coef: float = field(metadata=_about(
        "Weight of the entropy bonus (0 disables it).", ">= 0", lambda v: v >= 0.0))
    advantage_values: AdvantageValues = field(metadata=_about(
        "Which critic values the advantages use: ``after_update``, the critic's after its K steps on "
        "this very batch (SAO); ``before_update``, its values before them (a diagnostic: how much of "
        "the batch's signal the K steps absorb into the baseline)."))
    routing_replay: bool = field(metadata=_about(
        "MoE policies: the engine records which experts it routed every token to, and the trainer's "
        "policy forward uses those routes instead of recomputing them (R3; the router's own "
        "probabilities still weight the replayed experts). Every engine returns them (servers started "
        "with ``--enable-return-routed-experts``, docs/engines.md); not with ``trainer.shard: fsdp2``."))
    baseline_momentum: float = field(metadata=_about(
        "EMA momentum of the running-mean baseline.", "in [0, 1)", lambda v: 0.0 <= v < 1.0))
    advantage_norm: AdvantageNorm = field(default="none", metadata=_about(
        "``batch``: whiten the advantages over the batch's action tokens, ``(A − mean) / (std + 1e-8)``, "
        "as verl and TRL do, over every rank's share in a sharded run; ``none`` (every preset): as the "
        "estimator gives them (SAO's critic baseline is not re-centred per batch: its batch-mean "
        "advantage is nonzero on all-fail or all-success batches)."))

    def __post_init__(self) -> None:
        _validate(self)

    def with_overrides(self, **overrides: object) -> AlgoPreset:
        """A copy with some fields replaced; unknown names or bad values raise ``ValueError``."""
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ValueError(f"AlgoPreset has no field(s) {unknown}; known fields: {sorted(known)}")
        return dataclasses.replace(self, **overrides)


@functools.cache
def setting_types() -> dict[str, Any]:
    """Each preset field's type (``float``, ``float | None``, a ``Literal``, ...), by name."""
    return get_type_hints(AlgoPreset)


def setting_docs() -> dict[str, str]:
    """Each preset field's documentation, by name."""
    return {f.name: f.metadata["doc"] for f in dataclasses.fields(AlgoPreset)}


def setting_rules() -> dict[str, str]:
    """Each preset field's value rule in words ('' when its type says it all), by name."""
    return {f.name: f.metadata["rule"] for f in dataclasses.fields(AlgoPreset)}


def _type_rule(hint: Any) -> tuple[Callable[[Any], bool], str]:
    """(is this value of the type, how to say the type) for one field's type hint."""
    if get_origin(hint) is Literal:
        return (lambda v: v in get_args(hint)), f"one of {get_args(hint)}"
    optional = type(None) in get_args(hint)
    base = next((a for a in get_args(hint) if a is not type(None)), hint)

    def ok(v: Any) -> bool:
        if v is None:
            return optional
        if base is bool:
            return isinstance(v, bool)
        if isinstance(v, bool) or not isinstance(v, (int, float) if base is float else base):
            return False
        return base is not float or math.isfinite(v)

    what = {bool: "a bool", int: "an int", float: "a finite number", str: "a string"}[base]
    return ok, what + (" or None" if optional else "")


def _validate(p: AlgoPreset) -> None:
    """Raise :class:`SettingError` on the first bad field: its type, its rule, then the rules
    that tie fields together."""
    for f in dataclasses.fields(p):
        value = getattr(p, f.name)
        ok, what = _type_rule(setting_types()[f.name])
        if not ok(value):
            raise SettingError(p.name, f.name, f"must be {what}, got {value!r}")
        check = f.metadata["check"]
        if check is not None and not check(value):
            raise SettingError(p.name, f.name, f"must be {f.metadata['rule']}, got {value!r}")
    ties = [
        ("critic_updates", p.critic_updates >= 1 or not p.use_critic, ">= 1 when use_critic"),
        ("use_critic", p.use_critic or p.advantage != "gae", "True when advantage='gae'"),
        ("group_size", p.group_size >= 2 or p.advantage != "grpo", ">= 2 when advantage='grpo'"),
    ]
    for name, ok, rule in ties:
        if not ok:
            raise SettingError(p.name, name, f"must be {rule}, got {getattr(p, name)!r}")


_SAO = AlgoPreset(
    name="sao", mode="async", advantage="gae", policy_loss="dis", behaviour="rollout", group_size=1,
    use_critic=True,
    critic_updates=2, freeze_critic_attention=True, skip_observation=True, value_pretrain=True,
    gamma=1.0, lam_policy=0.95, lam_critic=1.0, vapo_alpha=None, eps_low=0.3, eps_high=5.0,
    value_clip=None, lm_loss_coef=0.0, entropy_coef=0.0, advantage_values="after_update",
    routing_replay=False,
    baseline_momentum=0.9,
)
_GRPO = _SAO.with_overrides(
    name="grpo", mode="sync", advantage="grpo", policy_loss="ppo", group_size=8, use_critic=False,
    critic_updates=0, freeze_critic_attention=False, skip_observation=False, value_pretrain=False,
    lam_policy=1.0, eps_low=0.2, eps_high=0.2,
)
PRESETS: dict[str, AlgoPreset] = {
    p.name: p
    for p in (
        _SAO,
        # the paper's values where it states them (docs/method.md, "Fidelity to the paper"): the
        # length-adaptive λ_policy = 1 − 1/(1.5·l); its trainer knobs (critic warm-up, learning
        # rates, batch) are trainer settings: the GPU configs set them (configs/recipes/qwen3_0.6b_gsm8k.yaml)
        _SAO.with_overrides(name="sao_paper", vapo_alpha=1.5),
        _GRPO,
        _GRPO.with_overrides(name="grpo_dis", policy_loss="dis", eps_low=0.3, eps_high=5.0),
        _SAO.with_overrides(
            name="vapo", mode="sync", policy_loss="ppo", group_size=8, critic_updates=1,
            freeze_critic_attention=False, skip_observation=False, vapo_alpha=0.05, eps_low=0.2,
            eps_high=0.28, lm_loss_coef=0.1,
        ),
        _SAO.with_overrides(
            name="ppo", mode="sync", policy_loss="ppo", critic_updates=1, freeze_critic_attention=False,
            skip_observation=False, value_pretrain=False, lam_critic=0.95, eps_low=0.2, eps_high=0.2,
            value_clip=0.2,
        ),
        _SAO.with_overrides(
            name="reinforce_rm", advantage="running_mean", use_critic=False, critic_updates=0,
            freeze_critic_attention=False, skip_observation=False, value_pretrain=False, lam_policy=1.0,
        ),
    )
}


def get_preset(name: str) -> AlgoPreset:
    """The preset called ``name``; ``ValueError`` listing the known names otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown algorithm {name!r}; known: {list_presets()}") from None


def list_presets() -> list[str]:
    return sorted(PRESETS)
