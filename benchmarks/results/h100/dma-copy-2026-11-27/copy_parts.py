"""benchmarks.copy_interference with the copier's work cut down to one part: which part slows the engine's steps.

    python benchmarks/results/h100/dma-copy-2026-11-27/copy_parts.py VARIANT --model llama-8b-shape \
        --context 4096 --copy-tokens 2300 --steps 80 --rounds 2

VARIANT: gpu-only (the gather and the address kernel, evaluated; no bytes to the host), dma-only (the bytes
cross from one buffer made once; no MLX work in the copier), event (cudacopy as it is, its stream waits done
on a blocking-sync event instead of cuStreamSynchronize), python-only (only the copier's Python: the views
and the concatenates built, nothing evaluated). Run from the repository root with it on PYTHONPATH.
"""
import ctypes, sys, time
import mlx.core as mx, numpy as np
from runtime import cudacopy, hostcache
import benchmarks.copy_interference as ci

variant = sys.argv[1]
lib = cudacopy._driver()

if variant == "event":  # the copier sleeps on a blocking-sync event instead of spinning in cuStreamSynchronize
    def sync(stream):
        ev = ctypes.c_void_p(); lib.cuEventCreate(ctypes.byref(ev), 1 | 2)
        lib.cuEventRecord(ev, stream); r = lib.cuEventSynchronize(ev); lib.cuEventDestroy_v2(ev); return r
    lib.cuStreamSynchronize = sync
elif variant == "gpu-only":  # concatenate + our kernel + eval, no bytes to the host
    def to_host(x, stream=None):
        blob, addr = cudacopy._kernel()(inputs=[x], grid=(512 * 256, 1, 1), threadgroup=(256, 1, 1),
                                        output_shapes=[(x.size,), (1,)], output_dtypes=[mx.uint8, mx.uint64], stream=stream)
        mx.eval(blob, addr); addr.item()
        return np.zeros(x.size, np.uint8)
    cudacopy.to_host = to_host
elif variant == "dma-only":  # the bytes cross from one prepared buffer, no MLX work in the copier
    held = {}
    def to_host(x, stream=None):
        if x.size not in held:
            blob, addr = cudacopy._kernel()(inputs=[x], grid=(512 * 256, 1, 1), threadgroup=(256, 1, 1),
                                            output_shapes=[(x.size,), (1,)], output_dtypes=[mx.uint8, mx.uint64], stream=stream)
            mx.eval(blob, addr); held[x.size] = (blob, addr.item())
        blob, ptr = held[x.size]
        ctx = cudacopy._context(0); lib.cuCtxSetCurrent(ctx)
        slot = cudacopy._slots.pop() if cudacopy._slots else cudacopy._Slot(ctx)
        out = np.empty(x.size, np.uint8)
        for at in range(0, x.size, cudacopy.STAGING_BYTES):
            size = min(cudacopy.STAGING_BYTES, x.size - at)
            lib.cuMemcpyDtoHAsync_v2(slot.staging, ptr + at, size, slot.stream); lib.cuStreamSynchronize(slot.stream)
            out[at: at + size] = slot.view[:size]
        cudacopy._slots.append(slot)
        return out
    cudacopy.to_host = to_host
elif variant == "python-only":  # only the copier's Python: the views and the concatenate built, nothing evaluated
    def _to_numpy(arrays):
        for _ in range(13):
            g = mx.concatenate([a.reshape(-1).view(mx.uint8) for a in list(arrays.values())[:15]])
        return {n: np.zeros(a.shape, np.dtype(str(a.dtype).removeprefix("mlx.core."))) for n, a in arrays.items()}
    hostcache._to_numpy = _to_numpy
    time.sleep(0)
ci.main(sys.argv[2:])
