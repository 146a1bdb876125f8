"""``noisy_lookup``: k tool calls named in the prompt, each answered with a long, noisy observation.

An episode (k = 2 here)::

    prompt   Look up, in order:\\nkiwi\\nfig\\n
    action   <tool>kiwi</tool>
    observe  <out>ok hit row tmp ... kiwi=417 ... sync ack ok</out>\\n      tens of noise tokens
    action   <tool>fig</tool>
    observe  <out>... fig=902 ...</out>\\n
    action   <answer>417 902</answer>                                      reward = codes right / k

Why it exists. Skip-observation GAE runs its recursion over action tokens only; plain token GAE
(the ablation, ``algo.skip_observation=false``) runs it over every response token, observations
included, so with γ = 1 and λ < 1 the credit reaching an early action decays by λ per
*observation* token as well. On ``math_tool`` the observations are a handful of tokens and the two
differ only by about λ^10; here every call adds ``noise_words`` words of filler around the one
line that matters, and the number of calls k is long-tailed across tasks, so the first action's
advantage under plain GAE is scaled by roughly λ^(k · observation length) — by design very
different from skip-observation GAE, and more so on the long tasks.

- The prompt lists the names one per line, so each name starts a word with no space before it,
  as it does in ``<tool>name</tool>``: a byte-level BPE then spells it with the same tokens in
  both places (in a space-separated list it would not: ``" cider"`` is ``Ġc id er`` but
  ``cider`` after ``>`` is ``c id er``, and 14 of the 39 names split differently), so a call is
  a plain copy of prompt tokens.
- k is drawn per task from a lognormal with mean ``mean_calls`` and coefficient of variation
  ``cv``, rounded and clipped to ``[1, max_calls]`` (:func:`saorl.envs.synthetic.draw_turns`); the
  k names are distinct words, each with a 3-digit code private to the task, so it must be looked
  up: the codes appear nowhere but in the observations.
- ``<tool>name</tool>`` returns ``<out>NOISE name=CODE NOISE</out>``: ``noise_words`` filler
  words (log-like tokens and, unless ``hex_ids=False``, 4-character hex ids, whose digits look
  like a code's), split at a random point, deterministic in the task and the call
  (so a replayed episode sees the same text). A name that is not in the prompt gets
  ``<out>error: unknown name 'x'</out>``; a malformed action gets ``<out>error: ...</out>``. Both
  cost a turn.
- ``<answer>c1 c2 ... ck</answer>`` (codes in the prompt's order, separated by spaces) ends the
  episode with reward = (positions right) / max(k, codes given), in [0, 1];
  ``info["success"]`` when every code is right and no extra is given.
- ``grade="calls"`` grades the lookups instead of the codes: an answer still ends the episode
  and must be 3-digit codes separated by spaces (else reward 0), but the reward is
  (calls that name the prompt's name at their position) / max(k, calls made), and success is
  every name looked up once, in order. The structure the GAE variants differ on is unchanged
  (the graded decisions are early, and long noisy observations follow each), but no code has to
  be copied out of an observation — which the 1.9 M-parameter policy of ``saorl experiment
  noisy_obs`` never learned from demonstrations (docs/results.md).
- An episode may use ``k + extra_turns`` turns (the k calls, the answer, ``extra_turns − 1``
  mistakes); past that it ends with reward 0. ``max_turns`` (the agent loop's cap) is
  ``max_calls + extra_turns``.

Demonstrations call every name in order and answer; with probability ``demo_error_rate`` one of
the copied codes has a typo (a failing demonstration, so SFT leaves headroom for RL). Train and
test tasks are split by a hash of their content (names and codes), so none is in both splits.
Mind the token budget: an episode of k calls holds about k × (observation + action) tokens, so
raise ``rollout.max_total_tokens`` with ``noise_words`` and ``max_calls`` (``saorl envs sample
noisy_lookup`` prints the counts).
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from typing import Any, ClassVar

from saorl.envs.base import Env, Progress, Split, StepResult, Task
from saorl.envs.splits import content_hash, distinct_tasks
from saorl.envs.synthetic import draw_turns
from saorl.envs.tags import parse_action

TEST_FRACTION = 0.2
NAMES = tuple(sorted(set(
    "kiwi fig plum pear lime date yam oat rye corn bean pea leek kale nut lemon apple mango peach "
    "grape melon berry olive onion basil mint sage thyme cumin chili rice wheat salt honey cocoa "
    "tea coffee cider juice".split()
)))
NOISE = tuple("ok ack hit miss row tmp log req sync tick poll ping idle busy scan load seek flush "
              "open read lock wait done next skip page heap".split())
_HEX = "0123456789abcdef"
_CODES = re.compile(r"\d{3}(?: \d{3})*")
GRADES = ("codes", "calls")


def noise_text(seed: str, n_words: int, hex_ids: bool = True) -> list[str]:
    """``n_words`` filler words, deterministic in ``seed``: log words, and now and then a hex id
    (never with ``hex_ids=False``: then the code is the only digits in an observation)."""
    rng = random.Random(seed)
    if not hex_ids:
        return [rng.choice(NOISE) for _ in range(n_words)]
    return [rng.choice(NOISE) if rng.random() < 0.8 else "".join(rng.choice(_HEX) for _ in range(4))
            for _ in range(n_words)]


class NoisyLookupEnv(Env):
    name: ClassVar[str] = "noisy_lookup"
    version: ClassVar[int] = 2  # 2: the prompt lists one name per line (1: "Look up: kiwi fig.")
    stop_strings: ClassVar[tuple[str, ...]] = ("</tool>", "</answer>")

    def __init__(self, mean_calls: float = 3.0, cv: float = 1.0, max_calls: int = 8, noise_words: int = 16,
                 extra_turns: int = 1, demo_error_rate: float = 0.3, hex_ids: bool = True,
                 grade: str = "codes", **options: Any) -> None:
        """Options: ``mean_calls`` (>= 1), ``cv`` (>= 0), ``max_calls`` (1..len(NAMES)),
        ``noise_words`` (filler words per observation, >= 0), ``extra_turns`` (turns past the k
        calls, >= 1: the answer plus mistakes), ``demo_error_rate`` (in [0, 1]), ``hex_ids``
        (bool: hex ids among the filler words), ``grade`` (``"codes"``: the answer's codes;
        ``"calls"``: the lookups, see the module docstring)."""
        super().__init__(**options)
        if not (isinstance(mean_calls, (int, float)) and mean_calls >= 1):
            raise ValueError(f"mean_calls must be a number >= 1, got {mean_calls!r}")
        if not (isinstance(cv, (int, float)) and cv >= 0):
            raise ValueError(f"cv must be a number >= 0, got {cv!r}")
        if not (isinstance(max_calls, int) and 1 <= max_calls <= len(NAMES)):
            raise ValueError(f"max_calls must be an int in [1, {len(NAMES)}], got {max_calls!r}")
        if not (isinstance(noise_words, int) and noise_words >= 0):
            raise ValueError(f"noise_words must be an int >= 0, got {noise_words!r}")
        if not (isinstance(extra_turns, int) and extra_turns >= 1):
            raise ValueError(f"extra_turns must be an int >= 1, got {extra_turns!r}")
        if not 0.0 <= demo_error_rate <= 1.0:
            raise ValueError(f"demo_error_rate must be in [0, 1], got {demo_error_rate!r}")
        if not isinstance(hex_ids, bool):
            raise ValueError(f"hex_ids must be true or false, got {hex_ids!r}")
        if grade not in GRADES:
            raise ValueError(f"grade must be one of {', '.join(GRADES)}, got {grade!r}")
        self.mean_calls, self.cv, self.max_calls = float(mean_calls), float(cv), max_calls
        self.noise_words, self.extra_turns, self.demo_error_rate = noise_words, extra_turns, demo_error_rate
        self.hex_ids, self.grade = hex_ids, grade
        self.max_turns = max_calls + extra_turns
        self._task: Task | None = None
        self._turn = 0
        self._called: list[str] = []  # every looked-up name, in order (unknown ones included)

    # ---------------------------------------------------------------- tasks

    def generate_tasks(self, split: Split, n: int, seed: int) -> list[Task]:
        """``n`` distinct tasks whose content hashes into ``split`` (20% of contents are test)."""

        def draw(rng: random.Random) -> tuple[str, Callable[[str], Task]]:
            k = draw_turns(rng, self.mean_calls, self.cv, self.max_calls)
            names = rng.sample(NAMES, k)
            codes = [rng.randint(100, 999) for _ in names]
            return content_hash("noisy_lookup", *names, *codes), lambda digest: Task(
                f"noisy_lookup/k{k}/{digest[:16]}", {"names": names, "codes": codes})

        rng = random.Random(f"noisy_lookup/{split}/{self.mean_calls}/{self.cv}/{self.max_calls}/{seed}")
        return distinct_tasks(split, n, rng, draw, TEST_FRACTION, "tasks")

    # ---------------------------------------------------------------- episode

    def reset(self, task: Task, progress: Progress | None = None) -> str:
        names, codes = task.data.get("names"), task.data.get("codes")
        if not (isinstance(names, list) and isinstance(codes, list) and names and len(names) == len(codes)):
            raise ValueError(f"task {task.id!r} is not a noisy_lookup task (needs lists 'names' and "
                             "'codes' of one non-zero length)")
        self._task, self._turn, self._called = task, 0, []
        return "Look up, in order:\n" + "".join(f"{name}\n" for name in names)

    def step(self, action: str) -> StepResult:
        if self._task is None:
            raise RuntimeError("NoisyLookupEnv.step called before reset (or after the episode ended)")
        self._turn += 1
        names = self._task.data["names"]
        limit = len(names) + self.extra_turns
        parsed = parse_action(action, ("tool", "answer"))
        if parsed.tag == "answer":
            return self._finish(parsed.body)
        if self._turn >= limit:
            return self._end(0.0, False, f"out of turns ({limit})")
        if parsed.tag == "tool":
            return StepResult(self._lookup(parsed.body.strip()), 0.0, False, {"calls": len(self._called)})
        return StepResult(f"<out>error: {parsed.error}</out>\n", 0.0, False,
                          {"calls": len(self._called), "error": parsed.error})

    def _lookup(self, name: str) -> str:
        assert self._task is not None
        self._called.append(name)
        call = len(self._called)
        names, codes = self._task.data["names"], self._task.data["codes"]
        if name not in names:
            return f"<out>error: unknown name {name[:20]!r}</out>\n"
        words = noise_text(f"{self._task.id}/{call}", self.noise_words, self.hex_ids)
        cut = random.Random(f"{self._task.id}/{call}/cut").randint(0, len(words))
        line = [*words[:cut], f"{name}={codes[names.index(name)]}", *words[cut:]]
        return f"<out>{' '.join(line)}</out>\n"

    def _finish(self, body: str) -> StepResult:
        assert self._task is not None
        text = body.strip()
        if not _CODES.fullmatch(text):
            return self._end(0.0, False, "answer is not 3-digit codes separated by spaces")
        if self.grade == "calls":
            given, wanted, what = self._called, self._task.data["names"], "lookups in order"
        else:
            given, wanted, what = [int(c) for c in text.split()], self._task.data["codes"], "codes right"
        right = sum(a == b for a, b in zip(given, wanted))
        ok = right == len(wanted) == len(given)
        return self._end(right / max(len(wanted), len(given)), ok,
                         None if ok else f"{right}/{len(wanted)} {what}")

    def _end(self, reward: float, success: bool, reason: str | None) -> StepResult:
        info = {"success": success, "turns": self._turn, "calls": len(self._called), "error": reason}
        self._task = None
        return StepResult("", reward, True, info)

    # ---------------------------------------------------------------- demonstrations

    def demonstration(self, task: Task, rng: random.Random) -> list[str]:
        """Call every name in the prompt's order, then answer the codes; with probability
        ``demo_error_rate`` one copied code has a typo (reward (k − 1) / k, no success)."""
        names, codes = task.data["names"], [str(c) for c in task.data["codes"]]
        if rng.random() < self.demo_error_rate:
            i = rng.randrange(len(codes))
            digit = rng.randrange(3)
            options = [c for c in ("123456789" if digit == 0 else "0123456789") if c != codes[i][digit]]
            codes[i] = codes[i][:digit] + rng.choice(options) + codes[i][digit + 1:]
        return [f"<tool>{n}</tool>" for n in names] + [f"<answer>{' '.join(codes)}</answer>"]
