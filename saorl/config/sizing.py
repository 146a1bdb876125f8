"""Defaults sized by the model in hand: the learning rates and the sizes of SFT, value
pretraining and evaluation that a config leaves unset (null) are filled in when it loads, one set
for a small model (the tiny built-ins, and any saved model under :data:`SMALL_PARAMS` parameters:
its SFT warm start, say) and one for a pretrained one (everything else: a Hub id, a short name, a
GGUF file, a directory of a larger model).

The small set is what the tiny models were tuned with, except the policy's rate: 1e-4 learned
fastest in 100 steps but tipped the Quick start's policy into a broken format in 4 of 9 runs of
200 steps at or near it, 3e-5 in none of 5 (docs/guide.md). The pretrained set was measured on
SmolLM2-135M-Instruct on a 2-core CPU (docs/real-model.md): the tiny learning rates (policy 1e-4,
critic 1e-3) broke that policy within 5 steps (every reply cut to the end-of-turn token), 3e-5
learned and then lost half of its gain on one seed of three, 1e-5 / 5e-5 learned on every seed; and
value pretraining, SFT and evaluation at the tiny sizes would take hours on it. Values set in a
config or an override are never changed; the run's saved ``config.yaml`` holds the filled ones,
so a resume trains with what the run started with.

Which model is small is a column of the model source's table (:mod:`saorl.models.source`, no
tensor library): the parameter count of a directory is estimated from its ``config.json`` sizes
(embeddings plus 12·hidden² a layer), close enough to tell 2M from 100M.
"""

from __future__ import annotations

from typing import Any

from saorl.models.source import SMALL_PARAMS, ModelSourceError, estimated_params, parse

__all__ = ["SIZED", "SMALL_PARAMS", "estimated_params", "fill_sized", "is_small"]

SIZED: dict[tuple[str, str], tuple[Any, Any]] = {
    ("trainer", "policy_lr"): (3e-5, 1e-5),
    ("trainer", "critic_lr"): (1e-3, 5e-5),
    ("sft", "steps"): (1000, 40),
    ("sft", "batch_size"): (32, 8),
    ("sft", "lr"): (3e-3, 5e-5),
    ("sft", "num_demos"): (2000, 320),
    ("value_pretrain", "rollouts"): (512, 32),
    ("value_pretrain", "steps"): (100, 8),
    ("value_pretrain", "batch_size"): (16, 8),
    ("value_pretrain", "curve"): (True, False),
    ("value_pretrain", "lr"): (1e-3, 5e-5),
    ("run", "eval_tasks"): (128, 64),
}
"""``(section, field): (small model's value, pretrained model's value)``."""


def is_small(policy: str) -> bool:
    """Whether ``policy`` (``model.policy``) gets the small set: a tiny kind, or a local
    directory whose ``config.json`` estimates under :data:`SMALL_PARAMS` parameters. A spec that
    names no model source counts as pretrained here; preflight names what is wrong with it."""
    try:
        return parse(policy).small()
    except ModelSourceError:
        return False


def fill_sized(cfg) -> None:
    """Fill every field of :data:`SIZED` that ``cfg`` (a :class:`~saorl.config.SaorlConfig`)
    leaves null, by :func:`is_small` of its policy, in place; ``trainer.critic_lr`` from
    ``trainer.critic_lr_ratio`` when that is set (and the critic's rate is not)."""
    from saorl.config.sections import FieldError

    which = 0 if is_small(cfg.model.policy) else 1
    t = cfg.trainer
    if t.critic_lr_ratio is not None:
        t.policy_lr = SIZED[("trainer", "policy_lr")][which] if t.policy_lr is None else t.policy_lr
        rate = t.critic_lr_ratio * t.policy_lr
        # a saved config.yaml holds both, the rate filled from the ratio: that one agrees
        if t.critic_lr is not None and abs(t.critic_lr - rate) > 1e-9 * rate:
            raise FieldError("trainer.critic_lr_ratio", f"set with trainer.critic_lr={t.critic_lr:g}: "
                             "give the critic's rate one way, the ratio or the rate")
        t.critic_lr = rate
    for (section, name), values in SIZED.items():
        part = getattr(cfg, section)
        if getattr(part, name) is None:
            setattr(part, name, values[which])

