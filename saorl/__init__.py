"""saorl: Single-rollout Asynchronous Optimization for LLM agents.

One rollout per prompt, trained on the moment it finishes; a value model instead of group
sampling; double-sided importance-sampling masks (DIS) against off-policy drift; skip-observation
GAE for multi-turn agents. See docs/method.md for the method.
"""

__version__ = "0.1.0"
