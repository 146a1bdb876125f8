"""Routing replay end to end on the tiny MoE: the local engine records the experts it used, the
agent loop puts them on the trajectory, and the trainer's replayed forward scores every sampled
token as the (perturbed) engine did."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch

from saorl.agent.loop import run_episode
from saorl.data.batch import collate
from saorl.data.task import Task
from saorl.engines.base import SamplingParams
from saorl.engines.local import LocalEngine
from saorl.envs.base import Env, StepResult
from saorl.models.logprobs import token_logprobs
from saorl.models.routing import perturb_routing, replay_routes
from saorl.models.tiny import build_tiny
from saorl.models.tokenizer import load_tokenizer


class ThreeTurns(Env):
    name = "three-turns"
    stop_strings = ("</a>",)
    max_turns = 3

    def generate_tasks(self, split, n, seed):
        return [Task(f"{split}-{i}", {"q": i}) for i in range(n)]

    def reset(self, task, progress=None):
        self.turn = 0
        return f"Q{task.data['q']}:"

    def step(self, action):
        self.turn += 1
        return StepResult(f"<obs {self.turn} with a few more words>\n", 0.0, self.turn >= 3, {})


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def _engine_pair(perturbation):
    trainer = build_tiny("tiny-moe", seed=4)
    engine_model = copy.deepcopy(trainer)
    perturb_routing(engine_model, seed=1, **perturbation)
    return trainer, engine_model


def _replayed_logprobs(model, trajs, replay=True):
    batch = collate(trajs, pad_id=1)
    routes = batch.routes.reshape(*batch.routes.shape[:2], 4, -1)
    with torch.no_grad():
        if not replay:
            return batch, token_logprobs(model, batch.input_ids, batch.attention_mask)
        with replay_routes(model, routes):
            return batch, token_logprobs(model, batch.input_ids, batch.attention_mask)


@pytest.mark.parametrize("perturbation", [{"top_k": 3}, {"noise_std": 1.0}])
def test_replayed_trainer_logprobs_equal_the_perturbed_engines(tok, perturbation):
    trainer, engine_model = _engine_pair(perturbation)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=10, seed=3)
    with LocalEngine(engine_model, tok, max_batch_size=4, record_routes=True) as engine:
        async def episodes():
            return await asyncio.gather(*(run_episode(engine, ThreeTurns(), Task(f"t{i}", {"q": i}), tok,
                                                      sampling=sampling, max_total_tokens=200, sample_index=i)
                                          for i in range(4)))
        trajs = asyncio.run(episodes())
    k = perturbation.get("top_k", 2)
    for t in trajs:
        assert t.routes is not None and len(t.routes) == len(t.token_ids)
        assert all(len(r) == 4 * k for r in t.routes) and t.routes[-1] == [-1] * (4 * k)
        assert all(x >= 0 for r in t.routes[:-1] for x in r)
        assert t.episode.turns >= 2  # multi-turn: later turns reuse the stored prefix and its routes
    batch, replayed = _replayed_logprobs(trainer, trajs)
    _, plain = _replayed_logprobs(trainer, trajs, replay=False)
    act = batch.action_mask.bool()
    gap = (replayed - batch.rollout_logprobs)[act].abs().max().item()
    assert gap < 1e-5
    assert (plain - batch.rollout_logprobs)[act].abs().max().item() > 1e-3  # the mismatch replay removes


def test_routes_cover_what_the_engine_fed_and_survive_json_and_collate(tok):
    _, engine_model = _engine_pair({"top_k": 3})
    with LocalEngine(engine_model, tok, max_batch_size=2, record_routes=True) as engine:
        res = engine.generate([[5, 6, 7], [8, 9]], SamplingParams(max_new_tokens=4, seed=0))
    # the prompt and every generated token but the last were fed to the model
    assert [len(r.routes) for r in res] == [3 + len(res[0].token_ids) - 1, 2 + len(res[1].token_ids) - 1]
    from saorl.data.trajectory import Trajectory

    trajs = []
    for prompt, r in zip([[5, 6, 7], [8, 9]], res):
        n = len(prompt) + len(r.token_ids)
        trajs.append(Trajectory(prompt + r.token_ids, [0] * len(prompt) + [1] * len(r.token_ids),
                                [0.0] * len(prompt) + r.logprobs, [0.0] * n,
                                [-1] * len(prompt) + r.versions, len(prompt),
                                routes=[*r.routes, [-1] * 12]))
    back = [Trajectory.from_json(t.to_json()) for t in trajs]
    assert back == trajs
    batch = collate(back, pad_id=1)
    assert batch.routes.shape == (2, max(map(len, trajs)), 12)
    short = min(range(2), key=lambda b: len(trajs[b]))
    assert (batch.routes[short, len(trajs[short]):] == -1).all()
    with pytest.raises(ValueError, match="record_routes needs an MoE model"):
        LocalEngine(build_tiny("tiny-dense"), tok, record_routes=True)
