"""Where a model or tokenizer named in the config lives: a local directory, a GGUF file, a short
name of a model on the package index, or a Hugging Face Hub id.

``resolve_source("path/to/dir")`` is that directory when it exists. A ``.gguf`` file and a short
name (``smollm2-135m-instruct``) resolve to a plain Hugging Face directory converted once into
saorl's cache (:mod:`saorl.models.gguf_source`). Anything else of the form
``org/name`` is a Hub model id: its snapshot (config, safetensors weights, tokenizer files, chat
template) is found in the local Hugging Face cache or downloaded into it with
``huggingface_hub.snapshot_download`` (the resolution ``from_pretrained`` does, once per process
and for every file the run needs), and its cache directory is returned. So the rest of saorl only
ever loads local directories, with ``local_files_only``, and the rollout workers are handed that
directory rather than asking the Hub again.

Without network (``HF_HUB_OFFLINE=1``, or a machine that cannot reach the Hub) a model that is
not in the cache is :class:`ModelSourceError`, one paragraph saying how to download it elsewhere
and point ``model.policy`` at the directory.
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path

from saorl.models.gguf_source import REGISTRY_MODELS, ModelSourceError, gguf_dir, registry_dir

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
"""A Hub model id: ``org/name`` (letters, digits, ``_``, ``.``, ``-``)."""

SNAPSHOT_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
"""What a run needs of a Hub snapshot: configs, safetensors weights, tokenizer files, chat template
(never ``*.bin`` / ``*.pth`` weights, which saorl does not load)."""


__all__ = ["REGISTRY_MODELS", "ModelSourceError", "is_hub_id", "resolve_source"]


def is_hub_id(spec: str) -> bool:
    """Whether ``spec`` has the form of a Hub model id (and so may be looked up on the Hub)."""
    return bool(HUB_ID.fullmatch(spec)) and ".." not in spec


def resolve_source(spec: str, what: str = "model.policy") -> Path:
    """The local directory of ``spec``: itself when it exists, else its Hub snapshot (see the module
    docstring). ``what`` names the config field in errors. A Hub id is resolved once per process; a
    GGUF file or a short name is converted once into saorl's cache (later: a check of the entry
    against its manifest, :mod:`saorl.models.cache_manifest`)."""
    path = Path(spec).expanduser()
    if path.exists():
        if path.is_file() and path.suffix.lower() == ".gguf":
            return gguf_dir(spec, path, what)
        if not path.is_dir():
            raise NotADirectoryError(f"{what} {spec!r} is a file; expected a directory holding a Hugging "
                                     "Face model or tokenizer, a .gguf file, a short name ("
                                     f"{', '.join(REGISTRY_MODELS)}) or a Hub model id such as "
                                     "Qwen/Qwen3-0.6B")
        return path
    if spec in REGISTRY_MODELS:
        return registry_dir(spec, what)
    if not is_hub_id(spec):
        raise ModelSourceError(
            f"{what} {spec!r} does not exist (relative to {os.getcwd()}) and is not a Hugging Face Hub model "
            "id (org/name, e.g. Qwen/Qwen3-0.6B) nor a short name saorl knows "
            f"({', '.join(REGISTRY_MODELS)}); give a local model directory (config.json + *.safetensors "
            "+ tokenizer files), a .gguf file, a short name or a Hub id")
    return _snapshot(spec, what)


@functools.cache
def _snapshot(repo_id: str, what: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return Path(snapshot_download(repo_id, allow_patterns=SNAPSHOT_FILES))
    except LocalEntryNotFoundError as e:
        raise ModelSourceError(
            f"{what} {repo_id!r} is not a local directory, so it was looked up as a Hugging Face Hub model, "
            "but it is not in the local Hugging Face cache and the Hub cannot be reached from here (no "
            "network, or HF_HUB_OFFLINE=1). Download it where there is network access, e.g. `hf download "
            f"{repo_id} --local-dir DIR` (or `huggingface-cli download {repo_id} --local-dir DIR`), copy DIR "
            f"to this machine and set {what}=DIR; or fill the cache that HF_HOME points at. "
            f"(huggingface_hub: {_first_line(e)})") from None
    except GatedRepoError as e:
        raise ModelSourceError(
            f"{what} {repo_id!r} is a gated Hugging Face Hub model: accept its licence on its Hub page and "
            f"log in (`hf auth login`, or set HF_TOKEN), then run again. (huggingface_hub: {_first_line(e)})"
        ) from None
    except RepositoryNotFoundError as e:
        raise ModelSourceError(
            f"{what} {repo_id!r} is neither a local directory nor a model on the Hugging Face Hub (or it is "
            f"private: log in with `hf auth login`). Check the spelling. (huggingface_hub: {_first_line(e)})"
        ) from None


def _first_line(e: BaseException) -> str:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return " ".join(lines[:2])[:300] or type(e).__name__
