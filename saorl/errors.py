"""The two kinds of failure saorl reports to a user, each with a one-paragraph message.

- :class:`StartupError`: the input cannot work (config, files, env, model, device). Raised before
  anything has run, naming what is wrong and how to fix it; ``saorl`` exits with status 2. The
  config's own :class:`~saorl.config.ConfigError`, a task file's
  :class:`~saorl.data.task.TaskFileError` and an env's
  :class:`~saorl.envs.registry.EnvResolveError` are reported the same way.
- :class:`RunFailure`: the run started and cannot go on (the workers' restart budget is spent, a
  rollout keeps failing, the run directory is damaged). The run directory keeps what was done up to
  the last checkpoint; ``saorl`` exits with status 3.

Anything else that escapes is a bug (in saorl, or in an env or reward function it runs): status 1,
the message in one paragraph, the traceback with ``--debug`` or ``SAORL_DEBUG=1``.
"""

from __future__ import annotations


class StartupError(ValueError):
    """A run (or command) that cannot start: the message says what is wrong and the fix."""


class RunFailure(RuntimeError):
    """A run that started and had to stop; the message says why and what is left on disk."""
