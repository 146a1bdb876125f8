"""An experiment spec: the YAML that says which arms to compare, on which seeds, with what budget.

A spec (``configs/experiments/*.yaml``) names a base run config plus overrides shared by every
arm, then the arms, each a list of dotted overrides on top (``algo.name=grpo``). Every arm gets
the same budget: ``budget.steps`` trainer steps and ``budget.max_wall_s`` seconds of wall clock,
written into ``trainer.steps`` / ``trainer.max_wall_s``. ``quick`` holds the tiny settings that
``--quick`` applies on top of everything (fewer steps, a smaller SFT, one seed).

Arms may not change what decides the starting policy (``seed``, ``model.*``, ``env.*``,
``sft.*``) or the budget (``trainer.steps``, ``trainer.max_wall_s``): every arm of one seed must
start from the same SFT model and get the same budget, or the comparison means nothing.

``start_arm`` (e.g. ``sft``) is a row with no RL at all: the starting policy, evaluated exactly
as the trained arms' step-0 evaluation (the runner copies that row, so it costs nothing).

A bad spec fails at load with :class:`SpecError`, naming the file and the field.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from saorl.config import PRESET_DIR, ConfigError, SaorlConfig, absolute_paths, load_config, plain_name

PLOTS = ("accuracy", "reward", "value_loss", "dis_kept_frac", "staleness", "entropy", "switches",
         "mismatch_kl", "explained_var", "first_token_adv", "grad_norm", "matched_preferred")
"""Plot names a spec may ask for (``switches`` also adds recovery columns to the table)."""
LOCKED_PREFIXES = ("seed", "model.", "env.", "sft.", "trainer.steps", "trainer.max_wall_s")
"""Overrides an arm may not give (they change the starting policy or the budget)."""
PACKAGE_ROOT = PRESET_DIR.parent
"""Holds ``configs/`` (the shipped presets): a link to the checkout's ``configs/``, or package data."""
SPEC_DIR = Path("configs") / "experiments"


class SpecError(ValueError):
    """An experiment spec that cannot be used; the message names the file and the field."""


def _positive_marks(v: list[float]) -> list[float]:
    if any(not m > 0 for m in v):
        raise ValueError(f"wall-clock marks must be seconds > 0, got {v}")
    return sorted(v)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class Budget(_Model):
    steps: int = Field(ge=1)
    """Trainer steps per arm × seed."""
    max_wall_s: float | None = Field(None, gt=0)
    """Wall-clock seconds per arm × seed (the run stops at whichever comes first); None = no limit."""


class Quick(_Model):
    overrides: list[str] = Field(default_factory=list)
    """Overrides applied after the base ones with ``--quick`` (small SFT, fewer eval tasks, ...)."""
    budget: Budget | None = None
    """The budget with ``--quick`` (None: the full budget)."""
    seeds: int = Field(1, ge=1)
    """How many of ``seeds`` (the first ones) ``--quick`` runs."""
    arms: list[str] | None = None
    """Arms ``--quick`` runs (None: all)."""
    wall_marks_s: list[float] | None = None
    """``wall_marks_s`` with ``--quick`` (None: the full spec's)."""

    @field_validator("wall_marks_s")
    @classmethod
    def _marks(cls, v: list[float] | None) -> list[float] | None:
        return None if v is None else _positive_marks(v)


class ExperimentSpec(_Model):
    name: str
    """Experiment name: the default output directory is ``runs/experiments/<name>``."""
    description: str = ""
    """What the experiment measures (printed at the top of the report)."""
    base: str | None = None
    """Base run config (YAML), relative to the spec file, the shipped presets (``configs/...``) or
    the working directory; None = the built-in defaults."""
    overrides: list[str] = Field(default_factory=list)
    """Dotted overrides for every arm, on top of ``base``."""
    arms: dict[str, list[str]]
    """Arm name → its own overrides (on top of ``overrides``)."""
    start_arm: str | None = None
    """Name of a row that reports the starting policy (the shared step-0 evaluation), no RL."""
    reference: str | None = None
    """The arm every other arm is compared with in the report (paired per-seed differences with
    confidence intervals); None = the first arm."""
    seeds: list[int] = Field(default_factory=lambda: [0], min_length=1)
    """Seeds; each seed has its own SFT start, shared by all arms of that seed."""
    budget: Budget
    """Trainer steps and wall-clock seconds per arm × seed."""
    quick: Quick = Field(default_factory=Quick)
    """Tiny settings for ``--quick``."""
    verdicts: bool = False
    """Add the report's "Verdicts" section (test accuracy at equal trainer steps and at each of
    ``wall_marks_s``, reward AUC: paired intervals against the reference with results.md's verdict
    rule) and its "Per arm" section (staleness, collapses, rewarded-but-wrong replies):
    :mod:`saorl.experiments.verdicts`."""
    wall_marks_s: list[float] = Field(default_factory=list)
    """Seconds of each run's RL loop at which the "Verdicts" section compares test accuracy (equal
    wall clock: the policy each run had by then)."""
    plots: list[str] = Field(default_factory=lambda: ["accuracy", "reward"])
    """Plots to draw: ``accuracy``, ``reward``, ``value_loss``, ``dis_kept_frac``, ``staleness``,
    ``entropy``, ``switches`` (reward with the env's switch points, plus recovery steps),
    ``mismatch_kl`` (KL(rollout ‖ trainer) at staleness 0 and overall), ``explained_var`` (the
    critic's), ``first_token_adv`` (advantage spread at the first action token), ``grad_norm``,
    ``matched_preferred`` (style_shift: the share of samples in the rewarded style)."""

    @field_validator("name")
    @classmethod
    def _plain(cls, v: str) -> str:
        return plain_name(v)

    @field_validator("arms")
    @classmethod
    def _arms(cls, v: dict[str, list[str]]) -> dict[str, list[str]]:
        if not v:
            raise ValueError("needs at least one arm")
        for arm, overrides in v.items():
            if not arm or "/" in arm or "," in arm:
                raise ValueError(f"arm name {arm!r} must be non-empty, without '/' or ','")
            for o in overrides:
                key = o.partition("=")[0].strip()
                if any(key == p.rstrip(".") or key.startswith(p) for p in LOCKED_PREFIXES):
                    raise ValueError(f"arm {arm!r}: override {o!r} would change the starting policy or "
                                     "the budget; put it in the spec's overrides or budget instead")
        return v

    @field_validator("wall_marks_s")
    @classmethod
    def _marks(cls, v: list[float]) -> list[float]:
        return _positive_marks(v)

    @field_validator("plots")
    @classmethod
    def _plots(cls, v: list[str]) -> list[str]:
        bad = [p for p in v if p not in PLOTS]
        if bad:
            raise ValueError(f"unknown plot(s) {bad}; known: {', '.join(PLOTS)}")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> ExperimentSpec:
        if self.start_arm is not None and self.start_arm in self.arms:
            raise ValueError(f"start_arm {self.start_arm!r} is also a trained arm; give it another name")
        if self.reference is not None and self.reference not in self.arms:
            raise ValueError(f"reference {self.reference!r} is not a trained arm; "
                             f"arms: {', '.join(self.arms)}")
        unknown = [a for a in self.quick.arms or [] if a not in self.arm_names()]
        if unknown:
            raise ValueError(f"quick.arms names unknown arm(s) {unknown}; "
                             f"arms: {', '.join(self.arm_names())}")
        return self

    def wall_marks(self, quick: bool = False) -> list[float]:
        """The wall-clock marks (seconds) the report compares accuracy at; with ``quick``, the quick ones."""
        if quick and self.quick.wall_marks_s is not None:
            return list(self.quick.wall_marks_s)
        return list(self.wall_marks_s)

    def reference_arm(self, selected: list[str] | None = None) -> str:
        """The arm comparisons are made against: ``reference``, or the first (selected) trained arm."""
        trained = [a for a in (selected or list(self.arms)) if a in self.arms]
        if self.reference is not None and self.reference in trained:
            return self.reference
        return trained[0] if trained else next(iter(self.arms))

    def arm_names(self) -> list[str]:
        """Trained arms, then the start arm (if any)."""
        return list(self.arms) + ([self.start_arm] if self.start_arm else [])


def known_experiments() -> list[str]:
    """The names of the experiment specs shipped with saorl."""
    return sorted(p.stem for p in (PACKAGE_ROOT / SPEC_DIR).glob("*.yaml"))


def find_spec(name_or_path: str) -> Path:
    """A spec file: an existing path, else ``configs/experiments/<name>.yaml`` under the working
    directory or among the presets shipped with saorl."""
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return path
    if path.suffix not in (".yaml", ".yml") and "/" not in name_or_path:
        for root in (Path.cwd(), PACKAGE_ROOT):
            candidate = root / SPEC_DIR / f"{name_or_path}.yaml"
            if candidate.is_file():
                return candidate
    known = known_experiments()
    raise SpecError(f"experiment {name_or_path!r}: no such file, and no configs/experiments/"
                    f"{name_or_path}.yaml; known experiments: {', '.join(known) or '(none)'}")


def load_spec(path: str | Path) -> ExperimentSpec:
    """Parse and validate a spec file; :class:`SpecError` naming the file and field on any problem."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise SpecError(f"experiment spec {path}: cannot read: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise SpecError(f"experiment spec {path}: YAML error: {' '.join(str(e).split())}") from None
    if not isinstance(data, dict):
        raise SpecError(f"experiment spec {path}: the top level must be a mapping, got {type(data).__name__}")
    return spec_from_dict(data, str(path))


def spec_from_dict(data: dict[str, Any], source: str = "<dict>") -> ExperimentSpec:
    try:
        return ExperimentSpec.model_validate(data)
    except ValidationError as e:
        reasons = "; ".join(_describe(err) for err in e.errors())
        raise SpecError(f"experiment spec {source}: {reasons}") from None


def _describe(err: dict[str, Any]) -> str:
    where = ".".join(str(x) for x in err["loc"]) or "(top level)"
    if err["type"] == "extra_forbidden":
        return f"{where}: unknown field"
    if err["type"] == "missing":
        return f"{where}: required field missing"
    msg = err["msg"].removeprefix("Value error, ")
    return f"{where}: {msg}" + ("" if err["type"] == "value_error" else f" (got {err.get('input')!r})")


def resolve_base(spec: ExperimentSpec, spec_path: Path | None) -> Path | None:
    """The base config file, looked up next to the spec, among the shipped presets (``configs/...``),
    then in the cwd."""
    if spec.base is None:
        return None
    base = Path(spec.base).expanduser()
    roots = ([spec_path.parent] if spec_path else []) + [PACKAGE_ROOT, Path.cwd()]
    for candidate in ([base] if base.is_absolute() else [r / base for r in roots]):
        if candidate.is_file():
            return candidate
    raise SpecError(f"experiment {spec.name!r}: base config {spec.base!r} not found "
                    f"(looked in {', '.join(str(r) for r in roots)})")


def arm_config(spec: ExperimentSpec, spec_path: Path | None, arm: str, seed: int, *, quick: bool = False,
               extra: list[str] = ()) -> SaorlConfig:
    """The resolved run config of ``arm`` at ``seed``: base ← spec overrides ← arm ← quick ← budget
    ← ``extra`` (command-line overrides, last)."""
    base = resolve_base(spec, spec_path)
    budget = spec.quick.budget if quick and spec.quick.budget else spec.budget
    layers = [*spec.overrides, *spec.arms.get(arm, []), *(spec.quick.overrides if quick else []),
              f"seed={seed}", f"trainer.steps={budget.steps}",
              f"trainer.max_wall_s={'null' if budget.max_wall_s is None else budget.max_wall_s}", *extra]
    try:
        return absolute_paths(load_config(base, layers))  # as train() saves it: same cache keys
    except ConfigError as e:
        raise SpecError(f"experiment {spec.name!r}, arm {arm!r}, seed {seed}: {e}") from None


def selected_seeds(spec: ExperimentSpec, quick: bool, n: int | None) -> list[int]:
    """The first ``n`` seeds (``quick.seeds`` with ``--quick``; more than listed: consecutive ints)."""
    n = n if n is not None else (spec.quick.seeds if quick else len(spec.seeds))
    seeds = list(spec.seeds[:n])
    while len(seeds) < n:
        seeds.append(max(seeds) + 1)
    return seeds


def selected_arms(spec: ExperimentSpec, quick: bool, names: list[str] | None) -> list[str]:
    """Arms to run, in spec order: ``names`` (checked), else ``quick.arms`` with ``--quick``, else all."""
    known = spec.arm_names()
    if names:
        unknown = [a for a in names if a not in known]
        if unknown:
            raise SpecError(f"experiment {spec.name!r}: unknown arm(s) {unknown}; arms: {', '.join(known)}")
        return [a for a in known if a in names]
    if quick and spec.quick.arms:
        return [a for a in known if a in spec.quick.arms or a == spec.start_arm]
    return known
