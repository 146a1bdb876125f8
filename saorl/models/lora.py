"""LoRA policies through ``peft``: wrap, read and set the adapter, export merged or as an adapter.

:func:`attach_lora` wraps a plain causal LM in a ``peft`` LoRA model: every base weight is frozen
and each targeted ``nn.Linear`` gets ``A`` (``r × in``, peft's Kaiming init) and ``B`` (``out × r``,
zeros), so the wrapped policy starts as exactly the base. Only ``A`` and ``B`` have
``requires_grad``: the learner's optimizer, its gradient clipping and the non-finite guard
(:mod:`saorl.runtime.learner.nonfinite`) hold the adapter and nothing else.

What is published to the engines and checkpointed is :func:`adapter_state` (peft's tensor names,
:mod:`saorl.models.adapter`); the base weights are never rewritten. ``final/policy`` is
:func:`merged_copy` (a plain model: ``W + s·B·A``) and ``final/adapter`` peft's own
``save_pretrained`` plus ``saorl_base.json``, which names the base (a model directory or a tiny
kind with its seed) so ``saorl eval`` and :func:`load_adapter_policy` can rebuild base + adapter.

A LoRA critic (``model.lora.critic``): :func:`attach_critic_lora` puts the same kind of adapter
into the critic's trunk in place (peft's ``inject_adapter_in_model``: the critic stays a
:class:`~saorl.models.critic.Critic`, no wrapper), so the trunk's weights freeze whole and the
adapter trains with the value head. Its checkpoints hold the whole critic (base, adapter, head);
:meth:`~saorl.models.critic.Critic.merged` is the plain critic that ``save_critic`` writes
(``final/critic``, the value-pretrained cache), to which a later run attaches a fresh adapter
(``B = 0``: the same values).

Targets: names of ``nn.Linear`` modules (the last component, as peft matches them). A name of the
default list (:data:`saorl.config.sections.LORA_TARGETS`) that the policy lacks is skipped, so one
list serves dense and MoE models (whose fused experts are not ``nn.Linear`` modules and stay
frozen, with the router); any other name must exist in the policy.
"""

from __future__ import annotations

import copy
import json
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import Tensor, nn

from saorl.atomic import atomic_dir
from saorl.config.sections import LORA_TARGETS
from saorl.config.sections import LoraConfig as LoraConfigSection

BASE_FILE = "saorl_base.json"
"""In ``final/adapter``: ``{"policy": <the base's spec>, "seed": <seed of a tiny kind>}``."""


def linear_names(model: nn.Module) -> list[str]:
    """The distinct last name components of ``model``'s ``nn.Linear`` modules, sorted."""
    return sorted({name.rpartition(".")[2] for name, m in model.named_modules() if isinstance(m, nn.Linear)})


def resolve_targets(model: nn.Module, targets: list[str], optional: tuple[str, ...] = ()) -> list[str]:
    """The target names LoRA uses on ``model``: those of ``targets`` it has. A name of
    ``optional`` (the default list's projections, which one family has and another lacks, like
    the MLP's in a model of fused experts) may be missing; any other must name a linear module.
    ``ValueError`` (one paragraph naming the model's linear modules) otherwise, or when none is left."""
    have = linear_names(model)
    unknown = [t for t in targets if t not in have and t not in optional]
    kept = [t for t in targets if t in have]
    kind = type(model).__name__
    if unknown:
        raise ValueError(f"model.lora.target_modules: {', '.join(unknown)} names no nn.Linear module of "
                         f"the policy ({kind}), whose linear modules are named {', '.join(have)}; "
                         "list some of those")
    if not kept:
        raise ValueError(f"model.lora.target_modules: none of {', '.join(targets)} is a linear module of "
                         f"the policy ({kind}); its linear modules are named {', '.join(have)}: set "
                         "model.lora.target_modules to some of them")
    return kept


def attach_lora(model: nn.Module, *, rank: int, alpha: float, dropout: float, targets: list[str],
                optional: tuple[str, ...] = (), base: dict | None = None, seed: int = 0) -> nn.Module:
    """``model`` wrapped in a peft LoRA model (in place: the base modules are shared, frozen) on
    :func:`resolve_targets`' modules, its ``A`` matrices drawn from ``seed`` (the global RNG is
    left as it was). ``base``: what :func:`save_adapter` records as the base (``{"policy": spec,
    "seed": n}``)."""
    from peft import LoraConfig, get_peft_model

    kept = resolve_targets(model, targets, optional)
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=kept,
                        task_type="CAUSAL_LM", bias="none")
    training = model.training
    with _quiet_peft(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        wrapped = get_peft_model(model, config)
    if base is not None:  # peft takes the model's own name_or_path, empty for a tiny kind
        wrapped.peft_config["default"].base_model_name_or_path = str(base.get("policy"))
    wrapped.saorl_base = dict(base or {})
    return wrapped.train(training)


def attach_critic_lora(critic, *, rank: int, alpha: float, dropout: float, targets: list[str],
                       optional: tuple[str, ...] = (), seed: int = 0):
    """``critic`` (a :class:`~saorl.models.critic.Critic`) with a LoRA adapter injected into its
    trunk, in place, on :func:`resolve_targets`' modules (``A`` drawn from ``seed``, the global RNG
    left as it was); afterwards only the adapter and the value head are trainable."""
    from peft import LoraConfig, inject_adapter_in_model

    if critic.lora:
        raise ValueError("the critic already has a LoRA adapter")
    kept = resolve_targets(critic.trunk, targets, optional)
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=kept, bias="none")
    with _quiet_peft(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        inject_adapter_in_model(config, critic.trunk)
    critic.lora = True
    critic.set_frozen_attention(True)
    return critic


def lora_critic(lora: LoraConfigSection, critic, seed: int):
    """``critic`` as a run's ``model.lora`` section asks: itself, or (``lora.critic``) with a fresh
    LoRA adapter in its trunk (``B = 0``: the same values; :func:`attach_critic_lora`)."""
    if not lora.critic:
        return critic
    return attach_critic_lora(critic, rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout,
                              targets=lora.target_modules, optional=LORA_TARGETS, seed=seed)


def is_lora(model: nn.Module) -> bool:
    """Whether ``model`` is a peft model (an adapter on a frozen base)."""
    return hasattr(model, "peft_config") and hasattr(model, "merge_and_unload")


def adapter_state(model: nn.Module) -> dict[str, Tensor]:
    """The adapter's tensors in peft's names (``base_model.model.<module>.lora_A.weight``), detached."""
    from peft import get_peft_model_state_dict

    # save_embedding_layers=False: the embeddings never train, and "auto" looks the base up on the Hub
    state = get_peft_model_state_dict(model, save_embedding_layers=False)
    return {k: v.detach() for k, v in state.items()}


def adapter_config(model: nn.Module) -> dict:
    """The adapter's ``adapter_config.json`` content, as peft writes it (sets as sorted lists)."""
    config = model.peft_config["default"].to_dict()
    return {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}


def load_adapter_state(model: nn.Module, state: dict[str, Tensor]) -> None:
    """Set the adapter of ``model`` to ``state`` (from :func:`adapter_state`); ``ValueError`` when
    ``state`` is not exactly this adapter's tensors (another rank or targets, full weights)."""
    from peft import set_peft_model_state_dict

    own = adapter_state(model)
    extra, missing = sorted(set(state) - set(own)), sorted(set(own) - set(state))
    if extra or missing:
        raise ValueError(f"the saved policy is not this LoRA adapter: {len(extra)} tensors it does not have "
                         f"(e.g. {extra[:2]}), {len(missing)} of its own missing (e.g. {missing[:2]})")
    for name, t in state.items():
        if tuple(t.shape) != tuple(own[name].shape):
            raise ValueError(f"the saved adapter's {name} has shape {tuple(t.shape)}, this one "
                             f"{tuple(own[name].shape)} (another model.lora.rank?)")
    set_peft_model_state_dict(model, state)


def merged_copy(model: nn.Module) -> nn.Module:
    """A plain copy of the policy with the adapter merged into its weights (``W + s·B·A``); the
    LoRA model itself is left as it is."""
    return copy.deepcopy(model).merge_and_unload()


def save_adapter(model: nn.Module, out_dir: str | Path) -> Path:
    """peft's ``save_pretrained`` of the adapter at ``out_dir`` (atomically) plus :data:`BASE_FILE`."""
    with atomic_dir(out_dir) as tmp:
        # save_embedding_layers=False: the embeddings never train here, and "auto" would look the
        # base's config up on the Hub
        model.save_pretrained(str(tmp), save_embedding_layers=False)
        (tmp / BASE_FILE).write_text(json.dumps(getattr(model, "saorl_base", {}), indent=2) + "\n")
    return Path(out_dir)


def load_adapter_policy(path: str | Path, *, dtype: str | torch.dtype = "float32",
                        device: str | torch.device = "cpu", seed: int | None = None) -> nn.Module:
    """The plain policy base + adapter (merged) of the adapter directory ``path``: the base is the
    one :data:`BASE_FILE` names, else ``adapter_config.json``'s ``base_model_name_or_path``."""
    from peft import PeftModel

    from saorl.models.adapter import ADAPTER_CONFIG
    from saorl.models.loading import load_policy

    path = Path(path)
    base = json.loads((path / BASE_FILE).read_text()) if (path / BASE_FILE).is_file() else {}
    config = json.loads((path / ADAPTER_CONFIG).read_text())
    spec = base.get("policy") or config.get("base_model_name_or_path")
    if not spec:
        raise ValueError(f"adapter directory {str(path)!r} names no base model ({BASE_FILE} or "
                         "base_model_name_or_path in adapter_config.json)")
    seed = base.get("seed", 0) if seed is None else seed
    try:
        model = load_policy(str(spec), dtype=dtype, device=device, seed=seed)
    except (FileNotFoundError, NotADirectoryError) as e:
        raise FileNotFoundError(f"the LoRA adapter {str(path)!r} sits on the base {spec!r} (named in its "
                                f"{BASE_FILE}), which cannot be loaded: {e}") from None
    with _quiet_peft():
        return PeftModel.from_pretrained(model, str(path)).merge_and_unload().eval()


@contextmanager
def _quiet_peft() -> Iterator[None]:
    """Without the FutureWarning of peft 0.21 asking transformers 5 under an old name of a switch."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        yield
