"""Hugging Face checkpoint names: what ``save_pretrained`` writes and inference servers load.

transformers keeps some weights in a fused in-memory layout that differs from the names on disk:
a Qwen3-MoE layer holds its experts as ``mlp.experts.gate_up_proj [E, 2I, H]`` and
``mlp.experts.down_proj [E, H, I]``, while its checkpoint (and vLLM / SGLang) name them
``mlp.experts.{e}.gate_proj.weight``, ``up_proj``, ``down_proj`` per expert. Every conversion here
is transformers' own — ``revert_weight_conversion`` and ``remove_tied_weights_from_state_dict``
(what ``save_pretrained`` calls), ``from_pretrained`` (the way back) — never a hand-written map,
so a family transformers learns to fuse converts the same way.

- :func:`saved_names`: the in-memory names ``save_pretrained`` keeps (a tied LM head is dropped).
- :func:`served_names`: what an inference server must be sent: :func:`saved_names` plus every tied
  weight (the LM head of a model with ``tie_word_embeddings``). vLLM keeps its own copy of a tied
  head (its CPU build prepacks it at load) and an in-place reload re-processes only the layers the
  checkpoint carries, so a checkpoint without ``lm_head.weight`` leaves the server sampling from
  the new weights through the *old* head (measured on vLLM 0.32.0: 0.58 nats per token off after
  one update). ``from_pretrained`` accepts the extra name (it ties the head anyway).
- :func:`to_checkpoint`: full tensors in in-memory names → checkpoint names. It may be applied to
  a *bucket* of the state dict at a time, as ``save_pretrained`` does for offloaded shards, as long
  as every tensor one conversion reads is in the same bucket (for the families saorl supports,
  each conversion reads one tensor).
- :func:`save_hf_weights`: a state dict as the Hugging Face directory a server loads (tied weights
  included).
- :func:`from_checkpoint` / :func:`read_weights`: checkpoint-named tensors, or a directory / a
  safetensors file, → a state dict in the in-memory names of a model.
"""

from __future__ import annotations

import copy
import json
import math
import os
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from torch import Tensor
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

INDEX = "model.safetensors.index.json"


def saved_names(model: PreTrainedModel) -> list[str]:
    """The state-dict keys ``save_pretrained`` writes (before renaming), in state-dict order."""
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    kept = remove_tied_weights_from_state_dict(dict(model.state_dict()), model)
    return [k for k in model.state_dict() if k in kept]


def served_names(model: PreTrainedModel) -> list[str]:
    """:func:`saved_names` and the tied weights (``lm_head.weight`` when the head is tied), in
    state-dict order: the names a publication to an inference server carries (module docstring)."""
    keep = set(saved_names(model)) | set(getattr(model, "all_tied_weights_keys", None) or {})
    return [k for k in model.state_dict() if k in keep]


def to_checkpoint(model: PreTrainedModel, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """``tensors`` (full, in-memory names of ``model``) in Hugging Face checkpoint names."""
    from transformers.core_model_loading import revert_weight_conversion

    return {k: v.contiguous() for k, v in revert_weight_conversion(model, dict(tensors)).items()}


def model_class(config: PretrainedConfig) -> type[PreTrainedModel]:
    """The causal-LM class ``AutoModelForCausalLM`` builds for ``config`` (built on the meta device)."""
    with torch.device("meta"):
        return type(AutoModelForCausalLM.from_config(config))


def from_checkpoint(config: PretrainedConfig, tensors: dict[str, Tensor],
                    dtype: torch.dtype | None = None,
                    cls: type[PreTrainedModel] | None = None) -> dict[str, Tensor]:
    """Checkpoint-named ``tensors`` of a causal LM → its state dict in in-memory names, through
    ``from_pretrained`` (a CPU model is built and discarded)."""
    from saorl.models.serialize import quiet_progress

    cls = cls or model_class(config)
    with quiet_progress():
        model = cls.from_pretrained(None, config=config, state_dict=dict(tensors), dtype=dtype)
    return model.state_dict()


_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


class FileWeights(Mapping[str, Tensor]):
    """The tensors of a safetensors file, each read (plain reads, no mapping) when it is asked for;
    names and shapes from its header alone. An engine applying an update from it holds one tensor
    of the update at a time, not a second copy of the model beside its own, and no mapping of the
    file counts in its RSS (``safetensors.torch.load_file`` holds the whole state dict: 513 MiB more
    in each rollout worker of SmolLM2-135M). The file stays open while this lives, so a publisher
    pruning it meanwhile takes nothing away. ``ValueError`` for a file whose header is not a
    safetensors one or whose data is not all there (checked here: an update never fails half
    applied for a file cut short)."""

    def __init__(self, path: str | Path) -> None:
        self._f = open(path, "rb")  # open while this lives; closed with it
        try:
            n = int.from_bytes(self._f.read(8), "little")
            if not 2 <= n <= 100 * 2**20:
                raise ValueError(f"a header of {n} bytes")
            header = json.loads(self._f.read(n))
            header.pop("__metadata__", None)
            self._start = 8 + n
            self._entries = {k: (_SAFETENSORS_DTYPES[v["dtype"]], tuple(v["shape"]), *v["data_offsets"])
                             for k, v in header.items()}
            data = os.fstat(self._f.fileno()).st_size - self._start
            for k, (dtype, shape, begin, end) in self._entries.items():  # all of it there, now
                size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
                if not (begin >= 0 and end - begin == size and end <= data):
                    raise ValueError(f"{k}: bytes {begin} to {end} of {data} for {size}")
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
            self._f.close()
            raise ValueError(f"{str(path)!r}: not readable as safetensors ({e})") from None

    def shape(self, name: str) -> tuple[int, ...]:
        """``name``'s shape, from the header (nothing read)."""
        return self._entries[name][1]

    def __getitem__(self, name: str) -> Tensor:
        dtype, shape, begin, end = self._entries[name]
        out = torch.empty(end - begin, dtype=torch.uint8)
        self._f.seek(self._start + begin)
        if self._f.readinto(out.numpy()) != end - begin:
            raise OSError(f"{self._f.name}: {name} is cut short")
        return out.view(dtype).reshape(shape)

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __del__(self) -> None:
        f = getattr(self, "_f", None)
        if f is not None:
            f.close()


def read_weights(path: str | Path, like: PreTrainedModel) -> Mapping[str, Tensor]:
    """The weights at ``path`` in ``like``'s in-memory names: a safetensors file of a state dict
    (as it is, each tensor read when asked for: :class:`FileWeights`) or a Hugging Face directory
    (converted by ``from_pretrained``, once :func:`check_same_model` has passed). ``ValueError`` for
    what is not such weights (garbage, text, another model's directory), ``OSError`` for what cannot
    be read."""
    from safetensors import SafetensorError

    path = Path(path)
    try:
        if path.is_file():
            return FileWeights(path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{str(path)!r} is neither a safetensors file nor a model directory")
        check_same_model(path, like)
        from saorl.models.serialize import quiet_progress

        with quiet_progress():
            model = type(like).from_pretrained(str(path), local_files_only=True, dtype=like.dtype)
    except SafetensorError as e:
        raise ValueError(f"{str(path)!r}: not readable as safetensors ({e})") from None
    return model.state_dict()


def check_same_model(path: str | Path, like: PreTrainedModel) -> None:
    """``ValueError`` unless the ``config.json`` of the directory ``path`` builds ``like``'s weights,
    name for name and shape for shape. Decided on the meta device, before any weight is read or
    allocated: ``from_pretrained`` builds whatever the config describes first (the defaults of a
    Qwen3-MoE config for a file that names another model type: tens of GB)."""
    try:
        config = type(like.config).from_pretrained(str(path), local_files_only=True)
        with torch.device("meta"):
            skeleton = type(like)(config)
    except OSError:
        raise
    except Exception as e:  # an untrusted config: whatever it breaks, it is not this model's
        raise ValueError(f"{str(path)!r}: config.json does not build a {type(like).__name__} "
                         f"({e!r})") from None
    want = {k: tuple(v.shape) for k, v in like.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in skeleton.state_dict().items()}
    if got != want:
        name = next(k for k in sorted(want.keys() | got.keys()) if want.get(k) != got.get(k))
        raise ValueError(f"{str(path)!r}: config.json describes another model ({name}: "
                         f"{got.get(name, 'absent')} there, {want.get(name, 'absent')} here)")


def write_index(directory: Path, weight_map: dict[str, str], total_size: int) -> None:
    """``model.safetensors.index.json`` for shard files already in ``directory``."""
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / INDEX).write_text(json.dumps(index, indent=2) + "\n")


def save_hf_weights(model, state_dict: dict[str, Tensor], out_dir: str | Path) -> Path:
    """``state_dict`` (``model``'s in-memory names) as a Hugging Face model directory at
    ``out_dir``, atomically: ``config.json`` and one ``model.safetensors`` under the on-disk names
    that ``from_pretrained`` (and vLLM / SGLang) read, **tied weights included**
    (:func:`served_names`: a server keeps its own copy of a tied head and
    reloads only what the checkpoint carries), no tokenizer."""
    from saorl.atomic import atomic_dir
    from saorl.models.serialize import save_safetensors_atomic

    names = served_names(model)
    missing = [n for n in names if n not in state_dict]
    if missing:
        raise KeyError(f"the state dict lacks {len(missing)} of the model's weights, e.g. {missing[:3]}")
    tensors = to_checkpoint(model, {n: state_dict[n] for n in names})
    with atomic_dir(out_dir) as tmp:
        save_safetensors_atomic(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        hf_config(model).to_json_file(str(tmp / "config.json"))
    return Path(out_dir)


def hf_config(model):
    """``model``'s config as ``save_pretrained`` writes it: ``architectures`` names the class (what
    a server builds from the directory) and ``dtype`` is the weights' dtype."""
    config = copy.deepcopy(model.config)
    config.architectures = [type(model).__name__]
    config.dtype = next(model.parameters()).dtype
    return config
