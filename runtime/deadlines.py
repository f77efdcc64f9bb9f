"""Deadlines: one thread runs callbacks when they fall due; a cancelled one never runs.

A `threading.Timer` per turn keeps a thread alive until it fires, long after the
turn is done. `Deadlines` keeps every pending deadline in one heap served by one
daemon thread (started on first use), and `cancel` forgets a deadline at once.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time

from runtime.errors import KvactorsError

log = logging.getLogger(__name__)


def wait_seconds(seconds: float | None) -> float | None:
    """`seconds` as a wait `threading` can make: None (no limit) stays None, and anything longer than
    `threading.TIMEOUT_MAX` (about 292 years; a longer wait raises OverflowError) becomes that: as long."""
    return None if seconds is None else min(seconds, threading.TIMEOUT_MAX)


class DeadlinesClosed(KvactorsError, RuntimeError):
    """The Deadlines were closed: nothing can be scheduled any more."""


class Deadlines:
    """Run `fn(*args)` at a due time on one shared thread; cancellable. Thread-safe.

    Callbacks run one after another on the deadline thread: they must be quick and
    must not block (tell an actor, set an event). An exception out of one is logged.
    `clock` is injectable for tests (monotonic seconds).
    """

    def __init__(self, name: str = "kvactors-deadlines", clock=time.monotonic):
        self.name, self._clock = name, clock
        self._heap: list = []  # (due, handle); cancelled handles are skipped when they surface
        self._live: dict = {}  # handle -> (fn, args)
        self._ids = itertools.count(1)
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False

    def schedule(self, delay: float, fn, *args) -> int:
        """Call `fn(*args)` after `delay` seconds; return the handle that `cancel` takes.

        Raises DeadlinesClosed after `close`.
        """
        with self._cond:
            if self._closed:
                raise DeadlinesClosed(f"{self.name} is closed; nothing more can be scheduled")
            handle = next(self._ids)
            self._live[handle] = (fn, args)
            heapq.heappush(self._heap, (self._clock() + max(0.0, delay), handle))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            self._cond.notify()
        return handle

    def cancel(self, handle: int | None) -> bool:
        """Forget the deadline `handle` (None is ignored); return whether it was still pending."""
        with self._cond:
            found = self._live.pop(handle, None) is not None
            if len(self._heap) > 2 * len(self._live) + 64:  # mostly cancelled entries: rebuild
                self._heap = [e for e in self._heap if e[1] in self._live]
                heapq.heapify(self._heap)
            return found

    def pending(self) -> int:
        """How many deadlines are scheduled and not yet run or cancelled."""
        with self._cond:
            return len(self._live)

    def close(self) -> None:
        """Drop every pending deadline and stop the thread (returns once it has stopped). Idempotent."""
        with self._cond:
            self._closed = True
            self._live.clear()
            self._heap.clear()
            self._cond.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                due = self._due()
                while due is None and not self._closed:
                    wait = self._heap[0][0] - self._clock() if self._heap else None
                    self._cond.wait(wait_seconds(wait))
                    due = self._due()
                if due is None:
                    return
            fn, args = due
            try:
                fn(*args)
            except Exception:  # noqa: BLE001 - one bad callback must not stop the others
                log.exception("deadline callback %r failed", fn)

    def _due(self):
        """Pop and return the (fn, args) of the first deadline due now, or None (call with the lock)."""
        while self._heap and self._heap[0][1] not in self._live:
            heapq.heappop(self._heap)
        if self._heap and self._heap[0][0] <= self._clock():
            return self._live.pop(heapq.heappop(self._heap)[1])
        return None
