"""Reward functions of ``prompt_reward``: named ``module.path:function``, one or several (weighted),
each called per completion (saorl's style) or in batches (TRL's ``GRPOTrainer`` style).

Two call styles:

- **per sample**: ``fn(prompt, completion, **row) -> float | None``, the prompt and completion
  positional, the row's other columns by keyword;
- **batched**, TRL's contract: ``fn(prompts=[...], completions=[...], completion_ids=[...],
  **columns) -> list[float | None]``, all by keyword, every column a list. saorl samples one
  completion per prompt and scores it as soon as it is finished, so every list holds one
  element (TRL's lists hold a batch); ``completion_ids`` are the sampled token ids, eos included
  (None where the env was stepped with text only, as ``saorl envs sample`` does). TRL's
  ``trainer_state``, ``log_extra``, ``log_metric`` and ``environments`` are not passed: a function
  that requires one fails when the env is built (give it a default).

Which style (``env.options.reward_call``, ``auto`` by default): a function is batched when its
signature names one of TRL's arguments (``prompts``, ``completions``, ``completion_ids``) or has
no positional parameter at all (only ``**kwargs``: TRL passes everything by keyword); any other
is per sample. ``batched`` / ``per_sample`` override the rule for every function. An ``async
def`` function is run to completion in the env's thread.

Values. Each function gives a finite real number (int, float, bool, a numpy scalar, a 0-d array
or tensor) or None, which means, as in TRL, "this function does not score this completion" (a
math reward on a code row). The reward is TRL's weighted sum, Σ weight_i · value_i over the
functions that scored it (``reward_weights``, default all 1; TRL's ``nansum`` over None as NaN).
Each function's own value goes to ``info["metrics"]["reward/<name>"]``, ``<name>`` the function's
name in its spec (``_2``, ``_3`` for repeats), which a run logs as ``env/reward/<name>``: the mean
over the episodes it scored (TRL's ``rewards/<name>/mean``). Departures from TRL, on purpose: a
completion that no function scores is an error (TRL warns and leaves it out of its advantages;
saorl has no group to leave it out of, and a made-up 0 would be trained on), and so is any other
value — NaN, a string, a list from a per-sample function, a scalar or a list of the wrong length
from a batched one — in one paragraph naming the function, the row and the signature expected.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from saorl.envs.registry import ModuleMissing, import_object

CallStyle = Literal["auto", "batched", "per_sample"]
TRL_ARGS = ("prompts", "completions", "completion_ids")
"""The arguments TRL's ``GRPOTrainer`` passes by name (besides the columns)."""
NOT_PASSED = ("trainer_state", "log_extra", "log_metric", "environments")
"""What TRL passes too and saorl does not."""
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD,
               inspect.Parameter.VAR_POSITIONAL)


class RewardFunctionError(ValueError):
    """A reward function that cannot be used, or that returned something other than a reward."""


def load_reward_fn(spec: str) -> Callable[..., Any]:
    """The callable named by ``"module.path:function"``; RewardFunctionError saying what is wrong."""
    if not isinstance(spec, str) or ":" not in spec:
        raise RewardFunctionError(f"reward_fn must be 'module.path:function' or a list of them, got {spec!r}")
    try:
        fn = import_object(spec, f"reward function {spec!r}")
    except ModuleMissing as e:  # a module found elsewhere than sys.path is no help: only then the hint
        raise RewardFunctionError(f"{e}. Is its directory on PYTHONPATH (for the rollout workers too)? "
                                  "Run from the directory that holds it, or install it") from e
    except ValueError as e:
        raise RewardFunctionError(str(e)) from e
    if not callable(fn):
        raise RewardFunctionError(f"reward function {spec!r} is a {type(fn).__name__}, not callable")
    return fn


def _parameters(fn: Callable[..., Any]) -> Mapping[str, inspect.Parameter] | None:
    try:
        return inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature: per sample
        return None


def is_batched(fn: Callable[..., Any]) -> bool:
    """The ``auto`` rule of the module docstring: TRL's argument names, or keywords only."""
    params = _parameters(fn)
    if params is None:
        return False
    return any(name in params for name in TRL_ARGS) or not any(p.kind in _POSITIONAL for p in params.values())


@dataclass(frozen=True)
class RewardFn:
    """One reward function of a ``prompt_reward`` env, with its weight and call style."""

    spec: str
    name: str
    """Its metric name: ``reward/<name>``."""
    fn: Callable[..., Any]
    weight: float
    batched: bool

    @property
    def arguments(self) -> tuple[str, ...]:
        """The names the call passes besides the row's columns (a column of one of them clashes)."""
        return TRL_ARGS if self.batched else ("prompt", "completion")

    @property
    def required_columns(self) -> tuple[str, ...]:
        """The row's columns its signature cannot do without: per sample, the parameters after the
        first two (prompt, completion) and the keyword-only ones, with no default; batched, those
        with no default besides TRL's arguments. Empty where the signature cannot be read."""
        params = _parameters(self.fn)
        if params is None:
            return ()
        passed = set(TRL_ARGS) if self.batched else set()
        positional = 0 if self.batched else 2  # prompt and completion take the first two
        out = []
        for p in params.values():
            if positional and p.kind in (inspect.Parameter.POSITIONAL_ONLY,
                                         inspect.Parameter.POSITIONAL_OR_KEYWORD):
                positional -= 1
                continue
            if p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD,
                          inspect.Parameter.POSITIONAL_ONLY):
                continue
            if p.default is inspect.Parameter.empty and p.name not in passed:
                out.append(p.name)
        return tuple(out)

    def missing_columns(self, row: Mapping[str, Any]) -> list[str]:
        """The :attr:`required_columns` that ``row`` lacks."""
        return [c for c in self.required_columns if c not in row]

    @property
    def signature(self) -> str:
        if self.batched:
            return (f"{self.spec}(prompts=[...], completions=[...], completion_ids=[...], **columns) "
                    "-> list of one float or None per completion")
        return f"{self.spec}(prompt, completion, **row) -> float or None"

    def score(self, prompt: Any, completion: Any, completion_ids: list[int] | None,
              row: dict[str, Any], where: str) -> float | None:
        """This function's value for one completion (None: it does not score it); ``where`` names
        the task and row in errors."""
        where = f"reward function {self.spec!r} on {where}"
        if self.batched:
            args: tuple[Any, ...] = ()
            kwargs = {"prompts": [prompt], "completions": [completion], "completion_ids": [completion_ids],
                      **{k: [v] for k, v in row.items()}}
        else:
            args, kwargs = (prompt, completion), row
        try:
            value = self.fn(*args, **kwargs)
            if inspect.iscoroutine(value):
                value = asyncio.run(value)
        except Exception as e:
            raise RewardFunctionError(f"{where} raised {type(e).__name__}: {e}") from e
        return self._check(value, where)

    def _check(self, value: Any, where: str) -> float | None:
        expected = "a list of one finite number or None" if self.batched else "a finite number or None"
        item = value
        if self.batched:
            if isinstance(value, (str, bytes, Mapping)) or not _is_sequence(value):
                self._wrong(value, where, expected)
            if len(value) != 1:
                self._wrong(value, where, f"{expected} (it got one completion, and returned {len(value)} "
                                          "values)")
            item = value[0]
        elif _is_sequence(value) and not isinstance(value, (str, bytes)):
            self._wrong(value, where, "one finite number or None, not a list")
        if item is None:
            return None
        if getattr(item, "shape", None) == () and hasattr(item, "item"):  # a 0-d array or tensor
            item = item.item()
        if not isinstance(item, numbers.Real):  # bools count as 0 / 1
            self._wrong(value, where, expected)
        try:
            number = float(item)
        except OverflowError:  # an int past float's range (10**400)
            self._wrong(value, where, f"{expected} (it is past a float's range)")
        if not math.isfinite(number):
            self._wrong(value, where, expected)
        return number

    def _wrong(self, value: Any, where: str, expected: str) -> None:
        if self.batched:
            how = (f"It is called TRL-style, as {self.signature}, with lists of one completion (saorl scores "
                   "each completion as it finishes)")
            other = ("A function that scores one completion, f(prompt, completion, **row) -> float, is "
                     "called that way when it names none of TRL's arguments (prompts, completions, "
                     "completion_ids), or with env.options.reward_call=per_sample")
        else:
            how = f"It is called once per completion, as {self.signature}"
            other = ("A TRL-style function, f(prompts, completions, **kwargs) -> list[float], is called with "
                     "lists when it names one of TRL's arguments (prompts, completions, completion_ids) or "
                     "takes only **kwargs, or with env.options.reward_call=batched")
        raise RewardFunctionError(f"{where} returned {value!r:.120} ({type(value).__name__}). {how}, so it "
                                  f"must return {expected}. {other}")


def _is_sequence(value: Any) -> bool:
    if isinstance(value, Sequence):
        return True
    shape = getattr(value, "shape", None)  # a numpy array or a torch tensor of one or more dimensions
    return shape is not None and len(shape) >= 1 and hasattr(value, "__len__")


def load_reward_fns(specs: str | Sequence[str], weights: Sequence[float] | None = None,
                    call: CallStyle = "auto") -> list[RewardFn]:
    """The reward functions of ``env.options.reward_fn`` (one spec or a list), weighted by
    ``reward_weights`` (None: all 1), each called in the style ``call`` gives (see the module
    docstring); RewardFunctionError naming the option and what is wrong."""
    spec_list = [specs] if isinstance(specs, str) else specs
    if not isinstance(spec_list, Sequence) or not spec_list:
        raise RewardFunctionError(f"reward_fn must be 'module.path:function' or a non-empty list of them, "
                                  f"got {specs!r}")
    if call not in ("auto", "batched", "per_sample"):
        raise RewardFunctionError(f"reward_call must be auto, batched or per_sample, got {call!r}")
    n = len(spec_list)
    weights = [1.0] * n if weights is None else weights
    if (isinstance(weights, (str, bytes)) or not isinstance(weights, Sequence) or len(weights) != n
            or not all(isinstance(w, numbers.Real) and not isinstance(w, bool) and math.isfinite(w)
                       for w in weights)):
        raise RewardFunctionError(f"reward_weights must be a list of {n} finite numbers, one per reward "
                                  f"function of reward_fn, got {weights!r}")
    out: list[RewardFn] = []
    for spec, weight in zip(spec_list, weights):
        fn = load_reward_fn(spec)
        batched = is_batched(fn) if call == "auto" else call == "batched"
        name = spec.partition(":")[2]
        repeats = sum(f.spec.partition(":")[2] == name for f in out)
        out.append(RewardFn(spec, f"{name}_{repeats + 1}" if repeats else name, fn, float(weight), batched))
        _check_arguments(out[-1])
    return out


def _check_arguments(rf: RewardFn) -> None:
    params = _parameters(rf.fn) or {}
    required = [n for n, p in params.items() if n in NOT_PASSED and p.default is inspect.Parameter.empty
                and p.kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)]
    if required:
        raise RewardFunctionError(
            f"reward function {rf.spec!r} requires {', '.join(required)}, which TRL passes and saorl does "
            f"not (saorl passes prompts, completions, completion_ids and the row's columns); give "
            f"{'it' if len(required) == 1 else 'them'} a default (e.g. {required[0]}=None)")


def total_reward(fns: Sequence[RewardFn], values: Sequence[float | None], where: str) -> float:
    """Σ weight · value over the functions that scored (TRL's weighted sum); an error when none did."""
    scored = [(f, v) for f, v in zip(fns, values) if v is not None]
    if not scored:
        if len(fns) == 1:
            raise RewardFunctionError(
                f"reward function {fns[0].spec!r} on {where} returned None, which means it does not score "
                "this completion, and there is no other reward function to score it; it must return a "
                "finite number (TRL warns and leaves such a completion out; saorl would have to invent a 0)")
        raise RewardFunctionError(
            f"no reward function scored {where}: {', '.join(repr(f.spec) for f in fns)} all returned None. "
            "TRL warns and leaves such a completion out; saorl stops, since it would have to train on a "
            "made-up 0. Make at least one of them return a number for every row, or drop the rows none of "
            "them applies to")
    return float(sum(f.weight * v for f, v in scored))
