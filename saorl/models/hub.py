"""A Hugging Face Hub model id's local directory (the ``hub`` row of :mod:`saorl.models.source`,
which classifies every model spec; :func:`saorl.models.source.resolve_source` makes any of them
local).

A Hub model id (``org/name``) is resolved to its snapshot (config, safetensors weights, tokenizer files, chat
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
from pathlib import Path

from saorl.models.cache_dir import ModelSourceError

SNAPSHOT_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
"""What a run needs of a Hub snapshot: configs, safetensors weights, tokenizer files, chat template
(never ``*.bin`` / ``*.pth`` weights, which saorl does not load)."""

__all__ = ["ModelSourceError", "snapshot"]


def snapshot(repo_id: str, what: str) -> Path:
    """The local snapshot of the Hub model ``repo_id``: the Hugging Face cache's, downloaded into it
    first when the Hub can be reached (once per process)."""
    return _snapshot(repo_id, what)


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
