"""The agent loop: turns between an inference engine and an environment → token-exact trajectories."""

from saorl.agent.loop import EpisodeError, PromptTooLongError, run_episode, run_episodes, stream_episodes
from saorl.agent.render import render_trajectory
from saorl.agent.scripted import ScriptedEngine, demonstration_trajectory

__all__ = [
    "EpisodeError", "PromptTooLongError", "ScriptedEngine", "demonstration_trajectory",
    "render_trajectory", "run_episode", "run_episodes", "stream_episodes",
]
