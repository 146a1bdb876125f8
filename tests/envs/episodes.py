"""Shared by the env tests: play a scripted list of actions through an env."""


def play(env, task, actions):
    """Reset on ``task``, step each action until the episode is done; return the StepResults."""
    env.reset(task)
    results = []
    for a in actions:
        results.append(env.step(a))
        if results[-1].done:
            break
    return results
