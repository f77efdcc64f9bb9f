"""What the OS saw each thread of this process do, polled from /proc while a benchmark runs (Linux only).

`ThreadStats` reads, every `interval` seconds from a child process (which neither
waits for this process's GIL nor takes it), each task's time on a CPU and time
waiting in the run queue (`/proc/<pid>/task/<tid>/schedstat`, nanoseconds), its
minor and major page faults and its kernel-mode ticks (`.../stat`), what it is
doing at the poll (`.../syscall`: running, or the system call it is blocked in, a
futex with its address, which names the lock or condition it waits for), and the
machine's busy and iowait CPU time (`/proc/stat`) and direct-reclaim stalls
(`/proc/vmstat`). `during(t0, t1)` gives each thread's share of a window on the
`time.perf_counter` clock, so a benchmark can ask of a slow step it timed itself:
was its thread running, waiting for a CPU, for a lock (and which: `futexes` says
which threads were ever seen waiting on each address; Python's GIL is the one
every Python thread waits on), or faulting pages; which other threads ran
meanwhile; was the machine busy or reclaiming memory.

    with ThreadStats() as stats:
        run()
    print(stats.during(t0, t1))  # once stopped: the polls are read at `stop`
"""

from __future__ import annotations

import bisect
import collections
import ctypes
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time

from benchmarks.sampler import Poller, thread_kind

_TICK_MS = 1000 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 10.0
_RECLAIM = ("allocstall", "pgscan_direct")  # /proc/vmstat counters that start with these: direct reclaim
_SYSCALLS = {  # system call numbers by machine: the ones a waiting thread sits in
    "x86_64": {"0": "read", "1": "write", "7": "poll", "16": "ioctl", "17": "pread64", "23": "select",
               "24": "sched_yield", "35": "nanosleep", "74": "fsync", "75": "fdatasync", "202": "futex",
               "230": "clock_nanosleep", "232": "epoll_wait", "270": "pselect6", "271": "ppoll", "281": "epoll_pwait"},
    "aarch64": {"63": "read", "64": "write", "29": "ioctl", "67": "pread64", "124": "sched_yield", "101": "nanosleep",
                "82": "fsync", "83": "fdatasync", "98": "futex", "115": "clock_nanosleep", "72": "pselect6",
                "73": "ppoll", "22": "epoll_pwait"},
}.get(platform.machine(), {})
_PR_SET_PTRACER = 0x59616D61  # prctl: let this process read us as a debugger would (Yama's ptrace_scope 1)


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


def _task(files: _Files, tid: str, root: str) -> tuple | None:
    """(on-CPU ns, run-queue ns, minor faults, major faults, kernel ticks, the CPU it last ran on) of task `tid`
    in the task folder `root` (/proc/<pid>/task), or None if it ended."""
    sched, stat = files.read(f"{root}/{tid}/schedstat"), files.read(f"{root}/{tid}/stat")
    if sched is None or stat is None:
        return None
    run_ns, wait_ns = (int(x) for x in sched.split()[:2])
    fields = stat[stat.rindex(")") + 2 :].split()  # after the command name, which may hold spaces
    return run_ns, wait_ns, int(fields[7]), int(fields[9]), int(fields[12]), int(fields[36])


def _state(files: _Files, tid: str, root: str) -> str | None:
    """What task `tid` is doing now: "running", the system call it is blocked in ("futex@<address>" for a
    futex: the lock or condition variable), "syscall <n>" for one not named, "fault" when blocked in the
    kernel outside a system call (a page fault), or None if unreadable."""
    text = files.read(f"{root}/{tid}/syscall")
    if not text:
        return None
    fields = text.split()
    if fields[0] == "running":
        return "running"
    if fields[0] == "-1":
        return "fault"
    name = _SYSCALLS.get(fields[0], f"syscall {fields[0]}")
    return f"futex@{fields[1]}" if name == "futex" and len(fields) > 1 else name


def poll(pid: int, interval: float, out) -> None:
    """Write a line to `out` every `interval` seconds for the tasks of process `pid`, our parent, until SIGTERM
    or until the parent is gone:
    "<perf_counter> <busy ticks> <iowait ticks> <reclaims> <steal ticks>|<tid>,<run ns>,<wait ns>,<minflt>,<majflt>,<ticks>,<cpu>,<state>;..."."""
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the parent's to handle; it stops us
    files, root = _Files(), f"/proc/{pid}/task"
    try:
        while not stopping and os.getppid() == pid:
            now = time.perf_counter()
            entries = []
            for tid in os.listdir(root):
                row = _task(files, tid, root)
                if row is not None:
                    entries.append(",".join([tid, *map(str, row), _state(files, tid, root) or ""]))
            busy, iowait, reclaim, steal = _machine(files)
            out.write(f"{now:.6f} {busy} {iowait} {reclaim} {steal}|{';'.join(entries)}\n")
            out.flush()  # the parent's start waits for the first poll, its stop for two more
            time.sleep(max(0.0, interval - (time.perf_counter() - now)))
    except FileNotFoundError:
        pass  # the process ended
    finally:
        out.flush()
        files.close()


def _machine(files: _Files) -> tuple:
    """(busy ticks, iowait ticks, direct-reclaim events, steal ticks) of the whole machine: steal is the time a
    virtual machine's CPUs were runnable but the hypervisor ran something else (counted in busy too)."""
    cpu = [int(x) for x in files.read("/proc/stat").split("\n", 1)[0].split()[1:]]
    idle, iowait = cpu[3], cpu[4]
    reclaim = sum(int(line.split()[1]) for line in files.read("/proc/vmstat").splitlines()
                  if line.startswith(_RECLAIM))
    return sum(cpu[:8]) - idle - iowait, iowait, reclaim, cpu[7] if len(cpu) > 7 else 0


class ThreadStats(Poller):
    """Every task's CPU time, run-queue wait, faults and wait state, and the machine's load, polled between
    `start` and `stop` by a child process (`poll`), so that the polls neither wait for this process's GIL
    nor take it from the threads they watch; a thread of this process names the tasks meanwhile."""

    thread_name = "thread-stats"

    def __init__(self, interval: float = 0.005):
        self.interval = interval
        self._times: list[float] = []  # perf_counter of each poll (CLOCK_MONOTONIC: one clock for both processes)
        self._tasks: list[dict[str, tuple]] = []  # per poll: tid -> _task(tid)
        self._machine: list[tuple] = []
        self._states: list[dict[str, str]] = []  # per poll: tid -> _state(tid), for the tids of `_tasks`
        self._cpus: list[dict[str, int]] = []  # per poll: tid -> the CPU it last ran on
        self._names: dict[str, str] = {}  # native thread id -> the Python thread's name last seen
        self._child = self._out = None
        super().__init__()

    def start(self) -> "ThreadStats":
        """Start the polling process and the naming thread, and return once the first poll is written; raises
        RuntimeError off Linux (no /proc/self/task) or if the process ends first."""
        if not os.path.isdir("/proc/self/task"):
            raise RuntimeError("ThreadStats reads /proc/self/task: Linux only")
        self._out = tempfile.TemporaryFile("w+")
        paths = os.pathsep.join(p or os.getcwd() for p in sys.path)
        self._child = subprocess.Popen([sys.executable, "-m", "benchmarks.threadstat", str(os.getpid()),
                                        str(self.interval)], stdout=self._out, env=dict(os.environ, PYTHONPATH=paths))
        try:  # where Yama limits reading another process's /proc/<pid>/task/*/syscall to its debugger
            ctypes.CDLL(None).prctl(_PR_SET_PTRACER, self._child.pid, 0, 0, 0)
        except (OSError, AttributeError):
            pass  # no prctl: the states stay unread where Yama is on
        deadline = time.monotonic() + 30
        while not os.fstat(self._out.fileno()).st_size:
            if self._child.poll() is not None or time.monotonic() > deadline:
                self._child.kill()
                raise RuntimeError(f"the polling process wrote no poll (exit {self._child.wait()})")
            time.sleep(0.001)
        return super().start()

    def stop(self) -> None:
        """Stop polling and read the polls, once a poll begun after this call is written (within a deadline: a
        loaded machine's poller falls behind); a SIGTERM ends the child after its poll in progress."""
        super().stop()
        if self._child is None:
            return
        fd = self._out.fileno()
        at, lines, deadline = os.fstat(fd).st_size, 0, time.monotonic() + 5
        while lines < 2 and self._child.poll() is None and time.monotonic() < deadline:  # the second began after
            time.sleep(self.interval / 4)
            new = os.pread(fd, max(0, os.fstat(fd).st_size - at), at)
            lines, at = lines + new.count(b"\n"), at + len(new)
        self._child.terminate()
        try:
            self._child.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._child.kill()
            self._child.wait()
        self._child = None
        self._out.seek(0)
        for line in self._out:
            self._read_poll(line)
        self._out.close()

    def _run(self):
        while True:
            for t in threading.enumerate():
                if t.native_id is not None:
                    self._names[str(t.native_id)] = t.name
            if self._stop.wait(0.05):
                return

    def _read_poll(self, line: str) -> None:
        head, _, body = line.rstrip("\n").partition("|")
        tasks, states, cpus = {}, {}, {}
        try:
            now, busy, iowait, reclaim, steal = head.split()
            for entry in body.split(";"):
                tid, *counts, cpu, state = entry.split(",")
                tasks[tid] = tuple(int(x) for x in counts)
                cpus[tid] = int(cpu)
                if len(counts) != 5:
                    raise ValueError(entry)
                if state:
                    states[tid] = state
        except ValueError:
            return  # a line cut short (the child killed, a full disk): the polls before it stand
        self._times.append(float(now))
        self._machine.append((int(busy), int(iowait), int(reclaim), int(steal)))
        self._tasks.append(tasks)
        self._states.append(states)
        self._cpus.append(cpus)

    def _kind(self, tid: str) -> str:
        name = self._names.get(tid)
        return thread_kind(name) if name else f"native {tid}"

    def during(self, start: float, end: float, top: int = 6) -> dict | None:
        """What happened between the last poll at or before `start` and the first at or after `end` (after `stop`).

        `window_ms` is that span; `threads` the `top` tasks by CPU time as [kind, on-CPU ms,
        run-queue ms, minor faults, major faults, kernel ms]; `states`, in the same order, what each
        was doing at the polls between `start` and `end` ({state: polls}, see `_state`), `cpus` the CPUs it was
        last seen on at them ({cpu: polls}); `machine` the busy, iowait and stolen CPUs (averaged over the
        window) and the direct-reclaim events. None if the polls do not span it.
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
                             round(kernel * _TICK_MS, 1), tid])
        rows.sort(key=lambda r: -r[1])
        rows = rows[:top]
        states, ran_on = [], []
        for row in rows:
            tid = row.pop()
            seen = collections.Counter(polled[tid] for polled in self._states[a + 1 : b] if tid in polled)
            states.append(dict(seen.most_common()))
            ran = collections.Counter(polled[tid] for polled in self._cpus[a + 1 : b] if tid in polled)
            ran_on.append(dict(ran.most_common()))
        (busy0, io0, rec0, steal0), (busy1, io1, rec1, steal1) = self._machine[a], self._machine[b]
        cpus = window * 1e3 / _TICK_MS
        return dict(window_ms=round(window * 1e3, 2), threads=rows, states=states, cpus=ran_on,
                    machine=dict(busy_cpus=round((busy1 - busy0) / cpus, 2), iowait_cpus=round((io1 - io0) / cpus, 2),
                                 reclaim=rec1 - rec0, steal_cpus=round((steal1 - steal0) / cpus, 2)))

    def futexes(self) -> dict[str, list[str]]:
        """Each futex address any task was seen blocked on, and the kinds of the threads seen there (sorted):
        an address every Python thread waits on at some time is the GIL's."""
        seen = collections.defaultdict(set)
        for polled in self._states:
            for tid, state in polled.items():
                if state.startswith("futex@"):
                    seen[state].add(self._kind(tid))
        return {addr: sorted(kinds) for addr, kinds in sorted(seen.items(), key=lambda kv: -len(kv[1]))}


if __name__ == "__main__":
    poll(int(sys.argv[1]), float(sys.argv[2]), sys.stdout)
