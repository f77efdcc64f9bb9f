"""A fixed decode-attention workload for Nsight Compute: `q4sdpa` at each launch setting.

Runs `runtime.q4sdpa.q4_decode_sdpa` three times per setting (see `benchmarks.q4sdpa_tune`
for the setting format) on the 8B shape at one context and batch, each call evaluated on
its own, so a profiler can pick the launches it wants:

    ncu -k regex:kvactors_q4_decode_partial --launch-skip 2 --launch-count 1 \\
        --section LaunchStats --section Occupancy --section SpeedOfLight --section WarpStateStats \\
        python3 -m benchmarks.q4sdpa_ncu --context 32768 --rows 8 --settings 2048/4/4/16/4
"""

from __future__ import annotations

import argparse
import sys

import mlx.core as mx

from benchmarks.q4sdpa_tune import D, GROUP, HQ, _packed, _settings
from runtime import q4sdpa


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--settings", default="2048/4/4/16/4")
    args = parser.parse_args(argv)
    kq, vq = _packed(args.rows, args.context, 3)
    q = mx.random.normal((args.rows, HQ, 1, D), key=mx.random.key(1)).astype(mx.bfloat16)
    start = mx.zeros((args.rows,), dtype=mx.int32)
    for setting in _settings(args.settings):
        q4sdpa.CHUNK, q4sdpa.WARPS, q4sdpa.UNROLL, q4sdpa.EPL, q4sdpa.MAX_HEADS = setting
        for _ in range(3):
            mx.eval(q4sdpa.q4_decode_sdpa(q, kq, vq, start, args.context, D ** -0.5, GROUP))
    return 0


if __name__ == "__main__":
    sys.exit(main())
