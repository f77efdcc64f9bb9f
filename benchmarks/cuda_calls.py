"""The CUDA runtime and driver calls the host makes, traced by CUPTI, on the `time.perf_counter` clock.

`CudaCalls` records every call (start, end, thread kind, function name) between
`start` and `stop`, and when the device ran copies and fills;
`during(t0, t1)` sums the calls over a window given in `time.perf_counter`
seconds, and `copy_busy(t0, t1)` those copies and fills, so a benchmark can ask
what the host called, and whether the device was copying, while a step it timed
itself was running. The device's CUDA graphs are not traced: CUPTI 13's graph
activity (`GRAPH_TRACE`) crashed inside libcupti in the workload once cache
copies went through `runtime.cudacopy` (H100, 2026-11-27); without it the trace ran. Thread kinds are thread names without their
serial numbers, as `benchmarks.sampler` names them. CUDA and the `cupti-python`
package only.

    with CudaCalls() as calls:
        run()
    print(calls.totals())
"""

from __future__ import annotations

import bisect
import collections
import threading
import time

from benchmarks.sampler import Poller, thread_kind


class CudaCalls(Poller):
    """Every CUDA runtime and driver call made between `start` and `stop`, by CUPTI's activity API."""

    thread_name = "cuda-calls"

    def __init__(self):
        super().__init__()
        try:
            from cupti import cupti
        except ImportError as e:
            raise SystemExit(f"tracing CUDA calls needs NVIDIA's cupti-python on a CUDA machine "
                             f"(pip install cupti-python): {e}") from e

        self._cupti = cupti
        self._kinds = (cupti.ActivityKind.RUNTIME, cupti.ActivityKind.DRIVER)
        self._device_kinds = (cupti.ActivityKind.MEMCPY, cupti.ActivityKind.MEMSET)
        self._domains = {cupti.ActivityKind.RUNTIME: cupti.CallbackDomain.RUNTIME_API,
                         cupti.ActivityKind.DRIVER: cupti.CallbackDomain.DRIVER_API}
        self._raw = []  # (kind, cbid, start ns, end ns, thread id), CUPTI's clock
        self._raw_device = []  # (kind, start ns, end ns)
        # thread id -> [(perf_counter s, name)] as polled: threads end before the trace is read, and a later
        # thread may get an ended one's id
        self._names: dict[int, list] = collections.defaultdict(list)
        self._offset_ns = 0  # CUPTI's clock minus perf_counter's
        self.records: list[tuple[float, float, str, str]] = []  # (start s, end s, thread kind, function)
        self._starts: list[float] = []
        self.device: list[tuple[float, float]] = []  # (start s, end s) of each copy or fill the device ran

    def start(self) -> "CudaCalls":
        """Start tracing (and naming threads every 50 ms)."""
        cupti = self._cupti

        def completed(activities):
            for a in activities:
                if a.kind in self._kinds:
                    self._raw.append((a.kind, a.cbid, a.start, a.end, a.thread_id))
                elif a.kind in self._device_kinds:
                    self._raw_device.append((a.kind, a.start, a.end))

        cupti.activity_register_callbacks(lambda: (8 * 1024 * 1024, 0), completed)
        before = time.perf_counter_ns()
        stamp = cupti.get_timestamp()
        self._offset_ns = stamp - (before + time.perf_counter_ns()) // 2
        for kind in self._kinds + self._device_kinds:
            cupti.activity_enable(kind)
        return super().start()

    def stop(self) -> None:
        """Stop tracing and turn the raw records into `records`."""
        cupti = self._cupti
        cupti.activity_flush_all(1)
        for kind in self._kinds + self._device_kinds:
            cupti.activity_disable(kind)
        super().stop()
        self._poll_once()
        names = {}
        for kind, cbid, start, end, thread in self._raw:
            key = (kind, cbid)
            if key not in names:
                names[key] = cupti.get_callback_name(self._domains[kind], cbid)
            began = (start - self._offset_ns) / 1e9
            self.records.append((began, (end - self._offset_ns) / 1e9, self._thread(thread, began), names[key]))
        self.records.sort()
        self._starts = [r[0] for r in self.records]
        self._raw.clear()
        self.device = sorted(((start - self._offset_ns) / 1e9, (end - self._offset_ns) / 1e9)
                             for _, start, end in self._raw_device)
        self._raw_device.clear()

    def _poll_once(self):
        now = time.perf_counter()
        for t in threading.enumerate():
            if t.ident is None:  # not started yet
                continue
            # CUPTI gives the thread's pthread id cut to 32 bits; Python's ident is the whole pthread id
            seen = self._names[t.ident & 0xFFFFFFFF]
            if not seen or seen[-1][1] != t.name:
                seen.append((now, t.name))

    def _thread(self, thread: int, when: float) -> str:
        """The kind of the thread with CUPTI's id `thread` at `when`: the name polled last before it (or first)."""
        seen = self._names.get(thread)
        if not seen:
            return str(thread)
        at = max(0, bisect.bisect_right(seen, (when, "\uffff")) - 1)
        return thread_kind(seen[at][1])

    def _run(self):
        while not self._stop.wait(0.05):
            self._poll_once()

    def totals(self, start: float = float("-inf"), end: float = float("inf")) -> dict:
        """{(thread kind, function): [calls, milliseconds]} of the calls that began between `start` and `end`."""
        out = collections.defaultdict(lambda: [0, 0.0])
        first = bisect.bisect_left(self._starts, start)
        last = bisect.bisect_right(self._starts, end)
        for s, e, thread, name in self.records[first:last]:
            entry = out[(thread, name)]
            entry[0] += 1
            entry[1] += (e - s) * 1e3
        return dict(out)

    def during(self, start: float, end: float, top: int = 8) -> list:
        """The `top` [thread kind, function, calls, ms] by time among the calls that began between `start` and `end`."""
        ranked = sorted(self.totals(start, end).items(), key=lambda kv: -kv[1][1])[:top]
        return [[thread, name, n, round(ms, 3)] for (thread, name), (n, ms) in ranked]

    def copy_busy(self, start: float, end: float) -> float:
        """Milliseconds between `start` and `end` in which the device ran a copy or a fill."""
        busy, reach = 0.0, start
        for s, e in self.device[max(0, bisect.bisect_left(self.device, (start,)) - 64):]:
            if s >= end:
                break
            s, e = max(s, reach), min(e, end)
            if e > s:
                busy += e - s
                reach = e
        return busy * 1e3
