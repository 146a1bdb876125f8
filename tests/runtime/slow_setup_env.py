"""An env for the watchdog tests: math_tool whose construction keeps the CPU busy for ``setup_s``
seconds in the caller (a rollout worker builds each episode's env on its event loop, so the worker
sends no message meanwhile, while it is plainly working)."""

import time

from saorl.envs.math_tool import MathToolEnv


class SlowSetupEnv(MathToolEnv):
    built = 0
    """Instances built in this process: the first, the template the worker checks options with at
    start-up, is built at once."""

    def __init__(self, setup_s: float = 0.0, **options) -> None:
        super().__init__(**options)
        SlowSetupEnv.built += 1
        if SlowSetupEnv.built == 1:
            return
        end = time.monotonic() + setup_s  # busy, with whatever share of a core the machine gives it
        while time.monotonic() < end:
            pass
