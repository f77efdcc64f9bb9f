"""Compile decode attention's CUDA kernels (`runtime.q4sdpa`) with NVRTC, no GPU needed: errors, registers,
spills and shared memory per template.

MLX-CUDA compiles a `mx.fast.cuda_kernel` at its first call, on the GPU's machine. This
writes each kernel's source as MLX does (its default header, the module's header, the
signature, one constant per template argument, the body; `mlx/backend/cuda/custom_kernel.cpp`)
and compiles it for sm_90a with ptxas' report, so a change can be checked before a GPU
session. It needs NVRTC (`libnvrtc.so` of CUDA 13, as in the `nvidia-cuda-nvrtc` wheel),
the CUDA headers (the wheel's `include` folder has them) and MLX's device headers from
MLX's source tree (`mlx/backend/cuda/device/`, which the MLX wheel embeds instead of
shipping). A case is D/G/KEY_BITS/REP followed by flags: r (rotated), p (RoPE), f (prefill).

    python -m benchmarks.kernel_resources --nvrtc .../nvidia/cu13/lib/libnvrtc.so.13 \\
        --include MLX_SOURCE --include .../nvidia/cu13/include --cases 128/64/6/4/rp,128/64/4/4
"""

from __future__ import annotations

import argparse
import ctypes
import re
import sys
from pathlib import Path

import mlx.core as mx

from benchmarks.kernel_call import CUDA_TYPES, baked_source
from runtime import q4sdpa

_MLX_HEADER = '\n#include "mlx/backend/cuda/device/utils.cuh"\n\n#include <cooperative_groups.h>\n\n'
_DTYPES = {  # each input's and output's dtype, with T the queries'
    "kw": mx.uint32, "vw": mx.uint32, "after": mx.uint32, "start": mx.int32, "meta": mx.int32, "pos": mx.int32,
    "inv_freq": mx.float32, "pm": mx.float32, "pl": mx.float32, "pacc": mx.float32,
}


def source(name: str, names, body: str, template, dtype) -> str:
    """Kernel `name`'s source as MLX writes it: inputs and outputs `names` ((inputs, outputs)), `body`, `template`
    ((name, value) pairs); every array not in _DTYPES is of `dtype`. An input's shape parameter is declared where
    the body uses it, as MLX declares it."""
    inputs, outputs = names
    lines = []
    for n in inputs:
        lines.append(f"    const {CUDA_TYPES[_DTYPES.get(n, dtype)]}* {n},")
        if re.search(rf"\b{n}_shape\b", body):
            lines.append(f"    const __grid_constant__ Shape {n}_shape,")
    lines += [f"    {CUDA_TYPES[_DTYPES.get(n, dtype)]}* {n}," for n in outputs]
    return (_MLX_HEADER + q4sdpa._HEADER + "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
            + f"__global__ void {name}(\n" + "\n".join(lines)[:-1] + ") {\n" + baked_source(body, template)
            + "\n}\n\n} // namespace mlx::core::cu\n")


def compile_report(lib, text: str, includes) -> tuple[bool, str, bytes]:
    """(compiled, NVRTC's log: errors, or ptxas' registers, spills and shared memory, the cubin: b"" if it did not
    compile) of `text` for sm_90a."""
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), text.encode(), b"kernel.cu", 0, None, None):
        raise RuntimeError("nvrtcCreateProgram failed")
    try:
        opts = [b"--device-as-default-execution-space", b"--gpu-architecture=sm_90a", b"--ptxas-options=-v"]
        opts += [f"--include-path={p}".encode() for p in includes]
        ok = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts)) == 0
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        cubin = b""
        if ok:
            if lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)):
                raise RuntimeError("nvrtcGetCUBINSize failed")
            buf = ctypes.create_string_buffer(size.value)
            if lib.nvrtcGetCUBIN(prog, buf):
                raise RuntimeError("nvrtcGetCUBIN failed")
            cubin = buf.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return ok, log.value.decode(), cubin


def parse_case(text: str) -> dict:
    """'128/64/6/4/rp' -> the arguments of `q4sdpa.templates` (bf16 queries)."""
    d, g, bits, rep, *flags = text.split("/")
    flags = flags[0] if flags else ""
    return dict(dtype=mx.bfloat16, D=int(d), group_size=int(g), key_bits=int(bits), rep=int(rep),
                rotated="r" in flags, rope="p" in flags, prefill="f" in flags)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nvrtc", required=True, help="path of libnvrtc.so (CUDA 13)")
    parser.add_argument("--include", action="append", default=[],
                        help="an include folder: MLX's source tree, the CUDA headers (repeat the option)")
    parser.add_argument("--cases", default="128/64/6/4/rp,128/64/6/4/r,128/64/4/4,128/64/6/4/rf,64/32/6/1/f",
                        help="comma-separated D/G/KEY_BITS/REP[/flags]: r rotated, p RoPE, f prefill")
    parser.add_argument("--cubin", type=Path, default=None,
                        help="folder to write each kernel's cubin in (CASE-KERNEL.cubin, the case's / as -), "
                        "for nvdisasm's SASS")
    args = parser.parse_args(argv)
    lib = ctypes.CDLL(args.nvrtc)
    failed = 0
    for case in args.cases.split(","):
        partial, reduce = q4sdpa.templates(**parse_case(case))
        for name, names, body, template in (("partial", q4sdpa.PARTIAL_NAMES, q4sdpa._PARTIAL, partial),
                                            ("reduce", q4sdpa.REDUCE_NAMES, q4sdpa._REDUCE, reduce)):
            ok, log, cubin = compile_report(lib, source(f"kvactors_q4_decode_{name}", names, body, template,
                                                        mx.bfloat16), args.include)
            if args.cubin and ok:
                args.cubin.mkdir(parents=True, exist_ok=True)
                (args.cubin / f"{case.replace('/', '-')}-{name}.cubin").write_bytes(cubin)
            stats = "; ".join(re.sub(r"^ptxas\s*(info\s*:|\.)\s*", "", line.strip()) for line in log.splitlines()
                              if "registers" in line or "spill" in line)
            print(f"{case:18} {name:8} {'ok' if ok else 'FAILED'}  {stats}", flush=True)
            if not ok:
                failed += 1
                print(log, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
