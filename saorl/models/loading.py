"""Load a policy: a tiny kind built offline, or an HF causal LM from a directory or the Hub.

``load_policy("tiny-moe")`` builds a freshly initialised tiny model (see ``saorl.models.tiny``);
``load_policy("/path/to/dir")`` loads ``config.json`` + safetensors with ``local_files_only``;
``load_policy("Qwen/Qwen3-0.6B")`` loads the Hub model's snapshot from the local Hugging Face
cache, downloading it first when the Hub can be reached (:mod:`saorl.models.hub`). MoE models run
their experts with ``grouped_mm`` on CPU (``batched_mm``/``eager`` are far slower there), whatever
the saved config asked for.

dtypes: ``float32``, ``bfloat16`` and ``float16``. Training keeps float16 runs' trainer copies in
float32 (:func:`train_dtype`): AdamW on float16 parameters is unsound (its ``eps`` of 1e-8
underflows to 0 in float16, so a parameter whose gradient is 0 turns NaN after one step, and small
squared gradients underflow in its state), so float16 is what the engines sample with.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from saorl.models.source import ModelSource, accepted, parse
from saorl.models.tiny import build_tiny, tiny_config

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"float32" | "bfloat16" | "float16"`` (or a torch dtype) → torch dtype; clear error otherwise."""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype {dtype} is not supported; expected one of {sorted(DTYPES)}")
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; expected one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def sync_device(device) -> None:
    """Wait for a GPU's queued work, so a timer reads its compute, not its launches (CPU: nothing)."""
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def train_dtype(dtype: str) -> str:
    """The dtype a trainer (RL, SFT, value pretraining) holds weights in for ``model.dtype``:
    float16 trains in float32 (see the module docstring); float32 and bfloat16 as they are."""
    return "float32" if dtype == "float16" else dtype


def is_moe(model: PreTrainedModel) -> bool:
    """Whether the model has fused MoE experts (an ``experts`` module with ``gate_up_proj``)."""
    return any(name.endswith("experts.gate_up_proj") for name, _ in model.named_parameters())


def ensure_cpu_experts(model: PreTrainedModel, device: str | torch.device) -> PreTrainedModel:
    """On CPU, switch an MoE model's experts to ``grouped_mm``; other models are returned as is."""
    on_cpu = torch.device(device).type == "cpu"
    if on_cpu and is_moe(model) and model.config._experts_implementation != "grouped_mm":
        model.set_experts_implementation("grouped_mm")
    return model


def checkpoint_activations(*models: PreTrainedModel | None) -> None:
    """Recompute each decoder layer's activations in the backward pass instead of keeping them
    (transformers' own switch, non-reentrant; it acts in training mode only)."""
    for model in models:
        if model is not None:
            model.activation_checkpointing_enable({"use_reentrant": False})


def check_model_dir(path: Path, what: str = "policy") -> None:
    """Raise a clear error unless ``path`` is a directory with ``config.json`` and safetensors weights."""
    if not path.exists():
        raise FileNotFoundError(
            f"{what} path {str(path)!r} does not exist; expected {accepted()}"
        )
    if not path.is_dir():
        raise NotADirectoryError(f"{what} path {str(path)!r} is a file; expected a model directory")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{what} directory {str(path)!r} has no config.json; it holds no HF model")
    if not any(path.glob("*.safetensors")):
        raise FileNotFoundError(
            f"{what} directory {str(path)!r} has config.json but no *.safetensors weights"
        )


def load_policy(
    spec: str | ModelSource, *, dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu",
    seed: int = 0,
) -> PreTrainedModel:
    """The policy named by ``spec``, in eval mode, on ``device`` in ``dtype``.

    ``spec``: a :class:`~saorl.models.source.ModelSource` or what :func:`~saorl.models.source.parse`
    takes: a tiny kind (``"tiny-moe"``, ``"tiny-dense"``; initialised from ``seed``), a local
    directory with an HF causal LM, a ``.gguf`` file, a short name or a Hub model id (``seed`` is
    then unused: the weights come from disk).
    """
    torch_dtype = resolve_dtype(dtype)
    source = parse(spec, "policy")
    if source.tiny:
        model = build_tiny(source.spec, seed=seed).to(device=device, dtype=torch_dtype)
        return ensure_cpu_experts(model, device).eval()
    path = source.resolve().local
    check_model_dir(path)
    config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        str(path), config=config, dtype=torch_dtype, local_files_only=True,
    )
    model = model.to(device)
    return ensure_cpu_experts(model, device).eval()


def policy_source(spec: str | ModelSource) -> str:
    """What the policy ``spec`` loads from: a tiny kind as it is, else its local directory
    (:meth:`~saorl.models.source.ModelSource.resolve`: a Hub id resolves to its cached snapshot)."""
    return parse(spec).load_spec


def moe_layout(spec: str | ModelSource) -> tuple[int, int]:
    """``(MoE layers, experts per layer)`` of the policy ``spec`` (a tiny kind or a local model
    directory) from its config alone: the model is built on the meta device, no weights are read.
    ``(0, 0)`` for a dense model."""
    from saorl.models import routing

    model = meta_policy(spec)
    return routing.num_moe_layers(model), routing.num_experts(model)


def meta_policy(spec: str | ModelSource) -> PreTrainedModel:
    """The policy ``spec`` (a tiny kind or a local model directory) built on the meta device from
    its config alone: its modules and shapes, no weights read or allocated."""
    source = parse(spec)
    if source.tiny:
        config = tiny_config(source.spec)
    else:
        config = AutoConfig.from_pretrained(source.load_spec, local_files_only=True)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)
