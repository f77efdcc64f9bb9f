"""runtime.deadlines: due order, cancellation, one thread, close."""

import threading

import pytest

from runtime.deadlines import Deadlines, DeadlinesClosed, wait_seconds


def test_deadlines_run_in_due_order_on_one_thread_and_cancelled_ones_never_run():
    d = Deadlines("test-deadlines")
    ran, threads, done = [], set(), threading.Event()

    def note(name):
        ran.append(name)
        threads.add(threading.current_thread().name)
        if name == "last":
            done.set()

    d.schedule(0.3, note, "last")
    d.schedule(0.1, note, "second")
    d.schedule(0.0, note, "first")
    cancelled = d.schedule(0.05, note, "cancelled")
    assert d.cancel(cancelled) and not d.cancel(cancelled) and not d.cancel(None)
    assert done.wait(10)
    assert ran == ["first", "second", "last"] and threads == {"test-deadlines"}
    assert d.pending() == 0
    d.close()
    with pytest.raises(DeadlinesClosed):
        d.schedule(0, note, "late")
    assert "test-deadlines" not in {t.name for t in threading.enumerate()}


def test_many_cancelled_deadlines_leave_nothing_behind():
    d = Deadlines()
    handles = [d.schedule(3600, print, i) for i in range(1000)]
    assert all(d.cancel(h) for h in handles)
    assert d.pending() == 0 and len(d._heap) <= 64  # noqa: SLF001 - cancelled entries were dropped
    d.close()


def test_a_failing_callback_does_not_stop_the_others():
    d = Deadlines()
    done = threading.Event()
    d.schedule(0, lambda: 1 / 0)
    d.schedule(0.01, done.set)
    assert done.wait(10)
    d.close()


def test_a_deadline_further_off_than_a_wait_can_reach_does_not_stop_the_thread():
    """A delay past threading.TIMEOUT_MAX (a turn sent with timeout=1e10) made the thread's wait overflow and the
    thread die, so no deadline of any turn ran after it."""
    d = Deadlines()
    done = threading.Event()
    d.schedule(1e10, print, "far off")
    d.schedule(float(threading.TIMEOUT_MAX) * 4, print, "further")
    threading.Event().wait(0.1)  # the thread now waits for the first of them
    d.schedule(0.05, done.set)
    assert done.wait(10)
    assert d.pending() == 2
    d.close()


def test_wait_seconds_keeps_none_and_caps_at_the_longest_wait():
    assert wait_seconds(None) is None and wait_seconds(2.5) == 2.5
    assert wait_seconds(1e300) == threading.TIMEOUT_MAX
    threading.Event().wait(wait_seconds(1e300) * 0)  # a capped wait is one threading accepts
