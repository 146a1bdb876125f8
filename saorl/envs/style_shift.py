"""``style_shift``: online learning, where the rewarded writing style switches during training.

An episode is one turn: the prompt asks for one line about a topic (``Write a line about the
moon.\\n``) and the action is that line, ended by a newline (the stop string). The reward scores
the line for the *currently preferred* style among ``sweet``, ``youthful`` and ``classical``.
The preferred style is never in the prompt: it comes from the :class:`Progress` passed to
``reset`` and cycles through ``schedule`` every ``switch_every`` trainer steps (or episodes), so a
policy must notice the reward moving and re-adapt. Plots mark :meth:`StyleShiftEnv.switch_points`.

Reward (in [0, 1]) = quality gate × topic factor × style score (the *score*), times the topic's
scale when ``topic_scale`` is set (below):

- quality gate (0 or 1): 4..24 words and at most 160 characters, mostly letters, no content word
  more than twice, at least 60% distinct words, at most 5 ``!``; else 0 (empty, spam, too long);
- topic factor: 1 if the topic word appears, else 0.4 (so off-topic text never reaches 0.5);
  a bag of words with fewer than two function words (``the``, ``is``, ...) is halved as well;
- style score: 0.75 × min(distinct lexicon words, 2) / 2 + 0.25 × a style feature (youthful:
  1-3 ``!``; sweet: addresses someone with you/my/our, no ``!``; classical: no ``!``, no
  you/your, ends with ``.``), minus 0.25 per distinct word of the other styles' lexicons (max 2),
  clipped to [0, 1].

``info["success"]`` is ``score >= 0.5`` (the score above, before any topic scale): on topic, well
formed, and clearly in the preferred style (at least one lexicon word plus the feature, or two
lexicon words).

Prompt-dependent reward scale (option ``topic_scale: [lo, hi]``, off by default). The reward is
then ``scale(topic) × score``, with the 40 topics' scales spread evenly over ``[lo, hi]`` in an
order fixed by a hash of the topic. The reward level now depends on the prompt, so a baseline
that ignores the prompt (a global running mean) is a poor one, while a critic can learn it.

What the sample matched. Every episode's ``info`` says which style the line is clearly in —
``matched_style``: the one style scoring ``>= 0.5``, or ``"none"`` (none does, or two tie at 0.5)
— and carries the same as numbers in ``info["metrics"]`` (``matched_sweet``,
``matched_youthful``, ``matched_classical``: 1 or 0, and ``matched_preferred``: 1 if it is the
preferred style), which a run logs per step as ``env/matched_*``: right after a switch,
``env/matched_<new style>`` is the rate at which the policy already samples the newly rewarded
style.
"""

from __future__ import annotations

import random
import re
from collections import Counter
from collections.abc import Sequence
from typing import Any, ClassVar

from saorl.envs.base import Env, Progress, Split, StepResult, Task
from saorl.envs.splits import content_hash, split_of


def _wordset(text: str) -> frozenset[str]:
    return frozenset(text.split())


STYLES = ("sweet", "youthful", "classical")
LEXICONS: dict[str, frozenset[str]] = {
    "sweet": _wordset("sweet love lovely dear darling gentle soft warm heart honey tender kind hug "
                      "smile cozy sugar cuddle adore"),
    "youthful": _wordset("cool awesome wow hey super totally vibes vibe epic lit omg yay fun crazy "
                         "dude literally yo lol"),
    "classical": _wordset("thee thou thy thine doth hath art ere yon whence thus behold shalt "
                          "wherefore nay o oft tis"),
}
FUNCTION_WORDS = _wordset("the a an is of to and in on it my your our you i we so with at for this "
                          "that as by be are was all its upon which no not but or from has have me his "
                          "her their when where")
TOPICS = tuple(sorted(_wordset(
    "moon sea rain city spring forest river night star coffee school summer snow song friend garden "
    "sun wind road mountain cat dog book train winter morning flower ocean sky autumn candle bird "
    "cloud lake bridge storm tea window park beach"
)))
REQUESTS = ("Write a line about the {t}.", "Describe the {t} in one line.",
            "Say something about the {t}.", "One line on the {t}, please.")
TEST_FRACTION = 0.2
DEMOS: dict[str, tuple[str, ...]] = {
    "sweet": ("My dear {t}, your soft light is so sweet to my heart.",
              "Oh sweet {t}, I love the gentle way you hold my heart.",
              "The {t} is a warm and lovely hug for my tender heart.",
              "I adore you, dear {t}, so soft and kind to me."),
    "youthful": ("Wow, the {t} is so cool tonight! Totally epic vibes!",
                 "Hey, the {t} is super awesome! Literally the best!",
                 "Omg the {t} is lit! So much fun, dude!",
                 "Yo, this {t} is crazy cool! Yay!"),
    "classical": ("Behold the {t}, which doth shine upon thee.",
                  "O {t}, thou art fair, and thy grace hath no end.",
                  "Thus the {t} doth rise ere the night is done.",
                  "Yon {t} hath a beauty that thou shalt behold."),
    "plain": ("The {t} is there and it is big.", "I saw the {t} today at noon.",
              "There is a {t} near the house.", "We talked about the {t} for a while."),
}
_WORD = re.compile(r"[a-z']+")


def _topic_present(words: Sequence[str], topic: str) -> bool:
    return any(w in (topic, topic + "s", topic + "es") for w in words)


def quality_gate(text: str) -> str | None:
    """Why ``text`` earns nothing whatever its style (None when it is acceptable)."""
    words = _WORD.findall(text.lower())
    if not text.strip():
        return "empty"
    if len(words) < 4:
        return "too short"
    if len(words) > 24 or len(text) > 160:
        return "too long"
    letters = sum(c.isalpha() or c.isspace() for c in text)
    if letters < 0.75 * len(text) or text.count("!") > 5:
        return "not mostly words"
    counts = Counter(w for w in words if w not in FUNCTION_WORDS)
    if (counts and max(counts.values()) > 2) or len(set(words)) < 0.6 * len(words):
        return "repetition"
    return None


def style_score(text: str, style: str) -> float:
    """How clearly ``text`` is in ``style`` (in [0, 1]; ignores topic and the quality gate)."""
    if style not in LEXICONS:
        raise ValueError(f"unknown style {style!r}; styles are {STYLES}")
    words = set(_WORD.findall(text.lower()))
    own = len(words & LEXICONS[style])
    other = len(words & frozenset().union(*(v for k, v in LEXICONS.items() if k != style)))
    bangs = text.count("!")
    address = bool(words & {"you", "your", "my", "our"})
    feature = {
        "youthful": 1 <= bangs <= 3,
        "sweet": bangs == 0 and address,
        "classical": bangs == 0 and not words & {"you", "your"} and text.rstrip().endswith("."),
    }[style]
    score = 0.75 * min(own, 2) / 2 + 0.25 * feature - 0.25 * min(other, 2)
    return min(1.0, max(0.0, score))


def score_text(text: str, topic: str, style: str) -> tuple[float, str | None]:
    """(reward in [0, 1], reason for a zero/penalised reward or None). See the module docstring."""
    reason = quality_gate(text)
    if reason is not None:
        return 0.0, reason
    words = _WORD.findall(text.lower())
    factor, reason = 1.0, None
    if not _topic_present(words, topic):
        factor, reason = 0.4, "off topic"
    if sum(w in FUNCTION_WORDS for w in words) < 2:
        factor, reason = factor * 0.5, "not a sentence"
    return factor * style_score(text, style), reason


def topic_scales(bounds: Sequence[float]) -> dict[str, float]:
    """Each topic's reward scale: ``lo .. hi`` evenly spread over the topics in hash order."""
    if isinstance(bounds, str) or len(bounds) != 2:
        raise ValueError(f"topic_scale must be [lo, hi], got {bounds!r}")
    lo, hi = bounds
    if not (isinstance(lo, (int, float)) and isinstance(hi, (int, float)) and 0 < lo <= hi):
        raise ValueError(f"topic_scale must be [lo, hi] with 0 < lo <= hi, got {list(bounds)!r}")
    order = sorted(TOPICS, key=lambda t: content_hash("style_shift/scale", t))
    step = (hi - lo) / (len(order) - 1)
    return {t: float(lo + i * step) for i, t in enumerate(order)}


class StyleShiftEnv(Env):
    name: ClassVar[str] = "style_shift"
    stop_strings: ClassVar[tuple[str, ...]] = ("\n",)

    def __init__(
        self,
        switch_every: int = 100,
        schedule: Sequence[str] = STYLES,
        schedule_unit: str = "trainer_step",
        demo_error_rate: float = 0.2,
        topic_scale: Sequence[float] | None = None,
        **options: Any,
    ) -> None:
        """Options: ``switch_every`` (units per style, >= 1), ``schedule`` (style names, cycled),
        ``schedule_unit`` (trainer_step | episode), ``demo_error_rate`` (probability that a
        demonstration is a plain line with no style), ``topic_scale`` (``[lo, hi]`` with
        0 < lo <= hi: per-topic reward scales; None = 1 everywhere)."""
        super().__init__(**options)
        if not isinstance(switch_every, int) or switch_every < 1:
            raise ValueError(f"switch_every must be an int >= 1, got {switch_every!r}")
        if isinstance(schedule, str) or not schedule:
            raise ValueError(f"schedule must be a non-empty list of styles, got {schedule!r}")
        bad = [s for s in schedule if s not in STYLES]
        if bad:
            raise ValueError(f"schedule has unknown styles {bad}; styles are {STYLES}")
        if schedule_unit not in ("trainer_step", "episode"):
            raise ValueError(f"schedule_unit must be 'trainer_step' or 'episode', got {schedule_unit!r}")
        if not 0.0 <= demo_error_rate <= 1.0:
            raise ValueError(f"demo_error_rate must be in [0, 1], got {demo_error_rate!r}")
        self.scales = topic_scales(topic_scale) if topic_scale is not None else None
        self.switch_every, self.schedule = switch_every, tuple(schedule)
        self.schedule_unit, self.demo_error_rate = schedule_unit, demo_error_rate
        self.max_turns = 1
        self._task: Task | None = None
        self._style: str | None = None

    # ---------------------------------------------------------------- schedule

    def preferred_style(self, progress: Progress | None = None) -> str:
        """The style rewarded at ``progress`` (``Progress()`` when None)."""
        progress = progress or Progress()
        unit = progress.trainer_step if self.schedule_unit == "trainer_step" else progress.episode
        return self.schedule[(max(unit, 0) // self.switch_every) % len(self.schedule)]

    def switch_points(self, total_steps: int) -> list[tuple[int, str]]:
        """``(step, style)`` for step 0 and every later step < total_steps where the style changes
        (steps in ``schedule_unit``)."""
        points: list[tuple[int, str]] = []
        for k in range(0, max(total_steps, 1), self.switch_every):
            style = self.schedule[(k // self.switch_every) % len(self.schedule)]
            if not points or points[-1][1] != style:
                points.append((k, style))
        return points

    # ---------------------------------------------------------------- tasks

    def generate_tasks(self, split: Split, n: int, seed: int) -> list[Task]:
        """``n`` tasks from the split's pool of (request, topic) contents, reshuffled and cycled
        when ``n`` exceeds the pool (repeats get a ``/r<k>`` id suffix). 20% of contents are test."""
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        pool = []
        for topic in TOPICS:
            for request in REQUESTS:
                digest = content_hash("style_shift", request, topic)
                if split_of(digest, TEST_FRACTION) == split:
                    pool.append((digest, request, topic))
        rng = random.Random(f"style_shift/{split}/{seed}")
        tasks: list[Task] = []
        rnd = 0
        while len(tasks) < n:
            order = list(pool)
            rng.shuffle(order)
            for digest, request, topic in order[: n - len(tasks)]:
                suffix = f"/r{rnd}" if rnd else ""
                tasks.append(Task(f"style_shift/{digest[:16]}{suffix}",
                                  {"topic": topic, "request": request.format(t=topic)}))
            rnd += 1
        return tasks

    # ---------------------------------------------------------------- episode

    def reset(self, task: Task, progress: Progress | None = None) -> str:
        if "topic" not in task.data or "request" not in task.data:
            raise ValueError(f"task {task.id!r} is not a style_shift task (needs 'topic' and 'request')")
        self._task, self._style = task, self.preferred_style(progress)
        return task.data["request"] + "\n"

    def step(self, action: str) -> StepResult:
        if self._task is None or self._style is None:
            raise RuntimeError("StyleShiftEnv.step called before reset (or after the episode ended)")
        text = action.split("\n", 1)[0].strip()
        topic = self._task.data["topic"]
        score, reason = score_text(text, topic, self._style)
        scores = {s: score_text(text, topic, s)[0] for s in STYLES}
        clear = [s for s in STYLES if scores[s] >= 0.5]
        matched = clear[0] if len(clear) == 1 else "none"  # two can tie at exactly 0.5: ambiguous
        scale = 1.0 if self.scales is None else self.scales[topic]
        metrics = {f"matched_{s}": float(matched == s) for s in STYLES}
        metrics["matched_preferred"] = float(matched == self._style)
        info = {"success": score >= 0.5, "style": self._style, "style_scores": scores, "error": reason,
                "matched_style": matched, "scale": scale, "metrics": metrics}
        self._task = self._style = None
        return StepResult("", scale * score, True, info)

    def demonstration(self, task: Task, rng: random.Random) -> list[str]:
        """One line in a uniformly random style (so SFT starts mixed), or with probability
        ``demo_error_rate`` a plain on-topic line with no style."""
        kind = "plain" if rng.random() < self.demo_error_rate else rng.choice(STYLES)
        return [rng.choice(DEMOS[kind]).format(t=task.data["topic"]) + "\n"]
