"""What the OS saw each thread of this process do, polled from /proc while a benchmark runs (Linux only).

`ThreadStats` reads, every `interval` seconds, each task's time on a CPU and time
waiting in the run queue (`/proc/self/task/<tid>/schedstat`, nanoseconds), its
minor and major page faults and its kernel-mode ticks (`.../stat`), and the
machine's busy and iowait CPU time (`/proc/stat`) and direct-reclaim stalls
(`/proc/vmstat`). `during(t0, t1)` gives each thread's share of a window on the
`time.perf_counter` clock, so a benchmark can ask of a slow step it timed itself:
was its thread running, waiting for a CPU, or faulting pages; which other threads
ran meanwhile; was the machine busy or reclaiming memory.

    with ThreadStats() as stats:
        run()
    print(stats.during(t0, t1))
"""

from __future__ import annotations

import bisect
import os
import threading
import time

from benchmarks.sampler import Poller, thread_kind

_TICK_MS = 1000 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 10.0
_RECLAIM = ("allocstall", "pgscan_direct")  # /proc/vmstat counters that start with these: direct reclaim


class _Files:
    """/proc files kept open and read again from their start (a poll of 60 tasks: 0.2 ms instead of 2.4)."""

    def __init__(self):
        self._fds: dict[str, int] = {}

    def read(self, path: str) -> str | None:
        """The file's text now, or None once it is gone (its task ended)."""
        fd = self._fds.get(path)
        try:
            if fd is None:
                fd = self._fds[path] = os.open(path, os.O_RDONLY)
            return os.pread(fd, 1 << 16, 0).decode()
        except OSError:
            if fd is not None:
                os.close(self._fds.pop(path))
            return None

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def _task(files: _Files, tid: str) -> tuple | None:
    """(on-CPU ns, run-queue ns, minor faults, major faults, kernel ticks) of task `tid`, or None if it ended."""
    sched, stat = files.read(f"/proc/self/task/{tid}/schedstat"), files.read(f"/proc/self/task/{tid}/stat")
    if sched is None or stat is None:
        return None
    run_ns, wait_ns = (int(x) for x in sched.split()[:2])
    fields = stat[stat.rindex(")") + 2 :].split()  # after the command name, which may hold spaces
    return run_ns, wait_ns, int(fields[7]), int(fields[9]), int(fields[12])


def _machine(files: _Files) -> tuple:
    """(busy ticks, iowait ticks, direct-reclaim events) of the whole machine."""
    cpu = [int(x) for x in files.read("/proc/stat").split("\n", 1)[0].split()[1:]]
    idle, iowait = cpu[3], cpu[4]
    reclaim = sum(int(line.split()[1]) for line in files.read("/proc/vmstat").splitlines()
                  if line.startswith(_RECLAIM))
    return sum(cpu[:8]) - idle - iowait, iowait, reclaim


class ThreadStats(Poller):
    """Every task's CPU time, run-queue wait and faults, and the machine's load, polled between `start` and `stop`."""

    thread_name = "thread-stats"

    def __init__(self, interval: float = 0.01):
        self.interval = interval
        self._times: list[float] = []  # perf_counter of each poll
        self._tasks: list[dict[str, tuple]] = []  # per poll: tid -> _task(tid)
        self._machine: list[tuple] = []
        self._names: dict[str, str] = {}  # native thread id -> the Python thread's name last seen
        super().__init__()

    def start(self) -> "ThreadStats":
        """Start polling on a daemon thread; raises RuntimeError off Linux (no /proc/self/task)."""
        if not os.path.isdir("/proc/self/task"):
            raise RuntimeError("ThreadStats reads /proc/self/task: Linux only")
        return super().start()

    def _run(self):
        files = _Files()
        try:
            while True:
                for t in threading.enumerate():
                    if t.native_id is not None:
                        self._names[str(t.native_id)] = t.name
                now = time.perf_counter()
                tasks = {tid: row for tid in os.listdir("/proc/self/task") if (row := _task(files, tid)) is not None}
                self._times.append(now)
                self._tasks.append(tasks)
                self._machine.append(_machine(files))
                if self._stop.wait(self.interval):
                    return
        finally:
            files.close()

    def _kind(self, tid: str) -> str:
        name = self._names.get(tid)
        return thread_kind(name) if name else f"native {tid}"

    def during(self, start: float, end: float, top: int = 6) -> dict | None:
        """What happened between the last poll at or before `start` and the first at or after `end`.

        `window_ms` is that span; `threads` the `top` tasks by CPU time as [kind, on-CPU ms,
        run-queue ms, minor faults, major faults, kernel ms]; `machine` the busy and iowait CPUs
        (averaged over the window) and the direct-reclaim events. None if the polls do not span it.
        """
        a = bisect.bisect_right(self._times, start) - 1
        b = bisect.bisect_left(self._times, end)
        if a < 0 or b >= len(self._times):
            return None
        t0, t1 = self._tasks[a], self._tasks[b]
        window = self._times[b] - self._times[a]
        rows = []
        for tid, after in t1.items():
            before = t0.get(tid, (0, 0, 0, 0, 0))
            run, wait, minflt, majflt, kernel = (x - y for x, y in zip(after, before))
            if run or wait:
                rows.append([self._kind(tid), round(run / 1e6, 2), round(wait / 1e6, 2), minflt, majflt,
                             round(kernel * _TICK_MS, 1)])
        rows.sort(key=lambda r: -r[1])
        (busy0, io0, rec0), (busy1, io1, rec1) = self._machine[a], self._machine[b]
        cpus = window * 1e3 / _TICK_MS
        return dict(window_ms=round(window * 1e3, 2), threads=rows[:top],
                    machine=dict(busy_cpus=round((busy1 - busy0) / cpus, 2), iowait_cpus=round((io1 - io0) / cpus, 2),
                                 reclaim=rec1 - rec0))
