"""What identifying a model costs at load: the sampled fingerprint against the digest of every weight byte.

Builds (or reuses) the --model folder, then times in this one process, the weights in
the page cache as a load leaves them:

- fingerprint: config, tokenizer files and 17 sampled 64 KiB windows a weight file
  (`model.fingerprint`, the store's folder name);
- weights digest, first: every byte of the weight files, hashed in parallel pieces
  (`model.weights_digest`, which every cache names beside the fingerprint);
- weights digest, again: the same files unchanged (remembered for the process);
- load_model: the whole load (mlx-lm's load, the spec with both, preparation) with
  the digest remembered, twice (the first pays the process's first device work);
- load_model, digest forgotten: the same with the remembered digest dropped, so it
  is read again beside mlx-lm's load, as in a process's first load.

    python -m benchmarks.model_digest --model llama-8b-shape      # GPU host
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from benchmarks.common import bench_model_folder, bench_parser, environment, write_results

COLUMNS = ["piece", "s", "gb_per_s", "note"]


def timed(fn) -> tuple[float, object]:
    """(seconds, result) of one call of `fn`."""
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def main(argv=None) -> int:
    ap = bench_parser(__doc__)
    args = ap.parse_args(argv)
    env = environment()
    from runtime import model as model_module

    with tempfile.TemporaryDirectory() as tmp:
        path = bench_model_folder(args.model, Path(tmp))
        size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
        for f in path.glob("*.safetensors"):
            f.read_bytes()  # in the page cache, as a load leaves it
        rows = []
        s, _ = timed(lambda: model_module.fingerprint(path))
        rows.append(dict(piece="fingerprint", s=s, gb_per_s="", note="17 windows of 64 KiB a weight file"))
        s, _ = timed(lambda: model_module.weights_digest(path))
        rows.append(dict(piece="weights digest, first", s=s, gb_per_s=size / s / 1e9,
                         note=f"{size / 1e9:.2f} GB of weights"))
        s, _ = timed(lambda: model_module.weights_digest(path))
        rows.append(dict(piece="weights digest, again", s=s, gb_per_s="", note="remembered for the process"))
        s, _ = timed(lambda: model_module.load_model(path))
        rows.append(dict(piece="load_model", s=s, gb_per_s="", note="the digest remembered"))
        s, _ = timed(lambda: model_module.load_model(path))
        rows.append(dict(piece="load_model, again", s=s, gb_per_s="", note="the digest remembered"))
        model_module._digests.clear()
        s, _ = timed(lambda: model_module.load_model(path))
        rows.append(dict(piece="load_model, digest forgotten", s=s, gb_per_s="",
                         note="the digest read beside mlx-lm's load, as a process's first load does"))
    write_results(args.name or f"model_digest-{args.model}", env, rows, COLUMNS, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
