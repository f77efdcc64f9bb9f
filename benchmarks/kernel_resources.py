"""Compile decode attention's CUDA kernels (`runtime.q4sdpa`) with NVRTC, no GPU needed: errors, registers,
spills and shared memory per template.

MLX-CUDA compiles a `mx.fast.cuda_kernel` at its first call, on the GPU's machine. This
writes each kernel's source as MLX does (its default header, the module's header, the
signature, one constant per template argument, the body; `mlx/backend/cuda/custom_kernel.cpp`)
and compiles it for sm_90a with ptxas' report, so a change can be checked before a GPU
session. It needs NVRTC (`libnvrtc.so` of CUDA 13, as in the `nvidia-cuda-nvrtc` wheel),
the CUDA headers (the wheel's `include` folder has them) and MLX's device headers from
MLX's source tree (`mlx/backend/cuda/device/`, which the MLX wheel embeds instead of
shipping). A case is D/G/KEY_BITS/REP followed by flags: r (rotated), p (RoPE), f (prefill), t (the output
laid out (B, L, heads, D): `flat`).

    python -m benchmarks.kernel_resources --nvrtc .../nvidia/cu13/lib/libnvrtc.so.13 \\
        --include MLX_SOURCE --include .../nvidia/cu13/include --cases 128/64/6/4/rp,128/64/4/4

`--nvdisasm .../nvidia/cu13/bin/nvdisasm` (the `nvidia-cuda-nvdisasm` wheel) reads each kernel's machine
code as well and prints its instruction count and its largest loops by opcode: the kernel's key
loop is what a 16-key tile issues with every branch in it taken (an upper bound on a tile's count), the
figure to predict before a GPU session. `--module` compiles older copies of `runtime/q4sdpa.py` beside, and
`--qgemm FILES` the product kernel of `runtime/qgemm.py` (or copies of it: bf16, one weight, 64 rows).
(With the wheel's libnvrtc, NVRTC finds its builtins library only on LD_LIBRARY_PATH.)
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import mlx.core as mx

from benchmarks.kernel_call import CUDA_TYPES, baked_source
from benchmarks.q4sdpa_tune import load_copy
from runtime import q4sdpa

# the qgemm product kernel's template as `--qgemm` compiles it: bf16, group 64, 4 splits, 64 rows, plain layout
QGEMM_TEMPLATE = [("T", mx.bfloat16), ("G", 64), ("S", 4), ("MT", 8), ("HD", 0)]
_MLX_HEADER = '\n#include "mlx/backend/cuda/device/utils.cuh"\n\n#include <cooperative_groups.h>\n\n'
_DTYPES = {  # each input's and output's dtype, with T the queries' (qgemm's: the input's)
    "kw": mx.uint32, "vw": mx.uint32, "after": mx.uint32, "start": mx.int32, "meta": mx.int32, "pos": mx.int32,
    "inv_freq": mx.float32, "pm": mx.float32, "pl": mx.float32, "pacc": mx.float32,
    **{f"w{i}": mx.uint32 for i in range(3)}, **{f"part{i}": mx.float32 for i in range(3)},
}


def source(name: str, names, body: str, template, dtype, header: str = q4sdpa._HEADER) -> str:
    """Kernel `name`'s source as MLX writes it: inputs and outputs `names` ((inputs, outputs)), `body`, `template`
    ((name, value) pairs), the module's `header`; every array not in _DTYPES is of `dtype`. An input's shape,
    strides and ndim parameters are declared where the body uses them, as MLX declares them."""
    inputs, outputs = names
    lines = []
    for n in inputs:
        lines.append(f"    const {CUDA_TYPES[_DTYPES.get(n, dtype)]}* {n},")
        if re.search(rf"\b{n}_shape\b", body):
            lines.append(f"    const __grid_constant__ Shape {n}_shape,")
        if re.search(rf"\b{n}_strides\b", body):
            lines.append(f"    const __grid_constant__ Strides {n}_strides,")
        if re.search(rf"\b{n}_ndim\b", body):
            lines.append(f"    const __grid_constant__ int {n}_ndim,")
    lines += [f"    {CUDA_TYPES[_DTYPES.get(n, dtype)]}* {n}," for n in outputs]
    return (_MLX_HEADER + header + "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
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


def machine_code(listing: str) -> list[tuple[int, str]]:
    """(address, instruction) of each instruction in nvdisasm's listing, a branch's label target written as the
    address it labels (`BRA 0x1dd0`)."""
    code, labels, pending = [], {}, []
    for line in listing.splitlines():
        label = re.match(r"^(\.L_x_\d+):", line.strip())
        if label:
            pending.append(label.group(1))
            continue
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m:
            address = int(m.group(1), 16)
            labels.update((name, address) for name in pending)
            pending = []
            code.append((address, m.group(2)))
    return [(a, re.sub(r"`\((\.L_x_\d+)\)", lambda m: hex(labels.get(m.group(1), -1)), text)) for a, text in code]


def opcode(instruction: str) -> str:
    """An instruction's opcode with its modifiers, without its predicate."""
    return re.sub(r"^@!?U?P[T0-9]+\s+", "", instruction).split()[0]


def loops(code: list[tuple[int, str]]) -> list[tuple[int, int, list]]:
    """(first address, branch address, its instructions) of each loop (a branch back to an earlier address),
    largest first."""
    out = []
    for address, text in code:
        target = re.findall(r"0x([0-9a-f]+)", text) if opcode(text) == "BRA" else []
        if target and int(target[-1], 16) < address:
            first = int(target[-1], 16)
            out.append((first, address, [(a, t) for a, t in code if first <= a <= address]))
    return sorted(out, key=lambda loop: -len(loop[2]))


def code_report(listing: str, top: int = 2) -> str:
    """A kernel's instruction count and its `top` largest loops by opcode, from nvdisasm's listing."""
    code = machine_code(listing)
    lines = [f"{len(code)} instructions"]
    for first, last, body in loops(code)[:top]:
        counts = collections.Counter(opcode(text) for _, text in body)
        lines.append(f"loop {first:#x}-{last:#x}: {len(body)} instructions: "
                     + ", ".join(f"{op} {n}" for op, n in counts.most_common(20)))
    return "\n    ".join(lines)


def parse_case(text: str) -> dict:
    """'128/64/6/4/rp' -> the arguments of `q4sdpa.templates` (bf16 queries)."""
    d, g, bits, rep, *flags = text.split("/")
    flags = flags[0] if flags else ""
    return dict(dtype=mx.bfloat16, D=int(d), group_size=int(g), key_bits=int(bits), rep=int(rep),
                rotated="r" in flags, rope="p" in flags, prefill="f" in flags, flat="t" in flags)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nvrtc", required=True, help="path of libnvrtc.so (CUDA 13)")
    parser.add_argument("--include", action="append", default=[],
                        help="an include folder: MLX's source tree, the CUDA headers (repeat the option)")
    parser.add_argument("--cases", default="128/64/6/4/rp,128/64/6/4/r,128/64/4/4,128/64/6/4/rf,64/32/6/1/f",
                        help="comma-separated D/G/KEY_BITS/REP[/flags]: r rotated, p RoPE, f prefill, t flat output")
    parser.add_argument("--cubin", type=Path, default=None,
                        help="folder to write each kernel's cubin in (CASE-KERNEL.cubin, the case's / as -), "
                        "for nvdisasm's SASS")
    parser.add_argument("--nvdisasm", default="", help="path of nvdisasm: print each kernel's instruction count and "
                        "largest loops by opcode")
    parser.add_argument("--module", default="", help="older copies of runtime/q4sdpa.py to compile as well, "
                        "comma-separated")
    parser.add_argument("--qgemm", default="", help="copies of runtime/qgemm.py (runtime/qgemm.py itself among them, "
                        "if wanted) whose product kernel to compile, comma-separated: bf16, one weight, group 64, "
                        "64 rows (MT 8), S 4")
    args = parser.parse_args(argv)
    lib = ctypes.CDLL(args.nvrtc)
    failed = 0
    modules = [("", q4sdpa)] + [(Path(p).stem, load_copy(p)) for p in args.module.split(",") if p]
    for label, module in modules:
        for case in args.cases.split(","):
            tag = f"{label}:{case}" if label else case
            if hasattr(module, "_KERNEL"):
                text = source("kvactors_q4_decode", module.KERNEL_NAMES, module._KERNEL,
                              module.templates(**parse_case(case)), mx.bfloat16, module._HEADER)
                failed += _compiled(lib, text, tag, "kernel", args)
                continue
            partial, reduce = module.templates(**parse_case(case))  # a copy from before the kernels were one
            for name, names, body, template in (("partial", module.PARTIAL_NAMES, module._PARTIAL, partial),
                                                ("reduce", module.REDUCE_NAMES, module._REDUCE, reduce)):
                text = source(f"kvactors_q4_decode_{name}", names, body, template, mx.bfloat16, module._HEADER)
                failed += _compiled(lib, text, tag, name, args)
    for path in [p for p in args.qgemm.split(",") if p]:
        header, body, inputs, outputs = load_copy(path).product_kernel(1, 1)
        text = source("kvactors_qgemm", (inputs, outputs), body, QGEMM_TEMPLATE, mx.bfloat16, header)
        failed += _compiled(lib, text, Path(path).stem, "product", args)
    return 1 if failed else 0


def _compiled(lib, text: str, tag: str, name: str, args) -> int:
    """Compile kernel source `text` and print its line (`tag`, `name`, ptxas' figures; the cubin written and its
    machine code read where `args` ask): 1 if it did not compile, else 0."""
    ok, log, cubin = compile_report(lib, text, args.include)
    if args.cubin and ok:
        args.cubin.mkdir(parents=True, exist_ok=True)
        (args.cubin / f"{tag.replace('/', '-').replace(':', '-')}-{name}.cubin").write_bytes(cubin)
    stats = "; ".join(re.sub(r"^ptxas\s*(info\s*:|\.)\s*", "", line.strip()) for line in log.splitlines()
                      if "registers" in line or "spill" in line)
    print(f"{tag:18} {name:8} {'ok' if ok else 'FAILED'}  {stats}", flush=True)
    if not ok:
        print(log, flush=True)
        return 1
    if args.nvdisasm:
        print("    " + code_report(_disassemble(args.nvdisasm, cubin)), flush=True)
    return 0


def _disassemble(nvdisasm: str, cubin: bytes) -> str:
    """nvdisasm's listing of `cubin`."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([nvdisasm, f.name], capture_output=True, text=True, check=True).stdout


if __name__ == "__main__":
    sys.exit(main())
