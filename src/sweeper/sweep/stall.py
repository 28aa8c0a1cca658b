"""Ending a trial that has stopped reporting, so that no sweep waits for ever: Ray Tune has
no per-trial inactivity timeout (its stoppers only see reports, which a stuck trial no longer
makes).

A trial's pace is the longest gap between its reports so far (the first counted from its
start). Once it has reported, a silence of STALL_FACTOR times that pace, and at least
`sweep.stall_seconds`, raises TrialStalledError in the thread that runs it: Tune records the
trial as failed with that one line, and `sweep.max_failures` retries it. A thread stuck where
Python cannot raise (a C call that waits for ever) is ended with its process after as long
again.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import time

STALL_FACTOR = 10


class TrialStalledError(RuntimeError):
    cause = "the trial stopped reporting"

    def __str__(self) -> str:
        return self.cause


def raise_in_thread(ident: int, error: type[BaseException]) -> None:
    """Raises `error` in the thread `ident` at its next Python instruction (CPython's
    PyThreadState_SetAsyncExc): the one way to end a thread that is not listening."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), ctypes.py_object(error))


class StallWatch:
    """Watches the calling thread's trial from a daemon thread; `beat()` at each report,
    `stop()` when the trial ends."""

    def __init__(self, floor_s: float):
        self.floor_s = floor_s
        self.target = threading.get_ident()
        self.last = time.monotonic()
        self.slowest = 0.0
        self.reported = False
        self.done = threading.Event()
        threading.Thread(target=self._watch, name="sweeper-stall-watch", daemon=True).start()

    def beat(self) -> None:
        now = time.monotonic()
        self.slowest = max(self.slowest, now - self.last)
        self.last, self.reported = now, True

    def stop(self) -> None:
        self.done.set()

    def limit_s(self) -> float:
        return max(STALL_FACTOR * self.slowest, self.floor_s)

    def _watch(self) -> None:
        while not self.done.wait(min(1.0, self.floor_s / 4)):
            silent = time.monotonic() - self.last
            if self.reported and silent > self.limit_s():
                self._end(
                    f"no report for {silent:.0f} s, more than {STALL_FACTOR}x its "
                    f"slowest gap between reports ({self.slowest:.1f} s) and "
                    f"sweep.stall_seconds={self.floor_s:g}: stuck?"
                )
                return

    def _end(self, cause: str) -> None:
        raise_in_thread(
            self.target, type("TrialStalledError", (TrialStalledError,), {"cause": cause})
        )
        if not self.done.wait(self.floor_s):  # stuck in C: only the process can end it
            print(f"{cause} (its process ended: the trial's thread did not stop)", file=sys.stderr)
            sys.stderr.flush()
            os._exit(1)
