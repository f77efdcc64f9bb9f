"""One thread that runs callbacks at their deadlines, for every turn's watchdog.

A `threading.Timer` per turn is a thread per call that sleeps until its timeout
(60 s by default), long after the turn has ended. `call_later` puts the call on
one shared heap instead, served by a single daemon thread started on first use.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from typing import Callable

log = logging.getLogger(__name__)


class Timers:
    """Calls `fn(*args)` after `delay` seconds, in deadline order, all on one daemon thread.

    The callbacks must be short and must not block: a slow one delays the others.
    An exception in one is logged and the thread goes on.
    """

    def __init__(self, name: str = "kvactors-timers"):
        self.name = name
        self._heap: list = []
        self._order = itertools.count()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def call_later(self, delay: float, fn: Callable, *args) -> None:
        """Run `fn(*args)` on the timer thread once `delay` seconds have passed."""
        with self._cond:
            heapq.heappush(self._heap, (time.monotonic() + delay, next(self._order), fn, args))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            self._cond.notify()

    def _run(self):
        while True:
            with self._cond:
                while not self._heap or self._heap[0][0] > time.monotonic():
                    self._cond.wait(self._heap[0][0] - time.monotonic() if self._heap else None)
                _, _, fn, args = heapq.heappop(self._heap)
            try:
                fn(*args)
            except Exception:
                log.exception("timer callback %r failed", fn)


_shared = Timers()


def call_later(delay: float, fn: Callable, *args) -> None:
    """`Timers.call_later` on the process-wide timer thread."""
    _shared.call_later(delay, fn, *args)
