"""A multi-agent, multi-turn workload, three ways, in one run.

5 agents x 8 turns; each turn adds about --turn-tokens tokens and generates
--new tokens; a system prompt of --system-tokens makes contexts grow to about
system + turns x (turn + new). The same conversation is served by:
  (a) stateless: `mlx_lm.stream_generate` on the full history every turn, one
      agent at a time (what an agent framework over a stateless server pays);
  (b) mlx-lm prompt-cache reuse: an fp16 prompt cache per agent kept in memory,
      token-prefix matched, one agent at a time;
  (c) kvactors: agents as actors, the agents of a round batched, Q4 caches on
      disk, with a full Runtime restart halfway (caches reload from disk).
Total wall time, TTFT per turn, and peak MLX memory for each; for (c), the engine's
profile in place: decode steps by what changed before them, the hand-over where rows
ended, and what a decoding row waits between two tokens (the gaps between a batch's
steps, the prefill chunks run between them apart).

    python -m benchmarks.workload                                    # CPU, tiny model, small
    python -m benchmarks.workload --model llama-8b-shape --system-tokens 2000 --turn-tokens 200 --new 64   # GPU
"""

from __future__ import annotations

import collections
import cProfile
import gc
import os
import pstats
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import mlx_lm
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache
from mlx_lm.sample_utils import make_sampler

from benchmarks.common import bench_parser, bench_model_folder, environment, plot_lines, ranked, write_results
from benchmarks.cpu_speed import slow_cpus
from benchmarks.cuda_calls import CudaCalls
from benchmarks.sampler import StackSampler
from benchmarks.threadstat import ThreadStats
from benchmarks.ttft import long_text

from actors import persistence
from actors.agent import render
from runtime import Runtime
from runtime.hostcache import DeviceCache

COLUMNS = ["variant", "total_s", "x_stateless", "ttft_mean_s", "ttft_p50_s", "ttft_max_s", "peak_mem_gb", "final_context"]


def script(tokenizer, agents, turns, turn_tokens, system_tokens):
    """The workload: per agent a system prompt, per turn a user message (deterministic)."""
    systems = [long_text(tokenizer, system_tokens, seed=100 + a) for a in range(agents)]
    messages = [[long_text(tokenizer, turn_tokens, seed=1000 * a + t) for t in range(turns)] for a in range(agents)]
    return systems, messages


def stateless(model, tokenizer, systems, messages, new, prompt_cache=False):
    """Variants (a) and (b): one agent-turn at a time through mlx-lm; returns TTFTs and the final context."""
    sampler = make_sampler(0.0)
    histories = [[] for _ in systems]
    caches = [make_prompt_cache(model) for _ in systems] if prompt_cache else None
    cached = [[] for _ in systems]
    ttfts, context = [], 0
    for t in range(len(messages[0])):
        for a, system in enumerate(systems):
            histories[a].append({"role": "user", "text": messages[a][t]})
            tokens = tokenizer.encode(render(tokenizer, system, histories[a]), add_special_tokens=False)
            feed, kwargs = tokens, {}
            if prompt_cache:
                common = 0
                for x, y in zip(cached[a], tokens):
                    if x != y:
                        break
                    common += 1
                common = min(common, len(tokens) - 1)
                trim_prompt_cache(caches[a], caches[a][0].offset - common)
                feed, kwargs = tokens[common:], {"prompt_cache": caches[a]}
            t0 = time.perf_counter()
            out, first = [], None
            for r in mlx_lm.stream_generate(model, tokenizer, feed, max_tokens=new, sampler=sampler, **kwargs):
                first = first or time.perf_counter() - t0
                out.append(r.token)
            ttfts.append(first)
            histories[a].append({"role": "assistant", "text": tokenizer.decode(out)})
            if prompt_cache:
                cached[a] = (tokens + out)[: caches[a][0].offset]
            context = max(context, len(tokens) + len(out))
    return ttfts, context


def engine_profile(stats_list, seen=()) -> dict:
    """Where the engine's time went, from the `EngineStats` of each Runtime (in order).

    A shape met first in one of these engines counts as a first-time shape unless it
    is in `seen` (shapes of earlier runs in this process) or an earlier engine met it:
    MLX's per-shape setup lives as long as the process.
    """
    seen, new = set(seen), []
    for st in stats_list:
        new += [(shape, sec) for shape, sec in st.first_shapes if shape not in seen]
        seen.update(st.shapes)
    steps = [s for st in stats_list for s in st.decode_steps]
    chunks = [c for st in stats_list for c in st.prefill_chunks]
    totals = sorted(s.total_s for s in steps) or [0.0]
    cold = [c for c in chunks if c[1] == 0]
    hot = [c for c in chunks if c[1] > 0]
    return dict(
        decode_steps=len(steps), decode_s=sum(totals), mean_batch=statistics.mean(s.rows for s in steps) if steps else 0,
        step_p50_ms=ranked(totals, 0.5) * 1e3, step_p99_ms=ranked(totals, 0.99) * 1e3,
        build_p50_ms=statistics.median(s.build_s for s in steps) * 1e3 if steps else 0,
        # steps where rows ended: the hand-over (`DecodeStep.finish_s`), and the rest of taking the tokens
        end_split_ms=end_split(steps),
        # what a decoding row waits between two tokens (`DecodeStep.gap_s`): p50, p99, max ms, and by change
        token_gaps_ms=token_gaps(steps),
        # steps by what changed in the batch before them (EngineStats): count, p50 and max ms
        steps_by_change={k: [len(v), median_ms(s.total_s for s in v), round(max(s.total_s for s in v) * 1e3, 2)]
                         for k, v in by_change(steps).items()},
        cold_chunks=len(cold), cold_chunk_s=sum(c[2] for c in cold), cold_tokens=sum(c[0] for c in cold),
        hot_chunks=len(hot), hot_chunk_s=sum(c[2] for c in hot), hot_tokens=sum(c[0] for c in hot),
        hot_rows=sum(c[3] for c in hot),
        hot_chunk_p50_ms=statistics.median(c[2] for c in hot) * 1e3 if hot else 0,
        hot_chunk_max_ms=max((c[2] for c in hot), default=0) * 1e3,
        first_shapes=len(new), first_shape_s=sum(sec for _, sec in new),
        first_shapes_raw=[[list(shape), round(sec, 5)] for shape, sec in new],
        # raw, for a closer look in the JSON: every chunk, and every decode step
        chunks_raw=[[n, ctx, round(sec, 5), rows] for n, ctx, sec, rows in chunks],
        # (rows, build, wait, total seconds, changes, start, of build: in mx.async_eval, rows ended,
        # of total: handing their turns over, since the batch's step before began, of that: prefill chunks,
        # the batch's columns after the step built)
        steps_raw=[step_raw(s) for s in steps],
    )


def end_split(steps) -> dict:
    """Per number of rows ended at a step: [steps, p50 ms handing their turns over, p50 ms of the rest of taking
    the tokens (after the build and the wait)]."""
    groups = collections.defaultdict(list)
    for s in steps:
        if s.ended:
            groups[s.ended].append(s)
    return {n: [len(v), median_ms(s.finish_s for s in v),
                median_ms(s.total_s - s.build_s - s.wait_s - s.finish_s for s in v)]
            for n, v in sorted(groups.items())}


def token_gaps(steps) -> dict:
    """The gaps between a batch's decode steps (`DecodeStep.gap_s`, its first steps left out): count, p50, p99
    and max ms, and per kind of change before the step (as `by_change`) [count, p50 ms, max ms, p50 ms of prefill
    chunks in it, p50 ms of the rest after the step before (admissions, merges, hand-overs, the actors' messages)]."""
    pairs = [(before, s) for before, s in zip(steps, steps[1:]) if s.gap_s > 0]
    ranked_ms = sorted(s.gap_s * 1e3 for _, s in pairs) or [0.0]
    groups = collections.defaultdict(list)
    for before, s in pairs:
        groups[change_kind(s)].append((before, s))
    return dict(count=len(pairs), p50=round(ranked(ranked_ms, 0.5), 2), p99=round(ranked(ranked_ms, 0.99), 2),
                max=round(ranked_ms[-1], 2),
                by_change={k: [len(v), median_ms(s.gap_s for _, s in v), round(max(s.gap_s for _, s in v) * 1e3, 2),
                               median_ms(s.chunks_s for _, s in v),
                               median_ms(s.gap_s - s.chunks_s - b.total_s for b, s in v)]
                           for k, v in sorted(groups.items())})


def median_ms(seconds) -> float:
    """The median of `seconds`, in milliseconds to two places."""
    return round(statistics.median(seconds) * 1e3, 2)


def change_kind(step) -> str:
    """What changed in the batch before a `DecodeStep` ("none" for nothing), "+end" where rows ended at it."""
    return (step.changes or "none") + ("+end" if step.ended else "")


def by_change(steps) -> dict:
    """`DecodeStep`s grouped by what changed in the batch before them ("none" for nothing), and "+end" where
    rows ended at the step (their caches queued within it), sorted by that."""
    groups = collections.defaultdict(list)
    for s in steps:
        groups[change_kind(s)].append(s)
    return dict(sorted(groups.items()))


def print_os(seen: dict | None) -> None:
    """Print `ThreadStats.during`'s view of a step: each busy thread (and what it was doing at the polls),
    then the machine."""
    if not seen:
        return
    print(f"  OS, over {seen['window_ms']} ms of polls: machine {seen['machine']}", flush=True)
    for (kind, run, wait, minflt, majflt, kernel), states, cpus in zip(seen["threads"], seen["states"],
                                                                      seen.get("cpus", [{}] * len(seen["threads"]))):
        print(f"  {run:8.2f} ms on a CPU, {wait:6.2f} ms waiting for one, {minflt:6d} minor / {majflt} major faults, "
              f"{kernel:5.1f} ms in the kernel  {kind}  {states}  on CPUs {cpus}", flush=True)


def plain_spells(steps, least: int = 8, top: int = 6) -> dict:
    """The `top` longest runs of at least `least` consecutive plain decode steps (nothing changed before them) whose
    median is under the plain steps' median ("fast") and over it ("slow"), each run a list of steps in order."""
    plain = [st.total_s for st in steps if not st.changes]
    if not plain:
        return {}
    middle, runs, run = statistics.median(plain), [], []
    for st in list(steps) + [None]:
        if st is not None and not st.changes:
            run.append(st)
            continue
        if len(run) >= least:
            runs.append(run)
        run = []
    fast = [r for r in runs if statistics.median(st.total_s for st in r) < middle]
    slow = [r for r in runs if statistics.median(st.total_s for st in r) > middle]
    return {kind: sorted(rs, key=len, reverse=True)[:top] for kind, rs in (("fast", fast), ("slow", slow))}


def step_raw(s) -> list:
    """A `DecodeStep` as the JSON's `steps_raw` stores it: rows, build, wait, total, changes, start, queue, ended,
    finish, gap, chunks, end."""
    return [s.rows, round(s.build_s, 5), round(s.wait_s, 5), round(s.total_s, 5), s.changes, round(s.start, 4),
            round(s.queue_s, 5), s.ended, round(s.finish_s, 5), round(s.gap_s, 5), round(s.chunks_s, 5), s.end]


class WriteGate:
    """A diagnostic: while installed and closed, cache-writer threads wait before each cache file until the gate
    opens; journal appends and acknowledgements go on as ever.

    `stage` "all": the file waits whole (its copy off the device included); "encode": the rows are copied off
    the device as ever, and their checksums, encoding and write wait. (c) opens the gate before each Runtime
    closes, so every cache is written then and the restart loads them: the run shows what the engine's steps
    cost with no cache write (or no write past the copy) beside them. Not a way to run kvactors (a crash while
    closed loses every cache since, though no turn).
    """

    def __init__(self, stage: str = "all"):
        self.opened, self.stage = threading.Event(), stage
        self._write = None

    def install(self) -> None:
        self._write = persistence._write_segment

        def gated(folder, write, *rest):
            if self.stage == "all" or not isinstance(write.cache, DeviceCache):
                self.opened.wait()
                return self._write(folder, write, *rest)
            return self._write(folder, replace(write, cache=_CopiedThenGated(write.cache, self.opened)), *rest)

        persistence._write_segment = gated

    def remove(self) -> None:
        persistence._write_segment = self._write


class _CopiedThenGated:
    """A `DeviceCache` whose `rows` copies as ever, then waits for `opened` before handing the copy back."""

    def __init__(self, cache: DeviceCache, opened: threading.Event):
        self._cache, self._opened = cache, opened

    def __getattr__(self, name):
        return getattr(self._cache, name)

    def rows(self, start: int = 0):
        host = self._cache.rows(start)
        self._opened.wait()
        return host


def pin_engine(cpu: int) -> dict:
    """A diagnostic: the engine's thread (the batcher actor's) on CPU `cpu` alone, every other thread of the
    process on the other allowed CPUs (Linux). Returns what it did, for the results."""
    tids = [int(tid) for tid in os.listdir("/proc/self/task")]
    allowed = set().union(*(_affinity(tid) for tid in tids))  # as before any earlier pin
    engine = [t for t in threading.enumerate() if "Batcher" in t.name]
    if cpu not in allowed or len(allowed) < 2 or len(engine) != 1:
        return dict(pinned=False, cpu=cpu, allowed=len(allowed), engine_threads=len(engine))
    for tid in tids:
        try:
            os.sched_setaffinity(tid, {cpu} if tid == engine[0].native_id else allowed - {cpu})
        except OSError:  # a thread that ended meanwhile
            pass
    return dict(pinned=True, cpu=cpu)


def _affinity(tid: int) -> set:
    try:
        return os.sched_getaffinity(tid)
    except OSError:  # a thread that ended meanwhile
        return set()


def actors(model_path, cache_dir, systems, messages, new, seen=(), warmup=False, gate=None, pin=None):
    """Variant (c): all agents of a round at once; the Runtime restarts halfway.

    The measured Runtimes skip their start-up warm-up (`warmup=False`): the benchmark
    warms every path up once before it measures, as for the other variants, by a
    shorter run of this function with `warmup=True` (the Runtime's own warm-up, which
    decodes at every batch size, then a few turns). So the restart costs what a model
    load costs.

    Returns TTFTs, cache labels, and where the time went (seconds): opening the two
    Runtimes (model load), the engine's work per round (from the first submit to the
    last token of the round), and the rest of each round (until every reply is
    durable: copying caches out, writing them, acking). `seen`: engine shapes met
    before in this process (see `engine_profile`); the shapes these Runtimes met are
    returned in the parts as "shapes", and their `DecodeStep`s as "steps". `gate`: a
    closed `WriteGate` is opened before each Runtime closes, and closed again after.
    """
    turns = len(messages[0])
    ttfts, labels, prefilled, stats = [], [], [], []
    parts = dict(open_s=0.0, engine_s=0.0, after_s=0.0)
    for half in (range(turns // 2), range(turns // 2, turns)):
        t0 = time.perf_counter()
        with Runtime(model=model_path, cache_dir=cache_dir, warmup=warmup) as rt:
            parts["open_s"] += time.perf_counter() - t0
            agents = [rt.spawn(f"agent{a}", system=s) for a, s in enumerate(systems)]
            if pin is not None:
                parts.setdefault("pinned", []).append(pin_engine(pin))
            for t in half:
                start = time.perf_counter()
                futures = [agent.send(messages[a][t], max_tokens=new, timeout=600) for a, agent in enumerate(agents)]
                replies = [f.get(timeout=900) for f in futures]
                end = time.perf_counter()
                # a reply's TTFT counts from its agent's start of the turn, about `start`
                engine = max(r.timings.ttft_s + r.timings.decode_s for r in replies)
                parts["engine_s"] += engine
                parts["after_s"] += (end - start) - engine
                ttfts += [r.timings.ttft_s for r in replies]
                labels += [r.cache for r in replies]
                prefilled += [r.timings.prefill_tokens for r in replies]
            stats.append(rt.engine_stats())
            if gate:
                gate.opened.set()  # the Runtime's close writes every cache now
        if gate:
            gate.opened.clear()
    parts["prefilled"] = prefilled
    parts.update(engine_profile(stats, seen))
    parts["shapes"] = {shape for st in stats for shape in st.shapes}
    parts["steps"] = [s for st in stats for s in st.decode_steps]
    return ttfts, labels, parts


class GcPauses:
    """Python's garbage-collection pauses while installed as a `gc.callbacks` entry: (generation, seconds).

    A collection stops every Python thread (it holds the GIL), the engine's included.
    """

    def __init__(self):
        self.pauses, self._start = [], None

    def __call__(self, phase, info):
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.pauses.append((info["generation"], time.perf_counter() - self._start))
            self._start = None

    def summary(self) -> dict:
        """Per generation: [collections, total ms, longest ms]."""
        out = {}
        for gen in sorted({g for g, _ in self.pauses}):
            times = [t for g, t in self.pauses if g == gen]
            out[gen] = [len(times), round(sum(times) * 1e3, 1), round(max(times) * 1e3, 2)]
        return out


class MethodProfile:
    """Deterministic profiles (cProfile) of an `Engine` method's calls while installed, one per kind of call that
    `kind(engine, *args)` names (None: not profiled): where the engine thread's time goes in place (Python
    functions; the C calls a function makes, MLX's among them, count as its own time). Installed on the class, so
    every Runtime's engine is profiled."""

    def __init__(self, method: str, kind):
        from runtime.engine import Engine

        self._engine, self._method, self._kind = Engine, method, kind
        self._orig = getattr(Engine, method)
        self.profiles: dict[str, cProfile.Profile] = {}
        self.calls: collections.Counter = collections.Counter()

    def start(self):
        orig, kind_of = self._orig, self._kind

        def profiled(engine, *args):
            kind = kind_of(engine, *args)
            if kind is None:
                return orig(engine, *args)
            self.calls[kind] += 1
            profile = self.profiles.setdefault(kind, cProfile.Profile())
            profile.enable()
            try:
                return orig(engine, *args)
            finally:
                profile.disable()

        setattr(self._engine, self._method, profiled)

    def stop(self):
        setattr(self._engine, self._method, self._orig)

    def top(self, kind: str, n: int = 25) -> list:
        """The `n` functions with the most own time in calls of `kind`: [calls, own ms, cumulative ms, where], per
        call."""
        st = pstats.Stats(self.profiles[kind]).stats
        k = max(self.calls[kind], 1)
        rows = sorted(st.items(), key=lambda kv: -kv[1][2])[:n]
        return [[round(nc / k, 1), round(tt * 1e3 / k, 3), round(ct * 1e3 / k, 3), f"{f.split('/')[-1]}:{line} {fn}"]
                for (f, line, fn), (_, nc, tt, ct, _) in rows]

    def report(self, title: str) -> dict:
        """{kind: {calls, top}} of every kind profiled, printed under `title`."""
        out = {}
        for kind in sorted(self.profiles):
            out[kind] = dict(calls=self.calls[kind], top=self.top(kind))
            print(f"\n{title} '{kind}': {self.calls[kind]} calls; per call: calls, own ms, cumulative ms, function",
                  flush=True)
            for n, own, cum, where in out[kind]["top"]:
                print(f"  {n:7.1f} {own:8.3f} {cum:8.3f}  {where}", flush=True)
        return out


def finish_profile() -> MethodProfile:
    """Every hand-over of ending rows (`Engine._finish` with rows ending)."""
    return MethodProfile("_finish", lambda engine, ending, fed: "hand-over" if ending else None)


def step_profile() -> MethodProfile:
    """Every decode step (`Engine._decode_step`) but a batch's first, by what changed in the batch since the step
    before: "join" where rows joined, "chunk" after a prefill chunk without a join, "other" where only finished
    rows left or the buffers grew, "plain" where nothing changed (a growth the step itself makes counts with
    the step's kind: it is decided inside it)."""

    def kind(engine):
        if engine._next is None:
            return None
        changes = engine._changes
        return ("join" if "join" in changes else "chunk" if "chunk" in changes else "other" if changes
                else "plain")

    return MethodProfile("_decode_step", kind)


def calls_by_change(trace, steps, top: int = 10) -> dict:
    """Per kind of change before a decode step (`DecodeStep`s, grouped as `steps_by_change`): the mean step,
    its mean time in mx.async_eval, the mean time the device was busy while it ran, and the `top` [thread
    kind, CUDA function, calls per step, ms per step] the host made while such steps ran."""
    out = {}
    for change, steps in by_change(steps).items():
        summed = collections.defaultdict(lambda: [0, 0.0])
        for st in steps:
            for key, (n, ms) in trace.totals(st.start, st.start + st.total_s).items():
                summed[key][0] += n
                summed[key][1] += ms
        ranked = sorted(summed.items(), key=lambda kv: -kv[1][1])[:top]
        out[change] = dict(steps=len(steps), step_ms=round(statistics.mean(st.total_s for st in steps) * 1e3, 2),
                           queue_ms=round(statistics.mean(st.queue_s for st in steps) * 1e3, 2),
                           copy_ms=round(statistics.mean(trace.copy_busy(st.start, st.start + st.total_s)
                                                           for st in steps), 2),
                           calls=[[thread, fn, round(n / len(steps), 1), round(ms / len(steps), 3)]
                                  for (thread, fn), (n, ms) in ranked])
    return out


def measure(fn, *args):
    mx.synchronize()
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    out = fn(*args)
    mx.synchronize()
    return time.perf_counter() - t0, mx.get_peak_memory() / 1e9, out


def main(argv=None) -> int:
    ap = bench_parser(__doc__)
    ap.add_argument("--agents", type=int, default=5)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--system-tokens", type=int, default=300)
    ap.add_argument("--turn-tokens", type=int, default=60)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--variants", default="abc", help="which variants to run (profiling: 'c'); ratios need 'a'")
    ap.add_argument("--sample", action="store_true",
                    help="sample every thread's stack during (c) and store where each spent its time")
    ap.add_argument("--switch-interval", type=float, default=None,
                    help="Python's thread switch interval in seconds for the whole run (sys.setswitchinterval; "
                         "default: Python's, 0.005): how long a thread that wants the GIL may wait for a busy one")
    ap.add_argument("--trace-cuda", action="store_true",
                    help="trace the host's CUDA calls during (c) with CUPTI and sum them per decode step (CUDA only)")
    ap.add_argument("--thread-stats", action="store_true",
                    help="poll every thread's CPU time, run-queue wait, page faults and wait state (running, or the "
                         "system call it is blocked in: a futex names its lock) from /proc during (c), from a child "
                         "process, and give them for the slowest decode steps, for typical ones and for spells of plain steps in a row "
                         "faster and slower than their median (Linux only)")
    ap.add_argument("--pin-engine", type=int, default=None, metavar="CPU",
                    help="diagnostic: the engine's thread alone on CPU number CPU during (c), the process's other "
                         "threads on the other CPUs (Linux); `python -m benchmarks.cpu_speed` says which CPUs are "
                         "fast here")
    ap.add_argument("--defer-writes", choices=["all", "encode"], default=None,
                    help="diagnostic: (c)'s cache files wait until each Runtime closes (journals and acks as ever), "
                         "to show what the decode steps cost with no cache write beside them: 'all' holds each file "
                         "whole, 'encode' copies its rows off the device as ever and holds the checksums, encoding "
                         "and write; not a way to run")
    profiles = ap.add_mutually_exclusive_group()  # one profiler at a time (from Python 3.12 on, a second raises)
    profiles.add_argument("--profile-finish", action="store_true",
                          help="profile every hand-over of ending rows (Engine._finish) during (c) with cProfile and "
                               "give the functions with the most own time per hand-over (Python's profiler slows that "
                               "code; from Python 3.12 on it sees every thread's calls while it is on)")
    profiles.add_argument("--profile-steps", action="store_true",
                          help="profile every decode step during (c) with cProfile, apart by what changed before it (a "
                               "join, a chunk without one, rows leaving or growth, nothing), and give the functions "
                               "with the most own time per step of each kind (hand-overs included; the profiler slows "
                               "every step, so compare the kinds within one run; from Python 3.12 on it also counts "
                               "other threads' calls meanwhile)")
    args = ap.parse_args(argv)
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    env = environment()
    env["switch_interval_s"] = sys.getswitchinterval()
    env["defer_writes"] = args.defer_writes
    env["pin_engine"] = args.pin_engine
    env["slow_cpus_at_start"] = slow_cpus()  # a host whose CPUs run at half speed at times slows host-bound steps
    print(env, flush=True)
    rows, curves = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        model_path = bench_model_folder(args.model, Path(tmp))
        model, tokenizer = mlx_lm.load(str(model_path))
        tokenizer.eos_token_ids = set()  # random weights: every turn generates --new tokens
        systems, messages = script(tokenizer, args.agents, args.turns, args.turn_tokens, args.system_tokens)
        # warm-up: MLX-CUDA compiles kernels on first use (tens of seconds for some, per batch
        # size): let every path run once (a cold turn, a turn after a cache, every batch size)
        stateless(model, tokenizer, systems[:1], [messages[0][:2]], 4, True)
        for name, fn, fargs in (
            ("a: stateless re-prefill", stateless, (model, tokenizer, systems, messages, args.new)),
            ("b: mlx-lm prompt cache (fp16)", stateless, (model, tokenizer, systems, messages, args.new, True)),
        ):
            if name[0] not in args.variants:
                continue
            total, peak, (ttfts, context) = measure(fn, *fargs)
            rows.append(dict(variant=name, total_s=total, ttft_mean_s=statistics.mean(ttfts),
                             ttft_p50_s=statistics.median(ttfts), ttft_max_s=max(ttfts), peak_mem_gb=peak,
                             final_context=context))
            curves[name] = ttfts
            print(rows[-1], flush=True)
        del model
        *_, warm = actors(model_path, Path(tmp) / "warm-up", systems, [m[:2] for m in messages], 8, warmup=True)
        sampler = StackSampler(timeline=True) if args.sample else None
        trace = CudaCalls() if args.trace_cuda else None
        stats = ThreadStats() if args.thread_stats else None
        finish = finish_profile() if args.profile_finish else None
        stepped = step_profile() if args.profile_steps else None
        for tool in (sampler, trace, stats, finish, stepped):
            if tool:
                tool.start()
        pauses = GcPauses()
        gc.callbacks.append(pauses)
        gate = WriteGate(args.defer_writes) if args.defer_writes else None
        if gate:
            gate.install()
        try:
            total, peak, (ttfts, labels, parts) = measure(actors, model_path, Path(tmp) / "agents", systems,
                                                          messages, args.new, warm["shapes"], False, gate,
                                                          args.pin_engine)
        finally:
            if gate:
                gate.remove()
            gc.callbacks.remove(pauses)
            for tool in (sampler, trace, stats, finish, stepped):
                if tool:
                    tool.stop()
        parts.pop("shapes")
        steps = parts.pop("steps")
        parts["gc_pauses"] = pauses.summary()
        if finish:
            parts["finish_profile"] = finish.report("hand-overs profiled")
        if stepped:
            parts["step_profile"] = stepped.report("decode steps profiled, after")
        if sampler:
            parts["where_threads_were"] = sampler.as_dict()
            print(sampler.table(), flush=True)
        if trace:
            parts["cuda_calls_by_change"] = calls_by_change(trace, steps)
            for change, entry in parts["cuda_calls_by_change"].items():
                print(f"\nafter '{change}': {entry['steps']} steps, mean {entry['step_ms']} ms (in async_eval "
                      f"{entry['queue_ms']} ms, device copying {entry['copy_ms']} ms); CUDA calls per step:", flush=True)
                for thread, fn, n, ms in entry["calls"]:
                    print(f"  {ms:8.3f} ms  {n:7.1f}x  {thread}: {fn}", flush=True)
        if sampler or trace or stats:
            # the slowest decode steps: where every thread was sampled, what the host called, and what the OS saw
            slowest = sorted(steps, key=lambda st: -st.total_s)[:20]
            spans = [(st.start, st.start + st.total_s) for st in slowest]
            parts["slowest_steps"] = [[step_raw(st), sampler.during(*span, top=14) if sampler else None,
                                       trace.during(*span, top=10) if trace else None,
                                       trace.copy_busy(*span) if trace else None,
                                       stats.during(*span) if stats else None]
                                      for st, span in zip(slowest, spans)]
            for st, (_, places, calls, busy, seen) in zip(slowest, parts["slowest_steps"]):
                print(f"\nstep: rows {st.rows}, build {st.build_s * 1e3:.1f} ms (async_eval {st.queue_s * 1e3:.1f}), "
                      f"wait {st.wait_s * 1e3:.1f} ms, total {st.total_s * 1e3:.1f} ms, after '{st.changes}'"
                      + (f", device copying {busy:.1f} ms" if busy is not None else ""), flush=True)
                for kind, where, n in places or ():
                    print(f"  {n:3d}  {kind}: {where}", flush=True)
                for thread, fn, n, ms in calls or ():
                    print(f"  {ms:8.3f} ms  {n:5d}x  {thread}: {fn}", flush=True)
                print_os(seen)
        if stats:
            # typical plain steps, for comparison: the 12 nearest the median
            plain = sorted((st for st in steps if not st.changes), key=lambda st: st.total_s)
            typical = plain[max(0, len(plain) // 2 - 6) :][:12]
            parts["typical_steps"] = [[step_raw(st), stats.during(st.start, st.start + st.total_s)] for st in typical]
            for st, (_, seen) in zip(typical, parts["typical_steps"]):
                print(f"\ntypical step: rows {st.rows}, total {st.total_s * 1e3:.1f} ms", flush=True)
                print_os(seen)
            # spells of plain steps in a row, fast and slow against the plain median: what the OS saw over each
            parts["plain_spells"] = {kind: [[len(run), round(statistics.median(st.total_s for st in run) * 1e3, 2),
                                             stats.during(run[0].start, run[-1].start + run[-1].total_s)]
                                            for run in runs] for kind, runs in plain_spells(steps).items()}
            for kind, runs in parts["plain_spells"].items():
                for n, p50, seen in runs:
                    print(f"\n{kind} spell: {n} plain steps in a row, p50 {p50} ms", flush=True)
                    print_os(seen)
            parts["futexes"] = stats.futexes()
            print("\nfutex addresses waited on by most kinds of thread (the GIL's among them):", flush=True)
            for addr, kinds in list(parts["futexes"].items())[:8]:
                print(f"  {addr}: {', '.join(kinds)}", flush=True)
        message_tokens = [len(tokenizer.encode(m, add_special_tokens=False)) for t in range(args.turns) for m in
                          [messages[a][t] for a in range(args.agents)]]
        rows.append(dict(variant="c: kvactors (restart halfway)", total_s=total, ttft_mean_s=statistics.mean(ttfts),
                         ttft_p50_s=statistics.median(ttfts), ttft_max_s=max(ttfts), peak_mem_gb=peak,
                         final_context=rows[0]["final_context"] if rows else None, **{k: v for k, v in parts.items() if k != "prefilled"}))
        curves["c: kvactors (restart halfway)"] = ttfts
        print(rows[-1], "cache states:", labels, flush=True)
    for r in rows:
        r["x_stateless"] = rows[0]["total_s"] / r["total_s"] if "a" in args.variants else None
    name = args.name or f"workload-{args.model}"
    env["slow_cpus_at_end"] = slow_cpus()
    write_results(name, env, rows, COLUMNS, args.out,
                  notes=f"model {args.model}; {args.agents} agents x {args.turns} turns, +{args.turn_tokens} tokens and "
                        f"{args.new} generated per turn, system prompt {args.system_tokens} tokens. "
                        f"Where (c)'s time went: opening two Runtimes (model load) {parts['open_s']:.1f} s, the engine's "
                        f"work per round {parts['engine_s']:.1f} s, the rest of each round until every reply was durable "
                        f"(cache copies, writes, acks) {parts['after_s']:.1f} s. Inside the engine: "
                        f"{parts['decode_steps']} decode steps (mean batch {parts['mean_batch']:.1f}) {parts['decode_s']:.1f} s, "
                        f"p50 {parts['step_p50_ms']:.1f} ms, p99 {parts['step_p99_ms']:.1f} ms, of which building the graph "
                        f"{parts['build_p50_ms']:.1f} ms (p50); steps by what changed in the batch before them (+end: rows ended at the step) "
                        f"(count, p50 ms, max ms): {parts['steps_by_change']}; where rows ended, by how many (steps, p50 ms handing "
                        f"their turns over, p50 ms of the rest of taking the tokens): {parts['end_split_ms']}; what a decoding row "
                        f"waits between two tokens (the gaps between a batch's steps, prefill chunks between them "
                        f"included): {parts['token_gaps_ms']}; Python's garbage collections in every thread "
                        f"(generation: count, total ms, longest ms): {parts['gc_pauses']}; {parts['cold_chunks']} cold prefill chunks "
                        f"({parts['cold_tokens']} tokens) {parts['cold_chunk_s']:.1f} s; {parts['hot_chunks']} prefill chunks "
                        f"after a cache ({parts['hot_rows']} turns' chunks, {parts['hot_tokens']} tokens) "
                        f"{parts['hot_chunk_s']:.1f} s, p50 "
                        f"{parts['hot_chunk_p50_ms']:.0f} ms, max {parts['hot_chunk_max_ms']:.0f} ms; steps and chunks at a "
                        f"shape met for the first time in the process: {parts['first_shapes']} "
                        f"({parts['first_shape_s']:.1f} s). Tokens prefilled per "
                        f"hot or warm turn: mean {statistics.mean(p for p, c in zip(parts['prefilled'], labels) if c != 'cold'):.0f} "
                        f"(user message alone: mean {statistics.mean(message_tokens):.0f} tokens; the rest is the chat "
                        f"template and the previous reply's last token). "
                        f"(c)'s cache states per turn: {' '.join(labels)}. Target (GPU): c >= 3x faster than a.")
    plot_lines(args.out / f"{name}.png", curves, "agent-turn (round-major)", "TTFT (s)", f"TTFT per turn, {args.model}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
