"""Where rollout workers run: the backends (worker processes on this machine, episodes in this
process, Ray actors), the worker itself, its lifeline to the trainer, and the typed messages
between them."""
