"""Named algorithms as data: each ``AlgoPreset`` says which advantage estimator, which policy loss
and which defaults an algorithm uses, and every setting is declared here once, with its
documentation and its rule (``saorl.config`` derives the ``algo`` config section from them).

Pydantic models like the rest of the config, no torch: the config (and so ``saorl config`` and every
command's start-up) reads the presets without paying for the tensor libraries, and a bad value or
override is pydantic's error naming the field. The trainer looks the estimator and the loss up in
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
critic, ``skip_observation = False`` without GAE). ``lam_policy`` is one typed value: a number (the
fixed λ) or :class:`AdaptiveLambda` (VAPO's length-adaptive rule with its α), from the YAML to the
estimator.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

Mode = Literal["async", "sync"]
AdvantageKind = Literal["gae", "grpo", "running_mean"]
PolicyLossKind = Literal["dis", "ppo"]
Behaviour = Literal["rollout", "trainer"]
AdvantageValues = Literal["after_update", "before_update"]
AdvantageNorm = Literal["none", "batch"]

_STRICT = ConfigDict(frozen=True, extra="forbid", strict=True, allow_inf_nan=False,
                     use_attribute_docstrings=True)


class AdaptiveLambda(BaseModel):
    """VAPO's length-adaptive λ_policy = 1 − 1/(α·l) per trajectory, l = its action-token count (the
    model's own tokens; observation tokens do not count). Spelled ``{adaptive: {alpha: α}}``."""

    model_config = _STRICT

    alpha: float = Field(gt=0.0)
    """α > 0 (VAPO: 0.05; the SAO paper: 1.5)."""

    @model_validator(mode="before")
    @classmethod
    def _unwrap(cls, data: Any) -> Any:
        if isinstance(data, dict) and set(data) == {"adaptive"}:
            return data["adaptive"]
        return data

    @model_serializer
    def _wrap(self) -> dict[str, dict[str, float]]:
        return {"adaptive": {"alpha": self.alpha}}

    def __str__(self) -> str:
        return f"adaptive, α = {self.alpha:g}"


LamValue = float | AdaptiveLambda


def _fixed_in_unit_interval(v: LamValue) -> LamValue:
    if not isinstance(v, AdaptiveLambda) and not 0.0 <= v <= 1.0:
        raise ValueError(f"must be in [0, 1] (or {{adaptive: {{alpha: α}}}}), got {v!r}")
    return v


def _lam_kind(v: Any) -> str:
    return "adaptive" if isinstance(v, (dict, AdaptiveLambda)) else "fixed"


LamPolicy = Annotated[
    Annotated[float, Tag("fixed")] | Annotated[AdaptiveLambda, Tag("adaptive")],
    Discriminator(_lam_kind), AfterValidator(_fixed_in_unit_interval),
]
"""λ_policy, one typed value: a fixed number in [0, 1], or the length-adaptive rule with its α (a
mapping is the rule, anything else the number)."""


class AlgoPreset(BaseModel):
    """One algorithm's choices and defaults. Construction validates every field (strict types:
    a bool is no int, an int no bool); :meth:`with_overrides` makes a validated copy."""

    model_config = _STRICT

    name: str = Field(min_length=1)
    """Algorithm preset name."""
    mode: Mode
    """``async``: single-rollout asynchronous loop; ``sync``: generate a batch, then train."""
    advantage: AdvantageKind
    """Advantage estimator: ``gae`` (critic), ``grpo`` (group-normalised score) or ``running_mean``."""
    policy_loss: PolicyLossKind
    """Policy loss: ``dis`` (SAO's double-sided mask) or ``ppo`` (clipped surrogate)."""
    behaviour: Behaviour
    """What the policy loss's ratio is taken against: ``rollout``, the log-probs the engine recorded when it sampled (an off-policy correction); ``trainer``, the trainer's own log-probs at the start of the step (ratio 1 there: nothing corrected, as commonly deployed)."""  # noqa: E501
    group_size: int = Field(ge=1)
    """Rollouts per prompt (1 = single rollout; ``grpo`` needs at least 2)."""
    use_critic: bool
    """Train a value model (required by ``advantage = gae``)."""
    critic_updates: int = Field(ge=0)
    """K: critic optimizer steps per policy step, on the same batch (>= 1 with a critic)."""
    freeze_critic_attention: bool
    """Train only the critic's MLP / expert projections and value head."""
    skip_observation: bool
    """GAE over action tokens only, skipping observation tokens (False: through every response token)."""
    value_pretrain: bool
    """Fit the critic on rollouts of the initial policy before RL."""
    gamma: float = Field(ge=0.0, le=1.0)
    """Discount per chain step."""
    lam_policy: LamPolicy
    """GAE λ for the policy's advantages: a number in [0, 1] (the fixed λ), or ``{adaptive: {alpha: α}}``, VAPO's length-adaptive λ_policy = 1 − 1/(α·l) per trajectory, l = its action-token count (the model's own tokens; observation tokens do not count), α > 0; only with ``advantage = gae``."""  # noqa: E501
    lam_critic: float = Field(ge=0.0, le=1.0)
    """GAE λ for the critic's targets; 1 = Monte-Carlo returns."""
    eps_low: float = Field(ge=0.0, lt=1.0)
    """Lower band / clip: ratios below 1 − eps_low are masked (DIS) or clipped (PPO)."""
    eps_high: float = Field(gt=0.0)
    """Upper band / clip: ratios above 1 + eps_high are masked (DIS) or clipped (PPO)."""
    value_clip: Annotated[float, Field(gt=0.0)] | None
    """PPO value clipping range, or None for the plain squared error."""
    lm_loss_coef: float = Field(ge=0.0)
    """Weight of the positive-example LM loss (0 disables it)."""
    entropy_coef: float = Field(ge=0.0)
    """Weight of the entropy bonus (0 disables it)."""
    advantage_values: AdvantageValues
    """Which critic values the advantages use: ``after_update``, the critic's after its K steps on this very batch (SAO); ``before_update``, its values before them (a diagnostic: how much of the batch's signal the K steps absorb into the baseline)."""  # noqa: E501
    routing_replay: bool
    """MoE policies: the engine records which experts it routed every token to, and the trainer's policy forward uses those routes instead of recomputing them (R3; the router's own probabilities still weight the replayed experts). Every engine returns them (servers started with ``--enable-return-routed-experts``, docs/engines.md); not with ``trainer.shard: fsdp2``."""  # noqa: E501
    baseline_momentum: float = Field(ge=0.0, lt=1.0)
    """EMA momentum of the running-mean baseline."""
    advantage_norm: AdvantageNorm = "none"
    """``batch``: whiten the advantages over the batch's action tokens, ``(A − mean) / (std + 1e-8)``, as verl and TRL do, over every rank's share in a sharded run; ``none`` (every preset): as the estimator gives them (SAO's critic baseline is not re-centred per batch: its batch-mean advantage is nonzero on all-fail or all-success batches)."""  # noqa: E501

    critic_train_layers: Annotated[int, Field(ge=1)] | None = None
    """Train only the critic's top N transformer blocks (under frozen attention their MLP projections, else the whole blocks and the final norm) and its value head; the blocks below are frozen and run once per batch under no_grad, their output shared by the values pass and the K update passes (a departure from the paper, which trains every block; measured in docs/performance.md). At most the critic's layer count (checked when the model is loaded); not with a LoRA critic nor the sharded trainer. None (every preset): every block trains."""  # noqa: E501

    # the rules that tie fields together: each checked on the later field, against earlier ones
    @field_validator("use_critic")
    @classmethod
    def _gae_needs_a_critic(cls, v: bool, info: ValidationInfo) -> bool:
        if not v and info.data.get("advantage") == "gae":
            raise ValueError("must be True when advantage='gae', got False")
        return v

    @field_validator("critic_updates")
    @classmethod
    def _a_critic_needs_updates(cls, v: int, info: ValidationInfo) -> int:
        if v < 1 and info.data.get("use_critic"):
            raise ValueError(f"must be >= 1 when use_critic, got {v!r}")
        return v

    @field_validator("critic_train_layers")
    @classmethod
    def _top_layers_of_a_critic(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and info.data.get("use_critic") is False:
            raise ValueError(f"is {v}, but the algorithm trains no critic (use_critic=False): drop it")
        return v

    @field_validator("group_size")
    @classmethod
    def _grpo_needs_groups(cls, v: int, info: ValidationInfo) -> int:
        if v < 2 and info.data.get("advantage") == "grpo":
            raise ValueError(f"must be >= 2 when advantage='grpo', got {v!r}")
        return v

    @field_validator("lam_policy")
    @classmethod
    def _adaptive_is_a_gae_rule(cls, v: LamValue, info: ValidationInfo) -> LamValue:
        advantage = info.data.get("advantage")
        if isinstance(v, AdaptiveLambda) and advantage not in (None, "gae"):
            raise ValueError(f"is adaptive, a rule for GAE's λ, but the advantages are {advantage!r}, which "
                             "has no λ: pick a preset with a critic (sao, sao_paper, vapo, ppo) or drop it")
        return v

    def with_overrides(self, **overrides: object) -> AlgoPreset:
        """A validated copy with some fields replaced; an unknown name or a bad value is pydantic's
        ``ValidationError`` (a ``ValueError``) naming the field."""
        fields = {k: getattr(self, k) for k in type(self).model_fields}
        return type(self).model_validate({**fields, **overrides})


def setting_types() -> dict[str, Any]:
    """Each preset field's type with its constraints (``Annotated[float, Ge(0)]``, a ``Literal``, ...),
    by name: what ``saorl.config`` validates an override of the field against."""
    return {n: Annotated[(f.annotation, *f.metadata)] if f.metadata else f.annotation
            for n, f in AlgoPreset.model_fields.items()}


def setting_docs() -> dict[str, str]:
    """Each preset field's documentation, by name."""
    return {n: f.description or "" for n, f in AlgoPreset.model_fields.items()}


_SAO = AlgoPreset(
    name="sao", mode="async", advantage="gae", policy_loss="dis", behaviour="rollout", group_size=1,
    use_critic=True,
    critic_updates=2, freeze_critic_attention=True, skip_observation=True, value_pretrain=True,
    gamma=1.0, lam_policy=0.95, lam_critic=1.0, eps_low=0.3, eps_high=5.0,
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
        _SAO.with_overrides(name="sao_paper", lam_policy=AdaptiveLambda(alpha=1.5)),
        _GRPO,
        _GRPO.with_overrides(name="grpo_dis", policy_loss="dis", eps_low=0.3, eps_high=5.0),
        _SAO.with_overrides(
            name="vapo", mode="sync", policy_loss="ppo", group_size=8, critic_updates=1,
            freeze_critic_attention=False, skip_observation=False, lam_policy=AdaptiveLambda(alpha=0.05),
            eps_low=0.2, eps_high=0.28, lm_loss_coef=0.1,
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
