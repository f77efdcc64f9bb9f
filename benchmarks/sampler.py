"""Where each thread spends its time, by sampling stacks while a benchmark runs.

`StackSampler` looks at every thread's current Python frame every `interval`
seconds (`sys._current_frames`) and counts, per thread, the innermost frame that
lies in this project's code (runtime/, actors/, benchmarks/) and the innermost
frame of any code. A thread waiting in C (a device wait, a lock, a file write)
shows the Python line that called it. No dependency; the sampling thread costs a
few percent of one core.

    with StackSampler() as s:
        run_workload()
    print(s.table())
"""

from __future__ import annotations

import collections
import sys
import threading
import time

OURS = ("/runtime/", "/actors/", "/benchmarks/")
IDLE = (" wait", " select", " _worker")  # where a thread waiting for work is sampled (a pool's _worker: in its queue's get)


def _where(frame) -> str:
    code = frame.f_code
    return f"{code.co_filename.rsplit('/', 2)[-2:][-1]}:{frame.f_lineno} {code.co_name}"


def _ours(frame):
    """The innermost frame of `frame`'s stack inside this project, or None."""
    while frame is not None:
        name = frame.f_code.co_filename
        if any(part in name for part in OURS) and not name.endswith("sampler.py"):
            return frame
        frame = frame.f_back
    return None


class Poller:
    """A daemon thread named `thread_name` that runs `_run` from `start` to `stop` (`_stop` tells it to end);
    a context manager too. Subclasses poll something in `_run`."""

    thread_name = "poller"

    def __init__(self):
        self._stop = threading.Event()
        self._poller = None

    def start(self):
        """Start the polling thread; returns self."""
        self._poller = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
        self._poller.start()
        return self

    def stop(self) -> None:
        """Tell the polling thread to end and wait for it."""
        self._stop.set()
        if self._poller is not None:
            self._poller.join()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    def _run(self):
        raise NotImplementedError


class StackSampler(Poller):
    """Counts where each thread is, sampled every `interval` seconds, between `start` and `stop`.

    `timeline` also keeps every sample as (time.perf_counter(), thread kind, place), for `during`.
    """

    thread_name = "stack-sampler"

    def __init__(self, interval: float = 0.005, timeline: bool = False):
        self.interval = interval
        self.samples = 0
        self.counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.timeline: list | None = [] if timeline else None
        super().__init__()

    def _run(self):
        me = threading.get_ident()
        while not self._stop.wait(self.interval):
            names = {t.ident: t.name for t in threading.enumerate()}
            now = time.perf_counter()
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                ours = _ours(frame)
                key = _where(frame) if ours is None or ours is frame else f"{_where(ours)} > {_where(frame)}"
                kind = thread_kind(names.get(ident, str(ident)))
                self.counts[kind][key] += 1
                if self.timeline is not None:
                    self.timeline.append((now, kind, key))
            self.samples += 1

    def table(self, top: int = 12) -> str:
        """Per thread kind, the `top` places by share of samples (a thread kind sums its threads)."""
        lines = [f"{self.samples} samples every {self.interval * 1e3:.0f} ms"]
        for kind, counter in sorted(self.counts.items(), key=lambda kv: -sum(kv[1].values())):
            total = sum(counter.values())
            lines.append(f"\n## {kind}: {total} thread-samples")
            for where, n in counter.most_common(top):
                lines.append(f"{100 * n / total:5.1f}%  {where}")
        return "\n".join(lines)

    def during(self, start: float, end: float, top: int = 8) -> list:
        """The `top` (thread kind, place, samples) sampled between `start` and `end` (needs `timeline`), leaving
        out threads that wait for work (a condition, a selector, an idle pool thread)."""
        seen = collections.Counter((kind, where) for t, kind, where in self.timeline
                                   if start <= t <= end and not where.endswith(IDLE))
        return [[kind, where, n] for (kind, where), n in seen.most_common(top)]

    def as_dict(self, top: int = 30) -> dict:
        """The counts as plain data for a JSON result: {thread kind: [[place, samples], ...]}."""
        return {kind: counter.most_common(top) for kind, counter in self.counts.items()}


def thread_kind(name: str) -> str:
    """A thread's name without its serial number, so threads of one kind add up."""
    base = name.split(" ")[0].rstrip("0123456789").rstrip("-_")
    return base or name

