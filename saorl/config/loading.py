"""Reading a config: YAML files with duplicate-key checks, shipped presets, dotted overrides,
validation into one-paragraph :class:`ConfigError` s; and writing the resolved config back."""

from __future__ import annotations

import copy
import difflib
import os
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import (
    BaseModel,
    ValidationError,
)

from saorl.atomic import write_text
from saorl.config.engines import ENGINE_CONFIGS, FLAT_SPELLINGS, engine_section
from saorl.config.schema import LAM_POLICY_SPELLINGS, SaorlConfig
from saorl.config.sections import ConfigError, FieldError
from saorl.run_paths import RunPaths


# --------------------------------------------------------------------------------- overrides
def parse_override(item: str) -> tuple[list[str], Any]:
    """``"a.b=1"`` → ``(["a", "b"], 1)``; the value is parsed by YAML rules."""
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"bad override {item!r}: expected 'section.field=value'")
    parts = key.split(".")
    if any(not p for p in parts):
        raise ConfigError(f"bad override {item!r}: empty name in the dotted path {key!r}")
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError as e:
        raise ConfigError(f"bad override {item!r}: value is not valid YAML ({_one_line(str(e))})") from None
    return parts, value


def apply_overrides(
    data: Mapping[str, Any], overrides: Iterable[str], schema: type[BaseModel] | None = SaorlConfig
) -> dict[str, Any]:
    """A deep copy of ``data`` with each ``"a.b=value"`` applied, in order.

    With a ``schema`` (default :class:`SaorlConfig`), each dotted path is checked against it
    first, so a typo fails here, naming the override. Free-form dict fields (``env.options``)
    accept any key below them.
    """
    out = copy.deepcopy(dict(data))
    for item in overrides:
        parts, value = parse_override(item)
        if schema is not None:
            _check_path(schema, parts, item)
        node = out
        for i, part in enumerate(parts[:-1]):
            if parts[: i + 1] == ["rollout", "engine"] and part in node:
                node[part] = engine_section(node[part])  # a bare kind: rollout.engine.urls=... adds to it
            child = node.setdefault(part, {})
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                where = ".".join(parts[: i + 1])
                raise ConfigError(f"bad override {item!r}: {where} is a value ({child!r}), not a section")
            node = child
        node[parts[-1]] = value
    return out


def _check_path(schema: type[BaseModel], parts: list[str], item: str) -> None:
    models: list[type[BaseModel]] = [schema]
    for i, part in enumerate(parts):
        where = ".".join(parts[: i + 1])
        if not models:
            raise ConfigError(f"bad override {item!r}: {'.'.join(parts[:i])} is a value, not a section")
        fields = _union_fields(models)  # of a union of sections (rollout.engine): any kind's knobs
        if part not in fields:
            if i == 1 and parts[0] == "rollout" and part in FLAT_SPELLINGS:
                return  # a flat spelling of before: moved into rollout.engine when validated
            if i == 1 and parts[0] == "algo" and part in LAM_POLICY_SPELLINGS:
                return  # made algo.lam_policy's typed value when validated
            why = RENAMED.get(where) or _unknown(part, list(fields))
            raise ConfigError(f"bad override {item!r}: {where}: {why}")
        annotation = fields[part].annotation
        if _is_free_dict(annotation):
            return
        models = _section_types(annotation)


def _section_types(annotation: Any) -> list[type[BaseModel]]:
    """The section models of a field annotated ``Section``, ``Section | None`` or a union of
    sections (``rollout.engine``); [] for a value."""
    return [a for a in (annotation, *getattr(annotation, "__args__", ()))
            if isinstance(a, type) and issubclass(a, BaseModel)]


def _union_fields(models: list[type[BaseModel]]) -> dict[str, Any]:
    """The fields of any of ``models`` (of a union of sections: each kind's knobs)."""
    fields: dict[str, Any] = {}
    for m in models:
        fields.update({k: v for k, v in m.model_fields.items() if k not in fields})
    return fields


def _section_type(annotation: Any) -> type[BaseModel] | None:
    """The section model of a field annotated ``Section`` or ``Section | None``, else None."""
    types = _section_types(annotation)
    return types[0] if len(types) == 1 else None


def _is_free_dict(annotation: Any) -> bool:
    return getattr(annotation, "__origin__", None) is dict or annotation is dict


RENAMED = {
    "rollout.logprob_probe_tol": "now spelled rollout.engine.verify_tol, and it bounds the largest per-token "
                                 "log-prob gap, not the mean (default by model.dtype; docs/engines.md)",
}
"""Dotted paths of fields that were renamed → what to write instead. An override (or a dict given
to :func:`config_from_dict`) is refused with that; in a YAML *file* the field is dropped (every run directory
saorl wrote before the rename holds it, and ``--resume`` / ``saorl eval`` must still load it), with
a warning when its value is not the old default."""

_RETIRED_DEFAULTS = {"rollout.logprob_probe_tol": 0.1}


def _drop_retired(data: dict[str, Any], source: str) -> dict[str, Any]:
    for path, default in _RETIRED_DEFAULTS.items():
        section, _, name = path.rpartition(".")
        node = data.get(section)
        if isinstance(node, dict) and name in node:
            value = node.pop(name)
            if value != default:
                warnings.warn(f"{source}: {path}={value!r} is ignored: {RENAMED[path]}", stacklevel=3)
    return data


def _unknown(name: str, known: list[str]) -> str:
    hint = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    if hint:
        return f"unknown field (did you mean {hint[0]}?)"
    return f"unknown field; known fields: {', '.join(known)}"


# ------------------------------------------------------------------------------------- loading
class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that rejects a key repeated in one mapping (PyYAML silently keeps the last)."""


def _construct_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (first on line {seen[key] + 1})", key_node.start_mark
            )
        seen[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config error: file not found: {path}") from None
    except OSError as e:
        raise ConfigError(f"config error: cannot read {path}: {e.strerror or e}") from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        reason = " ".join(x for x in (e.context, e.problem) if x)
        raise ConfigError(f"config error in {path}: YAML syntax error{where}: {_one_line(reason)}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config error in {path}: YAML error: {_one_line(str(e))}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config error in {path}: the top level must be a mapping of sections, "
                          f"got {type(data).__name__}")
    return data


PRESET_DIR = Path(__file__).resolve().parent.parent / "configs"
"""The YAML presets shipped with saorl: package data, which is ``configs/`` in a source checkout
(``saorl/configs`` links to it)."""


def preset_names() -> list[str]:
    """The run-config presets shipped with saorl, by name (``sao_math_tool``, ...)."""
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def find_config(name: str | os.PathLike) -> Path:
    """The YAML file ``name`` names: an existing path; else a preset shipped with saorl, by name
    (``sao_math_tool`` or ``sao_math_tool.yaml``) or by its path in a checkout
    (``configs/sao_math_tool.yaml``), so the documented commands work from an installed wheel in any
    directory. :class:`ConfigError` listing the presets otherwise."""
    path = Path(name).expanduser()
    if path.exists() or path.is_absolute():
        return path
    rel = Path(*path.parts[1:]) if path.parts[:1] == ("configs",) and len(path.parts) > 1 else path
    for candidate in (PRESET_DIR / rel, PRESET_DIR / f"{rel}.yaml"):
        if candidate.is_file():
            return candidate
    raise ConfigError(f"config error: file not found: {name} (not a path from here, nor a preset shipped "
                      f"with saorl; presets: {', '.join(preset_names())})")


def load_config(path: str | os.PathLike | None = None, overrides: Iterable[str] = (), *,
                policy: str | None = None) -> SaorlConfig:
    """Defaults ← YAML file at ``path`` (None: defaults only; a preset name works, see
    :func:`find_config`) ← dotted ``overrides`` ← ``policy`` as ``model.policy`` (a command's own
    model argument: set before validation, so the defaults sized by the model are its,
    :mod:`saorl.config.sizing`)."""
    if path is not None:
        path = find_config(path)
    source = str(path) if path is not None else "<defaults>"
    data = _drop_retired(_read_yaml(Path(path)), source) if path is not None else {}
    overrides = list(overrides)
    try:
        data = apply_overrides(data, overrides)
    except ConfigError as e:
        raise ConfigError(f"config error in {source}: {e}") from None
    if policy is not None:
        data = {**data, "model": {**(data.get("model") or {}), "policy": policy}}
    return config_from_dict(data, source + (" with overrides" if overrides else ""))


def config_from_dict(data: Mapping[str, Any], source: str = "<dict>") -> SaorlConfig:
    """Validate a plain dict; ``ConfigError`` (naming ``source``) on any problem."""
    try:
        return SaorlConfig.model_validate(dict(data))
    except ValidationError as e:
        reasons = "; ".join(_describe(err) for err in e.errors())
        raise ConfigError(f"config error in {source}: {reasons}") from None


def _describe(err: Mapping[str, Any]) -> str:
    loc = [str(x) for x in err["loc"]]
    error = err.get("ctx", {}).get("error")
    if isinstance(error, FieldError):
        loc = [*loc, error.field]
    if loc[:2] == ["rollout", "engine"] and len(loc) > 2 and loc[2] in ENGINE_CONFIGS:
        return _describe_engine(err, loc[2], [*loc[:2], *loc[3:]])  # pydantic puts the kind in loc
    if err["type"] == "union_tag_invalid" and loc == ["rollout", "engine"]:
        return (f"rollout.engine.kind: unknown engine kind {err['ctx']['tag']!r}; the kinds are "
                f"{', '.join(ENGINE_CONFIGS)}")
    path = ".".join(loc) or "(top level)"
    if err["type"] == "extra_forbidden":
        if path in RENAMED:
            return f"{path}: {RENAMED[path]}"
        return f"{path}: {_unknown(loc[-1], _known_fields(loc[:-1]))}"
    if err["type"] == "value_error":
        return f"{path}: {_one_line(str(error))}"
    if err["type"] == "missing":
        return f"{path}: required field missing"
    return f"{path}: {_one_line(err['msg'])} (got {_short(err.get('input'))})"


def _describe_engine(err: Mapping[str, Any], kind: str, loc: list[str]) -> str:
    """An error inside ``rollout.engine`` of kind ``kind``: a knob of another kind is named as such."""
    path = ".".join(loc)
    if err["type"] == "extra_forbidden":
        knobs = [k for k in ENGINE_CONFIGS[kind].model_fields if k != "kind"]
        owners = [k for k, section in ENGINE_CONFIGS.items() if loc[-1] in section.model_fields]
        whose = (f"{loc[-1]} is a knob of kind {' and '.join(owners)} (to switch the section to another "
                 f"kind, give the kind alone, e.g. rollout.engine={kind}: that drops the old kind's knobs)"
                 if owners else _unknown(loc[-1], knobs))
        return f"{path}: not a knob of engine kind {kind!r}, whose knobs are {', '.join(knobs)}; {whose}"
    error = err.get("ctx", {}).get("error")
    if isinstance(error, FieldError):  # loc names its field already
        return f"{path}: {_one_line(str(error))}"
    return _describe({**err, "loc": tuple(loc)})


def _known_fields(loc: list[str]) -> list[str]:
    model: type[BaseModel] = SaorlConfig
    for part in loc:
        section = _section_type(model.model_fields[part].annotation) if part in model.model_fields else None
        if section is None:
            return []
        model = section
    return list(model.model_fields)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _one_line(text: str) -> str:
    return " ".join(text.split())


# ------------------------------------------------------------------------------------- output
def config_to_dict(cfg: SaorlConfig) -> dict[str, Any]:
    """Plain, YAML/JSON-safe dict of the config, in field order. With ``trainer.critic_lr_ratio``
    the critic's rate is left null (the ratio says it), so a reload that changes the policy's
    rate (``--resume RUN trainer.policy_lr=...``, ``saorl replay``) moves the critic's with it."""
    data = cfg.model_dump(mode="json")
    if cfg.trainer.critic_lr_ratio is not None:
        data["trainer"]["critic_lr"] = None
    return data


def config_to_yaml(cfg: SaorlConfig) -> str:
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False, default_flow_style=False)


def resolved_algo_dict(cfg: SaorlConfig) -> dict[str, Any]:
    """The run's resolved algorithm preset as a plain dict (``lam_policy`` a number or
    ``{adaptive: {alpha: α}}``, as the config writes it)."""
    return cfg.algo.preset.model_dump(mode="json")


def absolute_paths(cfg: SaorlConfig) -> SaorlConfig:
    """A copy of ``cfg`` whose paths are absolute (resolved against the working directory), so that it
    means the same from any directory: a run's saved ``config.yaml`` (``--resume`` from elsewhere) and
    the keys of the SFT and value-pretraining caches.

    ``run.out_dir``, the task files and ``env.dataset.path`` are always paths; ``model.policy``,
    ``model.tokenizer`` and ``model.critic`` are made absolute only when they name an existing path
    (a tiny kind stays as it is).
    """
    out = cfg.model_copy(deep=True)

    def absolute(p: str) -> str:
        return os.path.abspath(os.path.expanduser(p))

    out.run.out_dir = absolute(out.run.out_dir)
    for section, name in (("env", "tasks_file"), ("env", "test_tasks_file"), ("model", "policy"),
                          ("model", "tokenizer"), ("model", "critic")):
        sec = getattr(out, section)
        value = getattr(sec, name)
        if value and (section == "env" or os.path.exists(os.path.expanduser(value))):
            setattr(sec, name, absolute(value))
    if out.env.dataset is not None:
        out.env.dataset.path = absolute(out.env.dataset.path)
    return out


def save_resolved(cfg: SaorlConfig, run_dir: str | os.PathLike) -> Path:
    """Write ``config.yaml`` (loadable by :func:`load_config`) and ``algo_resolved.yaml`` to ``run_dir``.

    Returns the path of ``config.yaml``. Files are written atomically (temp file + rename).
    """
    paths = RunPaths(run_dir)
    paths.root.mkdir(parents=True, exist_ok=True)
    path = paths.config
    write_text(path, config_to_yaml(cfg))
    header = "# The algorithm preset after overrides (informational; config.yaml is the source).\n"
    write_text(paths.algo_resolved,
                  header + yaml.safe_dump(resolved_algo_dict(cfg), sort_keys=False))
    return path
