"""What one call of a custom CUDA kernel costs the host, by how the kernel is handed to MLX.

A decode step calls `q4sdpa`'s kernel and `q4pack.pack_kv_into` 64 times outside
its compiled graphs, and MLX builds each such call's kernel source text anew: its
header, a signature, one constant per template argument, then the body
(`mlx/backend/cuda/custom_kernel.cpp`). This times, for the decode attention's kernel at the engine's decode shape (8B: 32 query heads, 8 kv heads, head dim 128, 6-bit
rotated keys, one query a row), the host microseconds per call, built alone (the Python
call, nothing evaluated) and built then launched (`mx.async_eval` of `--calls` independent
calls), for:

- template: the call as `q4sdpa` makes it (template arguments passed per call);
- baked: one kernel object per setting whose source starts with the constants the
  template arguments would make, called with no template arguments;
- baked, bare: the same with the comment lines of header and body left out;
- template, compact: as q4sdpa calls it, with header and body stripped of comments, indentation and blank
  lines (`compact`);
- template, padded: as q4sdpa calls it, with --pad characters of comment added to the body: with the compact
  variant, what each character of source costs a call;
- compiled: the call with its template arguments as an `mx.compile`d function of its inputs
  (`qgemv.compiled_launch`), which MLX records once and replays: how `q4sdpa` calls it now.

Every variant's attention output is checked bitwise against the first's.

    python -m benchmarks.kernel_call --rows 5 --context 3072      # CUDA
"""

from __future__ import annotations

import argparse
import itertools
import re
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

from benchmarks.common import RESULTS, environment, write_results
from runtime import q4sdpa
from runtime.q4cache import row_array
from runtime.qgemv import compiled_launch

COLUMNS = ["variant", "build_us", "build_launch_us", "source_chars", "same_output"]
HQ, HKV, D, GROUP = 32, 8, 128, 64
CUDA_TYPES = {mx.bfloat16: "__nv_bfloat16", mx.float16: "__half", mx.float32: "float", mx.int32: "int32_t",
              mx.uint32: "uint32_t"}  # the type MLX writes in a kernel's source for each dtype


def baked_source(source: str, template) -> str:
    """`source` with the constants MLX writes for `template` ((name, value) pairs) in front, as MLX writes them."""
    lines = []
    for name, value in template:
        if isinstance(value, mx.Dtype):
            lines.append(f"  using {name} = {CUDA_TYPES[value]};")
        elif isinstance(value, bool):
            lines.append(f"  constexpr bool {name} = {'true' if value else 'false'};")
        else:
            lines.append(f"  constexpr int {name} = {value};")
    return "\n".join(lines) + "\n\n" + source


def bare(text: str) -> str:
    """`text` without its whole-line `//` comments and trailing `//` comments (none sits inside a string literal)."""
    return "\n".join(line for line in (re.sub(r"\s*//.*$", "", s) for s in text.splitlines()) if line.strip())


def compact(text: str) -> str:
    """`text` without comments, indentation or blank lines (each line kept, for the preprocessor's sake)."""
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return "\n".join(line for line in (re.sub(r"//.*$", "", s).strip() for s in text.splitlines()) if line)


def _inputs(rows: int, context: int):
    key_bits = 6
    k = mx.random.normal((rows, HKV, context, D), key=mx.random.key(1)).astype(mx.bfloat16)
    v = mx.random.normal((rows, HKV, context, D), key=mx.random.key(2)).astype(mx.bfloat16)
    kq, vq = tuple(mx.quantize(k, GROUP, key_bits)), tuple(mx.quantize(v, GROUP, 4))
    q = mx.random.normal((rows, HQ, 1, D), key=mx.random.key(3)).astype(mx.bfloat16)
    start = row_array([0] * rows)  # as a batch cache holds it
    mx.eval(kq, vq, q, start)
    return q, kq, vq, start


def per_call_us(call, calls: int, launch: bool, repeats: int = 7) -> float:
    """Median over `repeats` of host microseconds per call for `calls` calls, built (and launched if `launch`)."""
    times = []
    for _ in range(repeats):
        mx.synchronize()
        t0 = time.perf_counter()
        outs = [call() for _ in range(calls)]
        if launch:
            mx.async_eval(outs)
        times.append((time.perf_counter() - t0) / calls * 1e6)
        mx.eval(outs)
    return statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=5)
    ap.add_argument("--context", type=int, default=3072)
    ap.add_argument("--calls", type=int, default=64, help="calls built (and launched) together (default: %(default)s)")
    ap.add_argument("--pad", type=int, default=50_000,
                    help="comment characters the padded variant adds (default: %(default)s)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--name", default="kernel_call")
    args = ap.parse_args(argv)
    q, kq, vq, start = _inputs(args.rows, args.context)
    end = args.context
    meta = q4sdpa.meta(end, 0, 1)
    key = (args.rows, HQ, 1, HKV, D, kq[0].shape[-1], vq[0].shape[-1], q.dtype, GROUP, D ** -0.5, True, False)
    kernel0, kernel_args, needed = q4sdpa.kernel(), q4sdpa.launch_arguments(*key), q4sdpa.counters_for(args.rows, HQ, HKV, 1)
    positions, inv_freq = q4sdpa._no_rope()
    # the calls launched together are independent, so each of them counts its blocks in zeros of its own
    counters = [q4sdpa.block_counters(needed) for _ in range(args.calls)]
    mx.eval(counters)
    turn = itertools.cycle(range(args.calls))
    inputs = [q, *kq, *vq, start, meta, None, positions, inv_freq]
    template = kernel_args["template"]
    launch = {k: v for k, v in kernel_args.items() if k != "template"}
    variants = {"template": (kernel0, kernel_args, len(q4sdpa._HEADER) + len(q4sdpa._KERNEL))}
    baked = baked_source(q4sdpa._KERNEL, template)
    padded = q4sdpa._KERNEL + "\n// " + "x" * args.pad + "\n"
    names, outputs = q4sdpa.KERNEL_NAMES
    for label, header, body, kw in (("baked", q4sdpa._HEADER, baked, launch),
                                    ("baked, bare", bare(q4sdpa._HEADER), bare(baked), launch),
                                    ("template, compact", compact(q4sdpa._HEADER), compact(q4sdpa._KERNEL),
                                     kernel_args),
                                    ("template, padded", q4sdpa._HEADER, padded, kernel_args)):
        kernel = mx.fast.cuda_kernel(name=f"kvactors_call_{label.replace(', ', '_')}", input_names=names,
                                     output_names=outputs, source=body, header=header, ensure_row_contiguous=True)
        variants[label] = (kernel, kw, len(header) + len(body))
    variants["compiled"] = (compiled_launch(kernel0, kernel_args), None, variants["template"][2])
    first = None
    rows = []
    for label, (kernel, kw, chars) in variants.items():
        def call(kernel=kernel, kw=kw):
            inputs[9] = counters[next(turn)]
            return kernel(*inputs) if kw is None else kernel(inputs=inputs, **kw)

        out = call()
        mx.eval(out)
        first = first or out
        same = mx.array_equal(out[3], first[3]).item()  # the attention's output: a chunk past a row's keys
        # leaves its slots of the partial sums (outputs 0-2) unwritten
        rows.append(dict(variant=label, build_us=per_call_us(call, args.calls, False),
                         build_launch_us=per_call_us(call, args.calls, True), source_chars=chars, same_output=same))
        print(rows[-1], file=sys.stderr, flush=True)
    notes = (f"q4sdpa's kernel at {args.rows} rows x {args.context} keys (8B shape, 6-bit rotated keys, one "
             f"query a row); host microseconds per call, the median of 7 rounds of {args.calls} calls: build_us the "
             "Python call alone (nothing evaluated), build_launch_us the calls then mx.async_eval of them all; "
             "source_chars: header and body as handed to MLX.")
    write_results(args.name, environment(), rows, COLUMNS, args.out, notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
