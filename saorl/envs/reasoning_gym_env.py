"""``reasoning_gym``: any reasoning-gym generator by name, scored by the dataset's own ``score_answer``.

reasoning-gym (the ``envs`` extra) makes procedural problems from seeds: ``env.options.dataset``
names a generator (``basic_arithmetic``, ``countdown``, ``gsm_symbolic``, ``maze``, ``sokoban``, …)
and ``env.options.config`` is passed to it as its config (``{min_terms: 2, max_terms: 2}``); its
``seed`` and ``size`` come from the run, so they are refused there.

**Tasks and splits.** Entry ``i`` of the dataset made with the run's seed is the problem the
generator makes from seed ``seed + i`` (reasoning-gym's own convention). A candidate's content
(question and answer) hashes into the train or the test split (:mod:`saorl.envs.splits`), so the
splits are disjoint by content, whatever the seeds and sizes: a problem the generator happens to
make twice never lands in both. Generating costs what the generator costs (measured on this
machine: basic_arithmetic 0.03 ms, gsm_symbolic 1.5 ms, countdown 42 ms, sokoban 250 ms a problem,
about two candidates per task): lower ``env.num_train_tasks`` for a slow one.

**Prompt and answer.** reasoning-gym's convention (``reasoning_gym.utils.SYSTEM_PROMPTS`` and
``extract_answer``): a system prompt asks for the final answer inside ``<answer>…</answer>``, the
question as the dataset words it (its own format instructions included) is the user's message,
and the text of the last ``<answer>`` tag is what ``score_answer`` scores (no tag: None, which
scores 0). The default system prompt is reasoning-gym's ``default``; ``system_prompt`` names
another of its prompts (``DeepSeekZero``, ``simple``, ``direct``, ``chain_of_draft``) or is null
for none. ``prompt: chat`` (default) gives it as a system message and the question as the user's
message (needs a chat template); ``prompt: text`` puts both into one text prompt (for a tokenizer
without a template, the tiny models). One turn: the completion ends at ``</answer>``. The reward is
the dataset's score (0 to 1; some datasets give partial credit); ``info["success"]`` is score ≥
``success_threshold`` (1.0). The demonstration (for an SFT warm start) is the oracle answer in its
tags, no reasoning.

**A reward that can be gamed.** reasoning-gym's default scorer (``ProceduralDataset.score_answer``,
kept by ``basic_arithmetic`` and many others) gives an answer that *contains* the oracle answer
partial credit, ``len(oracle) / len(answer)``: ``<answer>17</answer>`` earns 0.5 for 7, and an
answer listing every digit earns 0.1 for any one-digit result. Metric ``rewarded_wrong`` (logged
``env/rewarded_wrong``, ``eval/env/rewarded_wrong``) is 1 for a reply rewarded (score > 0) but not
a success: the share of rewarded-but-wrong replies.

**Hostile answers.** Some of reasoning-gym's scorers evaluate the answer as Python
(``spiral_matrix``, ``string_insertion``, ``binary_matrix``, ``n_queens`` call ``eval``) or as a
sympy expression (``countdown``, ``puzzle24``, the integration and polynomial datasets:
``parse_expr``, which evals too). The model's text
is hostile input, so :func:`refusal` screens every answer before any scorer sees it (refused: score
0, ``info["refused"]`` says why, metric ``answers_refused``), and those four modules' ``eval`` is
replaced by ``ast.literal_eval`` (Python literals only) when the env is made.
"""

from __future__ import annotations

import ast
import difflib
import functools
import importlib
import json
import random
import re
from typing import Any, ClassVar, Literal

from saorl.envs.base import Env, Progress, Prompt, Split, StepResult, Task
from saorl.envs.splits import content_hash, distinct_tasks

TEST_FRACTION = 0.5
"""The share of all problem contents that belongs to the test split."""


MAX_ANSWER_CHARS = 2000
_FORBIDDEN = re.compile(
    r"__|(?<![\d.])\d{16,}(?![\d.eE])|\b(import|lambda|exec|eval|compile|open|getattr|setattr|delattr|globals|locals|"
    r"vars|breakpoint|input|exit|quit|help|memoryview|bytearray|bytes|dir|type|object|class)\b")
_SMALL_EXPONENT = re.compile(r"\s*(\(\s*-?\d{1,2}(\s*/\s*\d{1,2})?\s*\)|-?\d{1,2}(\.\d{1,3})?(?![\d.])"
                             r"|[A-Za-z]\w*(?!\w|\s*\())(?!\s*\*\*)")
_EVAL_SCORERS = ("algorithmic.spiral_matrix", "algorithmic.string_insertion", "algorithmic.binary_matrix",
                 "games.n_queens")
"""reasoning-gym modules whose ``score_answer`` calls ``eval`` on the answer (0.1.25)."""
_SYMPY_SCORERS = frozenset({"countdown", "puzzle24", "simple_integration", "intermediate_integration",
                            "polynomial_multiplication"})
"""Datasets whose ``score_answer`` gives the answer to sympy's ``parse_expr`` (which evals it)."""
_SYMPY_CALLS = frozenset({"sin", "cos", "tan", "cot", "sec", "csc", "asin", "acos", "atan", "sinh", "cosh",
                          "tanh", "exp", "log", "ln", "sqrt", "Abs", "abs"})


_EVALUATING = _SYMPY_SCORERS | {name.rpartition(".")[2] for name in _EVAL_SCORERS}


def _bad_power(answer: str) -> bool:
    """A ``**`` whose exponent is not a small number or a name, that chains, or whose base is a
    bracketed group holding a ``**`` itself (``((9**99)**99)**99`` would not end)."""
    for found in re.finditer(r"\*\*", answer):
        if not _SMALL_EXPONENT.match(answer, found.end()):
            return True
        i = found.start() - 1
        while i >= 0 and answer[i].isspace():
            i -= 1
        if i >= 0 and answer[i] in ")]":
            depth, j = 0, i
            while j >= 0:
                depth += answer[j] in ")]"
                depth -= answer[j] in "(["
                if depth == 0:
                    break
                j -= 1
            if "**" in answer[max(j, 0):i]:
                return True
    return False


def refusal(answer: str | None, dataset: str = "") -> str | None:
    """Why ``answer`` must not reach ``dataset``'s scorer (some evaluate it), or None when it may."""
    if answer is None:
        return None
    if len(answer) > MAX_ANSWER_CHARS and dataset in _EVALUATING:  # others may be long (tower_of_hanoi)
        return f"the answer is longer than {MAX_ANSWER_CHARS} characters"
    found = _FORBIDDEN.search(answer)
    if found:
        what = "a number of more than 15 digits" if found.group(0)[0].isdigit() else repr(found.group(0))
        return f"the answer contains {what}, which saorl refuses (some scorers evaluate answers)"
    if _bad_power(answer):
        return "the answer raises to a power other than a small number or a name"
    if dataset in _SYMPY_SCORERS:
        if not re.fullmatch(r"[\w\s+\-*/().^=]*", answer):
            return "the answer holds a character other than letters, digits and + - * / ( ) . ^ ="
        if any(name not in _SYMPY_CALLS for name in re.findall(r"([A-Za-z_]\w*)\s*\(", answer)):
            return f"the answer calls a function other than {', '.join(sorted(_SYMPY_CALLS))}"
    return None


@functools.cache
def _shadow_eval() -> None:
    """Replace ``eval`` by ``ast.literal_eval`` in the scorer modules that eval answers."""
    for name in _EVAL_SCORERS:
        try:
            module = importlib.import_module(f"reasoning_gym.{name}")
        except ImportError:
            continue
        module.eval = ast.literal_eval  # type: ignore[attr-defined]


def dataset_names() -> list[str]:
    """The generators reasoning-gym registers, sorted."""
    import reasoning_gym  # noqa: F401  (registers the datasets)
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


@functools.lru_cache(maxsize=16)
def _dataset(name: str, config_json: str, seed: int) -> Any:
    import reasoning_gym

    return reasoning_gym.create_dataset(name, seed=seed, size=2**31 - 1 - seed, **json.loads(config_json))


@functools.lru_cache(maxsize=4096)
def _entry(name: str, config_json: str, seed: int, index: int) -> dict[str, Any]:
    return _dataset(name, config_json, seed)[index]


class ReasoningGymEnv(Env):
    name: ClassVar[str] = "reasoning_gym"
    stop_strings: ClassVar[tuple[str, ...]] = ("</answer>",)
    requires: ClassVar[tuple[str, ...]] = ("reasoning_gym",)

    def __init__(self, dataset: str | None = None, config: dict[str, Any] | None = None,
                 system_prompt: str | None = "default", prompt: Literal["chat", "text"] = "chat",
                 success_threshold: float = 1.0, **options: Any) -> None:
        """Options: ``dataset`` (required: a reasoning-gym generator's name), ``config`` (its
        config, a mapping; not ``seed`` or ``size``), ``system_prompt`` (a name of reasoning-gym's
        ``SYSTEM_PROMPTS``, default ``default``; null: none), ``prompt`` (``chat``: system + user
        messages; ``text``: one text prompt), ``success_threshold`` (1.0)."""
        super().__init__(**options)
        _shadow_eval()
        names = dataset_names()
        if not isinstance(dataset, str) or dataset not in names:
            close = difflib.get_close_matches(str(dataset), names, n=3)
            hint = f"did you mean {' or '.join(map(repr, close))}? " if close else ""
            raise ValueError(f"dataset {dataset!r} is not a reasoning-gym generator; {hint}set "
                             f"env.options.dataset to one of its {len(names)} generators "
                             f"({', '.join(names[:8])}, …: python -c \"import reasoning_gym.factory as f; "
                             "print(sorted(f.DATASETS))\" lists them)")
        config = dict(config or {})
        taken = sorted(k for k in ("seed", "size") if k in config)
        if taken:
            raise ValueError(f"config.{taken[0]}: the tasks' seeds and number come from the run (seed, "
                             "env.num_train_tasks, env.num_test_tasks); remove it from env.options.config")
        self.dataset, self.config_json = dataset, json.dumps(config, sort_keys=True)
        try:
            _dataset(dataset, self.config_json, 0)
        except (TypeError, ValueError, AssertionError) as e:
            raise ValueError(f"config {config} is not a config of {dataset!r}: "
                             f"{type(e).__name__}: {e}") from None
        from reasoning_gym.utils import SYSTEM_PROMPTS

        if system_prompt is not None and system_prompt not in SYSTEM_PROMPTS:
            raise ValueError(f"system_prompt {system_prompt!r} is not one of reasoning-gym's "
                             f"{sorted(SYSTEM_PROMPTS)} (or null for none)")
        if prompt not in ("chat", "text"):
            raise ValueError(f"prompt must be 'chat' or 'text', got {prompt!r}")
        self.system = None if system_prompt is None else SYSTEM_PROMPTS[system_prompt]
        self.prompt_style, self.success_threshold = prompt, float(success_threshold)
        self.max_turns = 1
        self._task: Task | None = None

    def generate_tasks(self, split: Split, n: int, seed: int) -> list[Task]:
        counter = iter(range(2**31 - 1 - seed))

        def draw(rng: random.Random):
            index = next(counter)
            entry = _entry(self.dataset, self.config_json, seed, index)
            digest = content_hash(self.dataset, entry["question"], entry["answer"])

            def make(d: str) -> Task:
                return Task(f"{self.dataset}-{d[:16]}", {"seed": seed, "index": index,
                                                          "question": entry["question"],
                                                          "answer": str(entry["answer"])})
            return digest, make

        return distinct_tasks(split, n, random.Random(seed), draw, TEST_FRACTION,
                              f"{self.dataset} problems (config {self.config_json})")

    def entry(self, task: Task) -> dict[str, Any]:
        """The dataset's own entry of ``task`` (made again from its seed and index), for its scorer."""
        try:
            seed, index = int(task.data["seed"]), int(task.data["index"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"task {task.id!r} is not a reasoning_gym task (it needs its seed and "
                             f"index; keys: {sorted(task.data)})") from None
        entry = _entry(self.dataset, self.config_json, seed, index)
        if entry["question"] != task.data.get("question"):
            raise ValueError(f"task {task.id!r} was not made by {self.dataset!r} with config "
                             f"{self.config_json} (its question differs): were env.options changed?")
        return entry

    def reset(self, task: Task, progress: Progress | None = None) -> Prompt:
        self.entry(task)
        self._task = task
        question = task.data["question"]
        if self.system is None:
            return question if self.prompt_style == "text" else [{"role": "user", "content": question}]
        if self.prompt_style == "text":
            return f"{self.system}\n{question}"
        return [{"role": "system", "content": self.system}, {"role": "user", "content": question}]

    def step(self, action: str) -> StepResult:
        if self._task is None:
            raise RuntimeError("ReasoningGymEnv.step called before reset (or after the episode ended)")
        from reasoning_gym.utils import extract_answer

        task, self._task = self._task, None
        entry = self.entry(task)
        answer = extract_answer(action)
        refused = refusal(answer, self.dataset)
        if refused is not None:
            return StepResult(f"Refused: {refused}.", 0.0, True, {
                "success": False, "refused": refused,
                "metrics": {"answered": 1.0, "answers_refused": 1.0, "rewarded_wrong": 0.0}})
        scorer = _dataset(self.dataset, self.config_json, int(task.data["seed"]))
        score = float(scorer.score_answer(answer, entry))
        success = score >= self.success_threshold
        return StepResult("", score, True, {"success": success, "metrics": {
            "answered": float(answer is not None), "answers_refused": 0.0,
            "rewarded_wrong": float(score > 0 and not success)}})

    def demonstration(self, task: Task, rng: random.Random) -> list[str]:
        return [f"<answer>{task.data['answer']}</answer>"]
