"""Decode attention over the packed Q4 cache (`runtime.q4sdpa`) against MLX's fused fp16 SDPA.

For each context and batch size: the time of one decode-attention call of the 8B shape
(32 query heads, 8 kv heads, head dim 128) through `q4sdpa` at each launch setting
(blocks per row, fewest keys per block, warps per block), through an older version of the
kernel if `--old` names its file, and through `mx.fast.scaled_dot_product_attention`
over the same tokens in bf16. Calls are chained (each call's queries are the previous
call's output), so they run one after another, as a model's layers do; each timed chain
follows WARM_S seconds of the same calls, so the GPU runs at its working clock. Inputs rotate among enough copies that together exceed
the GPU's L2 cache, so every call reads its keys and values from device memory. Also
reports each call's busy device time (its kernels' own durations, without the gaps where
the device waited for the host) split by kernel, each setting's largest error against a
float32 reference (ragged rows), the bytes each call must read, and the bandwidth that implies; for each
older module, whether its output on those ragged rows is bitwise the current module's at its default setting.

    python -m benchmarks.q4sdpa_tune --contexts 4096,16384,32768,65536 --batches 1,8
"""

from __future__ import annotations

import importlib.util
import math
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

from benchmarks.common import DEVICE_TIMED, bench_parser, environment, traced_kernels, write_results
from runtime import q4sdpa
from runtime.q4cache import row_array

COLUMNS = ["context", "rows", "kernel", "setting", "us", "x_fp16", "busy_us", "busy_x_fp16", "kernels_us", "GB_per_s",
           "max_err", "bitwise_current"]
HQ, HKV, D, GROUP = 32, 8, 128, 64
ROTATE_BYTES = 256 << 20  # inputs per timed call set: well over an H100's 50 MB L2
WARM_S = 0.3  # seconds of the same calls before each timed chain, so an idle GPU's clock (an H100's: 345 MHz) is up;
# it did not remove the variation of one-row chains (the reduce kernel 3.6 or 7.5 us), seen at a steady 1980 MHz


def _packed(b, w, seed, key_bits=4):
    k = mx.random.normal((b, HKV, w, D), key=mx.random.key(seed)).astype(mx.bfloat16)
    v = mx.random.normal((b, HKV, w, D), key=mx.random.key(seed + 1)).astype(mx.bfloat16)
    kq, vq = tuple(mx.quantize(k, GROUP, key_bits)), tuple(mx.quantize(v, GROUP, 4))
    mx.eval(kq, vq)
    return kq, vq


def _bytes(packed) -> int:
    return sum(x.nbytes for x in packed)


def input_sets(kq, vq) -> list:
    """(keys, values) and copies of them, together over ROTATE_BYTES (at most 8): timed calls cycle through them,
    so each call reads its keys and values from device memory rather than L2."""
    copies = max(1, min(8, -(-ROTATE_BYTES // (_bytes(kq) + _bytes(vq)))))
    return [(kq, vq)] + [tuple(tuple(x + 0 for x in p) for p in (kq, vq)) for _ in range(copies - 1)]


def rope_inv_freq():
    """RoPE's inverse frequencies for head dim D (base 500,000, as the 8B shape's), float32."""
    return (500000.0 ** (-mx.arange(0, D, 2, dtype=mx.float32) / D)).astype(mx.float32)


def _reference(q, kq, vq, start, end, scale):
    k = mx.dequantize(*kq, group_size=GROUP, bits=kq[0].shape[-1] * 32 // D).astype(mx.float32)
    v = mx.dequantize(*vq, group_size=GROUP, bits=4).astype(mx.float32)
    rep = q.shape[1] // k.shape[1]
    k, v = mx.repeat(k, rep, axis=1), mx.repeat(v, rep, axis=1)
    s = (q.astype(mx.float32) * scale) @ k.swapaxes(-1, -2)
    cols = mx.arange(k.shape[2])
    valid = (cols[None] >= start[:, None]) & (cols[None] < end)
    s = mx.where(valid[:, None, None, :], s, -math.inf)
    return mx.softmax(s, axis=-1) @ v


def _ragged(fn, key_bits=4) -> tuple:
    """(output, largest |output - ref| against float32) of `fn(q, kq, vq, start, end, scale)` on ragged rows."""
    end = 3000
    kq, vq = _packed(4, end + 40, 11, key_bits)
    q = mx.random.normal((4, HQ, 1, D), key=mx.random.key(12)).astype(mx.bfloat16)
    start = mx.array([0, 1000, end - 1, 7], dtype=mx.int32)
    out = fn(q, kq, vq, start, end, D ** -0.5)
    return out, mx.abs(out.astype(mx.float32) - _reference(q, kq, vq, start, end, D ** -0.5)).max().item()


def chained_us(fn, sets, q, reps: int = 40) -> tuple[float, float, dict]:
    """(span, busy, kernels): microseconds per call of `fn(q, keys, values)` when each call's queries are the previous
    call's output (cycling through `sets` of (keys, values)): calls run one after another, as a model's layers do.

    span: the device's span (first kernel's start to last kernel's end, CUPTI) over the calls where the
    cupti-python package is installed, else the wall time; it includes the gaps where the device waited
    for the host's launches. busy: the kernels' own durations added up (CUPTI; NaN without it), what the
    calls cost the device where the host runs ahead of it, as in a model's step; kernels: busy by kernel
    ({'q4sdpa': 20.1}, or an older module's {'partial': 20.1, 'reduce': 5.2}; empty without CUPTI). Independent calls would
    let MLX-CUDA run their kernels side by side, and adding up those kernels' durations then counts more
    time than either one call's latency or the calls' throughput.
    """
    def run():
        x = q
        for i in range(reps):
            x = fn(x, *sets[i % len(sets)])
        mx.eval(x)
        mx.synchronize()

    t0 = time.perf_counter()
    while time.perf_counter() - t0 < WARM_S:  # the GPU's clocks up first (a one-row chain lasts ~1 ms)
        run()
    if DEVICE_TIMED:
        records = traced_kernels(run)
        parts = {}
        for name, s, e in records:
            part = next((p for p in ("partial", "reduce") if f"q4_decode_{p}" in name),
                        "q4sdpa" if "q4_decode" in name else name.split("<")[0][:24])
            parts[part] = parts.get(part, 0.0) + (e - s) / reps / 1e3
        return (records[-1][2] - records[0][1]) / reps / 1e3, sum(parts.values()), parts
    t0 = time.perf_counter()
    run()
    return (time.perf_counter() - t0) / reps * 1e6, math.nan, {}


def median_timing(timings) -> tuple[float, float, str]:
    """The median of each of `chained_us`'s results over repeated chains: (span, busy, kernels as
    'partial 20.1 + reduce 5.2', each kernel's median)."""
    parts = {name: statistics.median(t[2][name] for t in timings) for name in timings[0][2]}
    return (statistics.median(t[0] for t in timings), statistics.median(t[1] for t in timings),
            " + ".join(f"{p} {us:.1f}" for p, us in parts.items()))


def load_copy(path):
    """The module in file `path`: a copy of a runtime module (an older runtime/q4sdpa.py here), loaded beside the
    package's own."""
    spec = importlib.util.spec_from_file_location(f"copy_of_{Path(path).stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SETTINGS = ("CHUNKS", "MIN_CHUNK", "WARPS", "STAGES")  # runtime.q4sdpa's launch settings, in this order


def _settings(text: str):
    """'64/256/4,...' -> [(CHUNKS, MIN_CHUNK, WARPS, STAGES), ...], settings left out at runtime.q4sdpa's defaults."""
    default = [getattr(q4sdpa, name) for name in SETTINGS]
    out = []
    for s in text.split(","):
        given = [int(x) for x in s.split("/")]
        out.append(tuple(given + default[len(given):]))
    return out


def use_setting(setting) -> None:
    """Set runtime.q4sdpa's launch settings (a tuple in SETTINGS' order) for the calls that follow (the launches
    q4sdpa keeps per shape are made again)."""
    for name, value in zip(SETTINGS, setting):
        setattr(q4sdpa, name, value)
    q4sdpa._launches.clear()


def setting_name(setting) -> str:
    """A setting as '--settings' writes it."""
    return "/".join(str(x) for x in setting)


def main(argv=None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--contexts", default="4096,16384,32768,65536")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--settings", default="32/256/4,16/256/4,24/256/4,32/512/4,32/256/2",
                        help="settings CHUNKS/MIN_CHUNK/WARPS[/STAGES] of runtime.q4sdpa to time, comma-separated "
                        "(CHUNKS at most 32)")
    parser.add_argument("--key-bits", type=int, default=4, help="bits of the keys (4 or 6; values are 4-bit)")
    parser.add_argument("--rotated", action="store_true", help="time calls on a Hadamard-rotated cache (as the default "
                        "scheme's); errors are measured unrotated")
    parser.add_argument("--rope", action="store_true", help="time calls that apply RoPE to the queries in the kernel")
    parser.add_argument("--old", default="", help="files holding older q4sdpa modules to time beside, comma-separated")
    parser.add_argument("--repeat", type=int, default=1, help="chains timed per kernel, in rounds of every kernel once; "
                        "the table gives each figure's median (one-row calls vary between chains)")
    args = parser.parse_args(argv)
    env = environment()
    rows = []
    settings = _settings(args.settings)
    olds = [(path, load_copy(path)) for path in args.old.split(",") if path]
    default = tuple(getattr(q4sdpa, name) for name in SETTINGS)
    use = use_setting

    errors = {}
    for setting in settings:
        use(setting)
        errors[setting] = _ragged(lambda *a: q4sdpa.q4_decode_sdpa(*a, GROUP), args.key_bits)[1]
    use(default)
    mine = _ragged(lambda *a: q4sdpa.q4_decode_sdpa(*a, GROUP), args.key_bits)[0]
    old_errors, same = {}, {}
    for path, module in olds:
        out, old_errors[path] = _ragged(lambda *a, m=module: m.q4_decode_sdpa(*a, GROUP), args.key_bits)
        same[path] = mx.array_equal(out, mine).item()
    for context in [int(c) for c in args.contexts.split(",")]:
        for b in [int(x) for x in args.batches.split(",")]:
            kq, vq = _packed(b, context, context + b, args.key_bits)
            q4_bytes = _bytes(kq) + _bytes(vq)
            sets = input_sets(kq, vq)
            q = mx.random.normal((b, HQ, 1, D), key=mx.random.key(1)).astype(mx.bfloat16)
            start = row_array([0] * b)  # as a batch cache holds it
            counters = q4sdpa.block_counters(q4sdpa.counters_for(b, HQ, HKV, 1))  # as pack_kv_into makes them: the
            mx.eval(counters)  # chained calls share them (an older module takes them as its unused `after`)
            inv_freq = rope_inv_freq()
            extra = dict(rotated=args.rotated, rope=(row_array([context - 1] * b), inv_freq)
                         if args.rope else None)
            mx.eval(sets, q)
            k16 = mx.dequantize(*kq, group_size=GROUP, bits=args.key_bits)
            v16 = mx.dequantize(*vq, group_size=GROUP, bits=4)
            fp16_bytes = k16.nbytes + v16.nbytes
            copies16 = max(1, min(8, -(-ROTATE_BYTES // fp16_bytes)))
            dense = [(k16, v16)] + [(k16 + 0, v16 + 0) for _ in range(copies16 - 1)]
            mx.eval(dense)
            sdpa = lambda x, k, v: mx.fast.scaled_dot_product_attention(x, k, v, scale=D ** -0.5)  # noqa: E731
            timed = [("q4sdpa", s, q4sdpa, errors[s]) for s in settings]
            timed += [(f"q4sdpa of {path}", default, module, old_errors[path]) for path, module in olds]
            fp16_runs, runs, failed = [], {i: [] for i in range(len(timed))}, {}
            for _ in range(args.repeat):  # every kernel once a round, so that a slow spell falls on all alike
                fp16_runs.append(chained_us(sdpa, dense, q))
                for i, (name, setting, module, err) in enumerate(timed):
                    if i in failed:
                        continue
                    use(setting)
                    try:
                        runs[i].append(chained_us(
                            lambda x, k, v, m=module: m.q4_decode_sdpa(x, (*k, counters), v, start, context,
                                                                       D ** -0.5, GROUP,
                                                                       **extra), sets, q))
                    except Exception as e:  # a launch setting the device refuses is reported, not fatal
                        failed[i] = e
            del dense, k16, v16
            fp16_us, fp16_busy, fp16_parts = median_timing(fp16_runs)
            base = dict(context=context, rows=b)
            rows.append(dict(base, kernel="mlx fused sdpa (bf16 K/V)", setting="-", us=fp16_us, x_fp16=1.0,
                             busy_us=fp16_busy, busy_x_fp16=1.0, kernels_us=fp16_parts,
                             GB_per_s=fp16_bytes / fp16_us / 1e3, max_err=""))
            for i, (name, setting, module, err) in enumerate(timed):
                if i in failed:
                    rows.append(dict(base, kernel=name, setting=setting_name(setting), us=f"failed: {failed[i]}"[:80]))
                    continue
                us, busy, parts = median_timing(runs[i])
                rows.append(dict(base, kernel=name, setting=setting_name(setting) if module is q4sdpa else "-",
                                 us=us, x_fp16=us / fp16_us, busy_us=busy, busy_x_fp16=busy / fp16_busy,
                                 kernels_us=parts, GB_per_s=q4_bytes / us / 1e3, max_err=err,
                                 bitwise_current="" if module is q4sdpa else same[name.removeprefix("q4sdpa of ")]))
            use(default)
            del sets
            print(f"context {context} rows {b} done", file=sys.stderr, flush=True)
    notes = (f"8B shape: {HQ} query heads, {HKV} kv heads, head dim {D}, group {GROUP}, {args.key_bits}-bit keys, "
             "4-bit values; one query per row; "
             + ("cache rotated (Hadamard in the kernels); " if args.rotated else "")
             + ("RoPE applied to the queries in the kernel; " if args.rope else "")
             + "setting = blocks per row and kv head / fewest keys per block / warps per block / tiles in flight a warp; x_fp16 = time over the fused bf16 "
             "kernel's; GB_per_s = the packed (or bf16) K/V bytes over the time; max_err against float32 on "
             "4 ragged rows at 3,000 columns; us: 40 calls chained (each call's queries are the previous call's output, so "
             f"they run one after another; the median of {args.repeat} such chains, every kernel once a round), "
             + ("the device's span per call, CUPTI; busy_us: the kernels' own durations per call (CUPTI), without "
                "the gaps where the device waited for the host." if DEVICE_TIMED
                else "wall time per call (host included)."))
    write_results(args.name or "q4sdpa_tune", env, rows, COLUMNS, args.out, notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
