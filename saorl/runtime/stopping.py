"""Stopping a run on Ctrl-C or SIGTERM, within a bounded time.

:class:`StopControl` is the run's handler of both signals. The first one asks the loop to stop
(:attr:`StopControl.requested`): it finishes the step in progress — an evaluation in progress is
dropped — writes a checkpoint and ``final/``, stops the workers, and the run exits with status 0.
If that is not done ``timeout_s`` (``trainer.stop_timeout_s``) after the signal, or on a second
signal, the process ends at once (:func:`os._exit`, status :data:`EXIT_FORCED`), from the thread
that noticed: nothing more is written, and what was written is consistent — every journal line is
fsynced before it is trained on, and a checkpoint becomes visible only by a rename once it is
complete (:func:`~saorl.runtime.checkpoint.save_checkpoint`), so the last one written before is
the one a resume finds. The rollout workers, and the processes running user code, die with the
trainer (:mod:`saorl.runtime.backends.lifeline`, :mod:`saorl.envs.hosted`).

Why not unwind with an exception (KeyboardInterrupt), as the second Ctrl-C once did: it may land
in the middle of a learner step, whose models are then half-updated while the feed already counts
the step's batch as taken, so the checkpoint written on the way out would lose that batch; and a
thread stuck in a call that never returns keeps the interpreter from exiting, since it joins its
threads at exit.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable

EXIT_FORCED = 130
"""Exit status of a forced stop (as of a process ended by Ctrl-C: 128 + SIGINT)."""


def _signal_name(signum: int | None) -> str:
    return "Ctrl-C" if signum in (None, signal.SIGINT) else signal.Signals(signum).name


def _release_semaphores() -> None:
    """Unlink the named semaphores of this process's ``multiprocessing`` queues (the rollout
    workers'), which :func:`os._exit` skips: else multiprocessing's resource tracker finds them
    when the workers are gone, removes them and warns, ``There appear to be 6 leaked semaphore
    objects to clean up at shutdown``, into the run's log. The finalizers of priority >= 0 are
    the ones a normal exit runs first (the semaphores' unlink, the queues' close: neither waits
    on another thread); the private name is multiprocessing's own exit path."""
    try:
        from multiprocessing import util

        util._run_finalizers(0)
    except Exception:  # a forced stop must end whatever happens here
        pass


class StopControl:
    """A signal handler (``signal.signal(SIGINT, control)``) that stops in bounded time.

    ``log`` gets the messages; ``kept()`` says what a forced stop leaves (the last checkpoint)."""

    def __init__(self, timeout_s: float, log: Callable[[str], None], kept: Callable[[], str]) -> None:
        self.timeout_s, self.log, self.kept = timeout_s, log, kept
        self.requested = False
        self._timer: threading.Timer | None = None

    def __call__(self, signum: int | None = None, frame: object = None) -> None:
        name = _signal_name(signum)
        if self.requested:
            self.force(f"a second {name}")
        self.requested = True
        self.log(f"stopping: finishing the current step and writing a checkpoint (within "
                 f"{self.timeout_s:g} s, trainer.stop_timeout_s; {name} again to stop at once)")
        why = f"the stop was not done within {self.timeout_s:g} s (trainer.stop_timeout_s)"
        self._timer = threading.Timer(self.timeout_s, self.force, args=(why,))
        self._timer.daemon = True
        self._timer.start()

    def force(self, why: str) -> None:
        """End the process now (see the module docstring); never returns."""
        try:
            text = f"stopping at once: {why}. The step in progress is abandoned; {self.kept()}\n"
            os.write(2, text.encode())  # no lock a stuck thread may hold: not print, not the console
        finally:
            _release_semaphores()
            os._exit(EXIT_FORCED)

    def done(self) -> None:
        """The stop finished in time (or none was asked for): no forced stop after this."""
        if self._timer is not None:
            self._timer.cancel()
