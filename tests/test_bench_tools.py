"""The profiling tools of `benchmarks/` that the GPU runs depend on, checked where they can run: here CUPTI
cannot exist, so `CudaCalls` reads a stand-in `cupti` module that hands it records as CUPTI's activity API does."""

import csv
import os
import re
import sys
import threading
import time
import types

from benchmarks.cuda_calls import CudaCalls
from benchmarks.sampler import StackSampler
from benchmarks.threadstat import ThreadStats

import pytest


def stand_in_cupti(thread_id):
    """A `cupti` package whose activity API reports one runtime call on `thread_id` and one copy at each flush."""
    kinds = types.SimpleNamespace(RUNTIME=1, DRIVER=2, MEMCPY=3, MEMSET=4)
    state = {}

    def flush(_):
        now = time.perf_counter_ns()
        state["done"]([types.SimpleNamespace(kind=1, cbid=7, start=now - 2000, end=now, thread_id=thread_id),
                       types.SimpleNamespace(kind=3, start=now - 1000, end=now)])

    api = types.SimpleNamespace(
        ActivityKind=kinds, CallbackDomain=types.SimpleNamespace(RUNTIME_API=10, DRIVER_API=11),
        activity_register_callbacks=lambda request, done: state.update(done=done),
        get_timestamp=time.perf_counter_ns, activity_enable=lambda kind: None, activity_disable=lambda kind: None,
        activity_flush_all=flush, get_callback_name=lambda domain, cbid: f"cudaCall{cbid}")
    package = types.ModuleType("cupti")
    package.cupti = api
    return package


def test_cuda_calls_names_each_call_by_the_thread_that_made_it_and_sums_a_window(monkeypatch):
    worker = threading.Thread(target=time.sleep, args=(0.3,), name="BatcherActor-3")
    worker.start()
    monkeypatch.setitem(sys.modules, "cupti", stand_in_cupti(worker.ident & 0xFFFFFFFF))
    with CudaCalls() as calls:
        time.sleep(0.1)  # the poller names the threads every 50 ms
    worker.join()
    (start, end, thread, name), = calls.records
    assert (thread, name) == ("BatcherActor", "cudaCall7") and start < end
    assert calls.during(start - 1, end + 1) == [["BatcherActor", "cudaCall7", 1, round((end - start) * 1e3, 3)]]
    assert calls.during(end + 1, end + 2) == []
    assert 0 < calls.copy_busy(start - 1, end + 1) <= (end - start) * 1e3


def test_stack_sampler_counts_where_a_thread_waits():
    stop = threading.Event()
    worker = threading.Thread(target=stop.wait, args=(5,), name="AgentActor-1")
    worker.start()
    with StackSampler(interval=0.005) as sampler:
        time.sleep(0.1)
    stop.set()
    worker.join()
    assert "AgentActor" in sampler.table()


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="ThreadStats reads /proc (Linux)")
def test_thread_stats_say_which_lock_a_thread_waits_on_and_who_else_waited_there():
    gate, done = threading.Semaphore(0), threading.Event()
    # names no other thread has: threads left by earlier tests (actors among them) may still be there
    waiters = [threading.Thread(target=gate.acquire, name=f"WaiterUnderTest-{i}") for i in (1, 2)]
    spinner = threading.Thread(target=lambda: [None for _ in iter(done.is_set, True)], name="SpinnerUnderTest-1")
    with ThreadStats(interval=0.005) as stats:
        for t in waiters + [spinner]:
            t.start()
        t0 = time.perf_counter()
        time.sleep(0.2)
        t1 = time.perf_counter()
    # the threads outlive `stop`, which waits for polls begun after t1 (a thread gone from /proc takes its CPU)
    gate.release(2)
    done.set()
    for t in waiters + [spinner]:
        t.join()
    # polled by another process: 5 ms apart even while a thread here keeps the GIL; every thread, not the
    # busiest few (threads left by earlier tests may be busier than the spinner)
    seen = stats.during(t0, t1, top=10_000)
    states = dict(zip([kind for kind, *_ in seen["threads"]], seen["states"]))
    spinning = states["SpinnerUnderTest"]
    ran_on = dict(zip([kind for kind, *_ in seen["threads"]], seen["cpus"]))["SpinnerUnderTest"]
    assert sum(ran_on.values()) >= sum(spinning.values()) and all(0 <= cpu < os.cpu_count() for cpu in ran_on)
    # at least a few polls (40 are due; a loaded machine delays the poller, e.g. CI beside other jobs)
    assert spinning.get("running", 0) >= 3 and max(spinning, key=spinning.get) == "running"
    # each waiter sleeps on a lock of its own (Condition.wait's), on which no other thread is seen
    assert sum(kinds == ["WaiterUnderTest"] for kinds in stats.futexes().values()) >= 2
    assert all(addr.startswith("futex@0x") for addr in stats.futexes())


def test_thread_stats_keep_the_polls_before_a_line_cut_short():
    stats = ThreadStats()
    stats._read_poll("1.0 10 0 0 0|11,5,0,1,0,0,3,running;12,7,0,0,0,0,1,futex@0x10\n")
    stats._read_poll("2.0 20 0 0 0|11,9,0,1,0,0,3,running;12,7,0\n")  # the child killed mid-line
    assert stats._times == [1.0] and stats._states == [{"11": "running", "12": "futex@0x10"}]
    assert stats._tasks == [{"11": (5, 0, 1, 0, 0), "12": (7, 0, 0, 0, 0)}] and stats._cpus == [{"11": 3, "12": 1}]


def test_q4sdpa_tune_settings_fill_left_out_parts_and_each_setting_makes_new_launches(monkeypatch):
    """A setting with fewer parts takes the module's defaults for the rest, and choosing a setting forgets the
    launches q4sdpa keeps per shape (they hold the setting they were made with: the tune had timed the first
    setting under every name)."""
    from benchmarks import q4sdpa_tune
    from runtime import q4sdpa

    for name in q4sdpa_tune.SETTINGS:
        monkeypatch.setattr(q4sdpa, name, getattr(q4sdpa, name))  # restored after the test
    monkeypatch.setattr(q4sdpa, "_launches", {"a shape": "a launch made under another setting"})
    default = tuple(getattr(q4sdpa, name) for name in q4sdpa_tune.SETTINGS)
    assert q4sdpa_tune._settings("64/512/2,16/128/4/2") == [(64, 512, 2, *default[3:]), (16, 128, 4, 2)]
    q4sdpa_tune.use_setting((16, 128, 4, 2))
    assert (q4sdpa.CHUNKS, q4sdpa.MIN_CHUNK, q4sdpa.WARPS, q4sdpa.STAGES) == (16, 128, 4, 2)
    assert q4sdpa._launches == {}


def test_kernel_resources_writes_a_kernels_source_as_mlx_does():
    """The compile-only check's source: the signature in the kernel's input order with a shape parameter where the
    body reads one, the outputs, then a constant per template argument, then the body."""
    import mlx.core as mx

    from benchmarks.kernel_resources import parse_case, source
    from runtime import q4sdpa

    case = parse_case("128/64/6/4/rp")
    assert (case["D"], case["key_bits"], case["rotated"], case["rope"], case["prefill"]) == (128, 6, True, True, False)
    text = source("k", q4sdpa.KERNEL_NAMES, q4sdpa._KERNEL, q4sdpa.templates(**case), mx.bfloat16)
    at = text.index("__global__ void k(")
    signature = text[at:text.index(") {", at)]
    assert signature.index("const __nv_bfloat16* q,") < signature.index("const uint32_t* kw,") < signature.index(
        "const __grid_constant__ Shape kw_shape,") < signature.index("const __nv_bfloat16* ks,")
    assert "q_shape" not in signature and signature.rstrip().endswith("float* pacc,\n    __nv_bfloat16* out")
    assert "  constexpr int KB = 6;\n" in text and "  constexpr bool ROPE = true;\n" in text
    assert "  using T = __nv_bfloat16;\n" in text and text.index("constexpr bool PREFILL") < text.index(q4sdpa._KERNEL)


def test_q4sdpa_tune_takes_each_figure_s_median_over_repeated_chains():
    """`--repeat`: span, busy time and each kernel's time are medians over the chains, each on its own (one-row
    chains vary between runs, so no chain stands for all)."""
    from benchmarks.q4sdpa_tune import median_timing

    timings = [(1.0, 2.0, {"partial": 1.0, "reduce": 3.0}), (5.0, 1.0, {"partial": 2.0, "reduce": 1.0}),
               (3.0, 9.0, {"partial": 7.0, "reduce": 2.0})]
    assert median_timing(timings) == (3.0, 2.0, "partial 2.0 + reduce 2.0")
    assert median_timing(timings[:1]) == (1.0, 2.0, "partial 1.0 + reduce 3.0")


def test_kernel_resources_reads_loops_and_opcodes_from_nvdisasm_s_listing():
    """`--nvdisasm`: branch labels become the addresses they label, a branch back to an earlier address is a loop
    (nested loops both found, largest first), and opcodes are counted without their predicates."""
    from benchmarks.kernel_resources import code_report, loops, machine_code, opcode

    listing = """
	.text.kernel:
        /*0000*/                   LDC R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   HMMA.16816.F32 R4, R8, R12, R4 ;
.L_x_1:
        /*0020*/              @!P0 LOP3.LUT R2, R2, 0xf, RZ, 0xc0, !PT ;
        /*0030*/               @P1 BRA `(.L_x_1) ;
        /*0040*/                   LOP3.LUT R3, R3, 0xf0, RZ, 0xc0, !PT ;
        /*0050*/              @!P2 BRA `(.L_x_0) ;
        /*0060*/                   BRA `(.L_x_2) ;
.L_x_2:
        /*0070*/                   EXIT ;
"""
    code = machine_code(listing)
    assert [a for a, _ in code] == [0, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70]
    assert code[3][1].endswith("BRA 0x20") and code[6][1].endswith("BRA 0x70")
    assert opcode(code[2][1]) == "LOP3.LUT" and opcode(code[3][1]) == "BRA"
    found = loops(code)
    assert [(first, last, len(body)) for first, last, body in found] == [(0x10, 0x50, 5), (0x20, 0x30, 2)]
    report = code_report(listing)
    assert report.startswith("8 instructions") and "loop 0x10-0x50: 5 instructions: LOP3.LUT 2, " in report


def test_kernel_resources_writes_qgemm_s_product_kernel_as_mlx_does():
    """`--qgemm`: the product kernel's signature as MLX writes it: the input's shape and ndim where the body reads
    them, the weight as uint32 words, its scales and biases and the input of T, float32 partial sums."""
    import mlx.core as mx

    from benchmarks.kernel_resources import QGEMM_TEMPLATE, source
    from runtime import qgemm

    header, body, inputs, outputs = qgemm.product_kernel(1, 2)
    text = source("k", (inputs, outputs), body, QGEMM_TEMPLATE, mx.bfloat16, header)
    at = text.index("__global__ void k(")
    signature = text[at:text.index(") {", at)]
    assert signature.index("const __nv_bfloat16* x,") < signature.index("const __grid_constant__ Shape x_shape,") \
        < signature.index("const __grid_constant__ int x_ndim,") < signature.index("const uint32_t* w0,") \
        < signature.index("const __nv_bfloat16* s0,") < signature.index("const uint32_t* w1,")
    assert "x_strides" not in signature and signature.rstrip().endswith("float* part1")
    assert "#define BF 1\n" in text and "  constexpr int MT = 8;\n" in text
    # every template argument the body reads is given (a missing one fails NVRTC's compile)
    assert {name for name in ("T", "G", "S", "MT", "HD") if re.search(rf"\b{name}\b", body)} \
        == {name for name, _ in QGEMM_TEMPLATE}


def test_sass_stalls_splits_a_kernel_at_its_largest_loop_and_counts_samples_by_region(tmp_path):
    """Nsight Compute's source page as CSV: the backward branch that jumps furthest bounds the loop; samples, executed
    instructions and stall reasons are summed per region, and opcodes lose predicates and modifiers."""
    from benchmarks import sass_stalls

    header = ["Address", "Source", sass_stalls.SAMPLES, sass_stalls.EXECUTED, "stall_wait", "stall_wait (Not Issued)",
              "stall_barrier"]
    lines = [("0x100", "LDC R1, c[0x0][0x28]", 5, 10, 0, 0, 0),
             ("0x110", "HFMA2.MMA R2, R3, R4, R5", 7, 80, 6, 6, 0),   # the loop: 0x110 .. 0x140
             ("0x120", "@!P0 LOP3.LUT R2, R3, 0x1, RZ, 0xfc, !PT", 3, 80, 2, 1, 0),
             ("0x130", "@P1 BRA 0x120", 1, 80, 0, 0, 0),                # a shorter loop inside
             ("0x140", "@!P2 BRA 0x110", 2, 80, 1, 0, 0),
             ("0x150", "BAR.SYNC.DEFER_BLOCKING 0x0", 9, 10, 0, 0, 9),
             ("0x160", "EXIT", 0, 10, 0, 0, 0)]
    path = tmp_path / "k-sass.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f, quoting=csv.QUOTE_ALL)
        w.writerow(["Kernel Name", "k(float *)"])
        w.writerow(header)
        w.writerows(lines)
    read = sass_stalls.read(str(path))
    assert sass_stalls.main_loop(read) == (1, 5)
    assert [sass_stalls.opcode(x) for x in read[1:3]] == ["HFMA2", "LOP3"]
    assert sass_stalls.stalls(read[1:5]) == [(9, "wait")]
    text = sass_stalls.report(str(path))
    assert "loop lines 1-4" in text
    assert "prologue       5 samples (18.5%),         10 warp instructions\n" in text
    assert "loop          13 samples (48.1%),        320 warp instructions; wait 9\n" in text
    assert "epilogue       9 samples (33.3%),         20 warp instructions; barrier 9\n" in text
    assert "HFMA2 1/7" in text and text.endswith("lines: BAR.SYNC.DEFER_BLOCKING 0x0 (9: barrier 9)")


def test_plain_spells_finds_runs_of_plain_steps_by_their_median():
    """`workload.plain_spells` keeps runs of at least `least` consecutive plain steps, broken by any step after a
    change, and sorts them into faster and slower than the plain steps' median, longest first."""
    from benchmarks.workload import plain_spells

    def step(total, changes=""):
        return types.SimpleNamespace(total_s=total, changes=changes)

    steps = ([step(0.004)] * 10 + [step(0.012, "join")] + [step(0.0085)] * 9 + [step(0.0042)] * 3
             + [step(0.009, "grow")] + [step(0.0044)] * 12 + ([step(0.01, "leave")] + [step(0.007)] * 5) * 4)
    spells = plain_spells(steps, least=8)  # the plain median: 7 ms (25 faster steps, 20 at 7 ms, 9 slower)
    assert [len(r) for r in spells["fast"]] == [12, 10]
    assert [len(r) for r in spells["slow"]] == [12]  # 9 slow steps and 3 fast ones after them: its median is slow
    assert spells["slow"][0][0].total_s == 0.0085  # the runs of 5 are too short to count
    assert all(not st.changes for runs in spells.values() for r in runs for st in r)
    assert plain_spells([step(0.01, "join")]) == {}


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="pins threads to CPUs: Linux only")
def test_cpu_speed_probes_every_cpu_and_restores_the_affinity():
    from benchmarks.cpu_speed import probe

    before = os.sched_getaffinity(0)
    cpus = sorted(before)
    seen = probe(cpus, rounds=2)
    assert os.sched_getaffinity(0) == before
    assert sorted(seen) == cpus
    assert all(len(p) == 2 and len(m) == 2 and min(p) > 0 and min(m) > 0 for p, m in seen.values())
    from benchmarks.cpu_speed import slow_cpus

    quick = slow_cpus(factor=1e9)  # no CPU is a billion times slower than the fastest
    assert quick["probed"] == len(cpus) and quick["slow"] == {} and quick["fastest_ms"] > 0
    assert set(slow_cpus(factor=0)["slow"]) == set(cpus)  # every CPU is slower than nothing


def test_module_ab_times_both_versions_and_leaves_the_module_as_it_was(tmp_path):
    """A copy of runtime.q4sdpa's function stands in for the tree's in the old rounds only; afterwards the tree's
    function is back, and the table has a median per version and batch."""
    import json

    from benchmarks import module_ab
    from runtime import q4sdpa

    original = q4sdpa.q4_decode_sdpa
    copy = tmp_path / "copy.py"
    copy.write_text("from runtime.q4sdpa import q4_decode_sdpa as tree\n\n"
                    "def q4_decode_sdpa(*args, **kwargs):\n    return tree(*args, **kwargs)\n")
    assert module_ab.main(["--copy", str(copy), "--rounds", "1", "--batches", "2", "--context", "40",
                           "--out", str(tmp_path), "--name", "ab"]) == 0
    assert q4sdpa.q4_decode_sdpa is original
    rows = json.loads((tmp_path / "ab.json").read_text())["rows"]
    assert [(r["round"], r["version"]) for r in rows if r["round"] == "median"] == [("median", "old"),
                                                                                    ("median", "new")]
    assert all(r["pipelined_ms"] > 0 for r in rows)


def test_module_ab_times_hot_chunks_with_the_copy_in_the_old_rounds_only(tmp_path):
    """With --chunk, both versions time hot chunks (one turn with the host's share, two turns sharing one); the
    copy's function runs in the old rounds alone and the tree's is back afterwards."""
    import json

    from benchmarks import module_ab
    from runtime import prepare

    original = prepare._quantized_matmul
    copy = tmp_path / "copy.py"
    copy.write_text("from runtime.prepare import _quantized_matmul as tree\ncalls = []\n\n"
                    "def _quantized_matmul(module, x):\n    calls.append(x.shape)\n    return tree(module, x)\n")
    assert module_ab.main(["--copy", str(copy), "--module", "runtime.prepare", "--names", "_quantized_matmul",
                           "--chunk", "8", "--rounds", "1", "--batches", "1,2", "--context", "40",
                           "--out", str(tmp_path), "--name", "ab"]) == 0
    assert prepare._quantized_matmul is original
    rows = json.loads((tmp_path / "ab.json").read_text())["rows"]
    medians = [(r["version"], r["batch"]) for r in rows if r["round"] == "median"]
    assert medians == [("old", 1), ("old", 2), ("new", 1), ("new", 2)]
    assert all(r["chunk_ms"] > 0 for r in rows)
    assert all((r["host_ms"] is not None) == (r["batch"] == 1) for r in rows)


def test_module_ab_makes_compiled_blocks_record_their_graphs_again_after_a_swap(tiny_model_path):
    """A compiled block replays the kernels its functions chose when it recorded its graphs, so a swap of a
    function it calls (runtime.qgemm's) must make it record them again: `forget_graphs` drops them."""
    import mlx_lm

    from benchmarks.module_ab import forget_graphs
    from runtime.prepare import CompiledBlock, compile_blocks

    model, _ = mlx_lm.load(str(tiny_model_path("llama")))
    assert compile_blocks(model) == len(model.layers)
    blocks = [layer for layer in model.layers if isinstance(layer, CompiledBlock)]
    recorded = [block._graphs() for block in blocks]
    assert all(block._graphs() is graphs for block, graphs in zip(blocks, recorded))  # kept while nothing swaps
    forget_graphs(model)
    assert all(block._graphs() is not graphs for block, graphs in zip(blocks, recorded))


def test_module_ab_calls_table_gives_each_versions_calls_a_round_by_time():
    """The CUDA calls of each version's rounds, summed over its windows and given per round, the longest first
    (a recorded trace stands in for CUPTI's, which exists only on CUDA)."""
    from benchmarks.module_ab import calls_table

    class Trace:
        records = [(0.5, "engine", "cuMemAllocAsync", 2, 4.0), (0.6, "engine", "cuGraphLaunch", 1, 1.0),
                   (1.5, "engine", "cuMemAllocAsync", 4, 8.0), (2.5, "engine", "cuGraphLaunch", 3, 3.0)]

        def totals(self, start, end):
            out = {}
            for when, thread, name, n, ms in self.records:
                if start <= when <= end:
                    entry = out.setdefault((thread, name), [0, 0.0])
                    entry[0] += n
                    entry[1] += ms
            return out

    table = calls_table(Trace(), {("new", 1): [(0, 1), (2, 3)], ("old", 1): [(1, 2)]}).splitlines()
    assert table[2:] == ["| new | 1 | engine | cuMemAllocAsync | 1.0 | 2.000 |",
                         "| new | 1 | engine | cuGraphLaunch | 2.0 | 2.000 |",
                         "| old | 1 | engine | cuMemAllocAsync | 4.0 | 8.000 |"]


def test_qgemm_ab_says_same_only_for_equal_bits_and_else_the_largest_relative_difference():
    """`benchmarks.qgemm_ab`'s comparison of a version's outputs with the reference's: 'same' only where every
    array is bitwise equal; else the largest |difference| over the largest |reference|, over all arrays."""
    import mlx.core as mx

    from benchmarks.qgemm_ab import difference

    want = [mx.array([1.0, -4.0], mx.bfloat16), mx.array([2.0, 0.5], mx.bfloat16)]
    assert difference([mx.array(a) for a in want], want) == "same"
    got = [mx.array([1.0, -4.0], mx.bfloat16), mx.array([2.0, 0.25], mx.bfloat16)]  # 0.25 off, largest |want| 2
    assert difference(got, want) == "1.2e-01"
    assert difference([mx.array([1.0, -4.5], mx.bfloat16), want[1]], want) == "1.2e-01"  # 0.5 off over 4
