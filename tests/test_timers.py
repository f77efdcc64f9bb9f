"""runtime.timers: one thread runs every watchdog, in deadline order."""

import threading

from runtime.timers import Timers


def test_calls_run_in_deadline_order_on_one_thread_and_a_failing_one_does_not_stop_it():
    timers, go, done, seen = Timers("test-timers"), threading.Event(), threading.Event(), []

    def record(name):
        seen.append((name, threading.current_thread().name))
        if len(seen) == 3:
            done.set()

    def boom():
        raise RuntimeError("a broken callback")

    timers.call_later(-10, go.wait, 30)  # first due: holds the thread until every call below is queued
    for delay, name in ((-1, "third"), (-3, "first"), (-2, "second")):  # all due, pushed out of order
        timers.call_later(delay, record, name)
    timers.call_later(-2.5, boom)
    go.set()
    assert done.wait(30)
    assert seen == [("first", "test-timers"), ("second", "test-timers"), ("third", "test-timers")]
    assert sum(t.name == "test-timers" for t in threading.enumerate()) == 1
