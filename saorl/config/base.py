"""What every config section shares: the pydantic base, and the errors a config raises."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

MAX_NAME_BYTES = 200
"""The longest name (UTF-8 bytes) that names a directory: file systems stop at 255, and a run
directory's name adds ``-<timestamp>[-n]`` to it."""


def plain_name(v: str) -> str:
    """``v`` if it can name a directory (non-empty, no path separators, not ``.``/``..``, at most
    :data:`MAX_NAME_BYTES` bytes)."""
    if not v or "/" in v or "\\" in v or v in (".", ".."):
        raise ValueError(f"must be a non-empty name without path separators, got {v!r}")
    if len(v.encode("utf-8")) > MAX_NAME_BYTES:
        raise ValueError(f"must be at most {MAX_NAME_BYTES} bytes (it names a directory), got "
                         f"{len(v.encode('utf-8'))}: {v[:40]!r}...")
    return v


class ConfigError(Exception):
    """A config that cannot be loaded; the message is one paragraph naming file, field and reason."""


class FieldError(ValueError):
    """A cross-field check that failed on ``field`` (a dotted path relative to the model raising it)."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(reason)
        self.field = field


class Section(BaseModel):
    # allow_inf_nan=False: a learning rate of .inf or .nan fails here, not as non-finite weights
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True,
                              allow_inf_nan=False)
