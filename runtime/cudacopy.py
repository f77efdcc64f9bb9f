"""Copies between host and device by the GPU's copy engine on MLX-CUDA.

Asked for the bytes of a device array, MLX-CUDA moves its buffer into managed memory:
a fresh `cudaMallocManaged`, a synchronous `cudaMemcpy`, then the CPU reads the pages
(`mlx/backend/cuda/allocator.cpp`, `move_to_unified_memory`): about 1.1 GB/s for a
cache on an H100 while the engine decodes, against 1.5-2 GB/s this way
(`benchmarks/copy_interference.py`). Here a kernel copies the device bytes into a
buffer of its own output and reports that buffer's device address; the bytes then cross
by `cuMemcpyDtoHAsync` on a stream of our own into page-locked host memory, and on into
numpy. The calls go to the CUDA driver (MLX links its runtime in statically) in the
device's primary context, the one MLX's runtime uses; `available()` is False off CUDA
and callers keep MLX's own way.

The other way (`to_device`), MLX-CUDA makes an array from host bytes inside `mx.array`
with the GIL held: a fresh `cudaMallocManaged` and a copy that faults the managed pages
in one by one, then the GPU's first read migrates them. Here a kernel allocates one
device buffer and reports its address, numpy copies the bytes into page-locked memory
and `cuMemcpyHtoDAsync` moves them, both without the GIL.

`reserve_pool` has the device's default memory pool, which MLX-CUDA's buffers come from, keep
the memory it holds and a spare beyond what is in use: MLX caches freed buffers itself and asks
the pool only for sizes its cache has not seen (within 32 KB), and a pool with nothing spare maps
new memory for each (`cudaMallocAsync` 75-316 us a call on an H100: six at every hand-over of a
finished row, whose length is new each time, 160 at a growth of the batch's buffers).

This is the one place that calls CUDA directly.
"""

from __future__ import annotations

import ctypes
import functools
import threading

import mlx.core as mx
import numpy as np

from runtime.qgemv import cuda_kernel

STAGING_BYTES = 8 << 20  # page-locked bytes per copying thread; larger arrays cross in several copies
POOL_SPARE = 2 << 30  # device bytes `reserve_pool` has the memory pool hold beyond those in use, by default
_RELEASE_THRESHOLD = 4  # CU_MEMPOOL_ATTR_RELEASE_THRESHOLD
_NON_BLOCKING = 1  # CU_STREAM_NON_BLOCKING: no implicit order with MLX's streams
_DEVICE_ORDINAL = 9  # CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL

_SOURCE = """
    const size_t n = src_shape[0];
    const size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x, step = (size_t)gridDim.x * blockDim.x;
    size_t wide = 0;
    if ((reinterpret_cast<size_t>(src) & 15) == 0) {  // outputs are aligned; an input may be a view
        wide = n / 16;
        const uint4* s = reinterpret_cast<const uint4*>(src);
        uint4* d = reinterpret_cast<uint4*>(blob);
        for (size_t j = i; j < wide; j += step) d[j] = s[j];
    }
    for (size_t j = wide * 16 + i; j < n; j += step) blob[j] = src[j];
    if (i == 0) addr[0] = reinterpret_cast<unsigned long long>(blob);
"""
THREADS, BLOCKS = 256, 512
ALIGN = 256  # byte offset every array of `to_device` starts at a multiple of (the kernels' vector loads need 16)
MAX_BYTES = 1 << 30  # largest buffer `to_device` makes (MLX's shapes are int32: a 1-D buffer stays under 2 GiB)
_ADDRESS = "if (blockIdx.x == 0 && threadIdx.x == 0) addr[0] = reinterpret_cast<unsigned long long>(blob);"


@functools.cache
def _driver():
    """The CUDA driver library as a ctypes handle, or None off CUDA."""
    if not (mx.default_device() == mx.gpu and mx.cuda.is_available()):
        return None
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    lib.cuMemcpyDtoHAsync_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
    lib.cuMemcpyHtoDAsync_v2.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    lib.cuStreamSynchronize.argtypes = [ctypes.c_void_p]
    lib.cuCtxSetCurrent.argtypes = [ctypes.c_void_p]
    lib.cuPointerGetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64]
    lib.cuMemPoolSetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    lib.cuMemPoolGetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    lib.cuMemAllocFromPoolAsync.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p]
    lib.cuMemFreeAsync.argtypes = [ctypes.c_uint64, ctypes.c_void_p]
    lib.cuStreamDestroy_v2.argtypes = [ctypes.c_void_p]
    return lib if lib.cuInit(0) == 0 else None


def available() -> bool:
    """Whether `to_host` and `to_device` can copy here: MLX runs on a CUDA GPU and the CUDA driver library loads."""
    return _driver() is not None


def _check(code: int, what: str) -> None:
    if code:
        text = ctypes.c_char_p()
        _driver().cuGetErrorString(code, ctypes.byref(text))
        raise RuntimeError(f"{what} failed: {(text.value or b'unknown error').decode()} (CUDA error {code})")


def _make_current(device_ptr: int) -> tuple[ctypes.c_void_p, int]:
    """(the primary context, the ordinal) of the device that holds `device_ptr`, that context made current on this
    thread."""
    lib, ordinal = _driver(), ctypes.c_int()
    _check(lib.cuPointerGetAttribute(ctypes.byref(ordinal), _DEVICE_ORDINAL, device_ptr), "cuPointerGetAttribute")
    ctx = _context(ordinal.value)
    _check(lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    return ctx, ordinal.value


@functools.cache
def _context(ordinal: int) -> ctypes.c_void_p:
    """Device `ordinal`'s primary context: the one MLX's CUDA runtime uses."""
    lib, device, ctx = _driver(), ctypes.c_int(), ctypes.c_void_p()
    _check(lib.cuDeviceGet(ctypes.byref(device), ordinal), "cuDeviceGet")
    _check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), device), "cuDevicePrimaryCtxRetain")
    return ctx


@functools.cache
def _kernel():
    return cuda_kernel("kvactors_blob_address", ["src"], ["blob", "addr"], _SOURCE)


@functools.cache
def _allocator():
    return cuda_kernel("kvactors_device_blob", ["unused"], ["blob", "addr"], _ADDRESS)


class _Slot:
    """A stream of our own and a page-locked staging buffer, in one context: what one copy at a time uses."""

    def __init__(self, ctx):
        lib = _driver()
        self.ctx, self.stream, self.staging = ctx, ctypes.c_void_p(), ctypes.c_void_p()
        _check(lib.cuStreamCreate(ctypes.byref(self.stream), _NON_BLOCKING), "cuStreamCreate")
        _check(lib.cuMemAllocHost_v2(ctypes.byref(self.staging), ctypes.c_size_t(STAGING_BYTES)), "cuMemAllocHost")
        self.view = np.ctypeslib.as_array((ctypes.c_uint8 * STAGING_BYTES).from_address(self.staging.value))


_slots: list[_Slot] = []  # idle ones; at most as many as threads ever copied at once
_lock = threading.Lock()


def reserve_pool(spare: int = POOL_SPARE) -> bool:
    """Have the default memory pool of the device MLX runs on keep every byte it holds (none given back to the OS
    at synchronizations) and hold at least `spare` bytes beyond those in use, mapped now: allocations of sizes new
    to MLX's buffer cache are then carved from memory the pool holds instead of each mapping memory.

    A pool's release threshold counts the bytes it holds in use too, so only "keep everything" keeps a spare while
    MLX's cache holds the model and the caches. The pool then holds the process's peak until it ends: MLX releases
    its own cache on every new allocation once the pool holds 95% of the device, so an engine's use must stay below
    that (the default budgets, half the device for the batch's caches and an eighth for idle agents', leave room
    for the model and the activations). Returns False (and does nothing)
    where `available()` is not; raises RuntimeError if CUDA reports an error. Idempotent."""
    if not available():
        return False
    lib, pool = _mlx_pool()
    keep = ctypes.c_uint64(2 ** 64 - 1)
    _check(lib.cuMemPoolSetAttribute(pool, _RELEASE_THRESHOLD, ctypes.byref(keep)), "cuMemPoolSetAttribute")
    reserved, used = _pool_bytes(lib, pool)
    if reserved - used >= spare:
        return True
    stream, ptr = ctypes.c_void_p(), ctypes.c_uint64()
    _check(lib.cuStreamCreate(ctypes.byref(stream), _NON_BLOCKING), "cuStreamCreate")
    try:
        _check(lib.cuMemAllocFromPoolAsync(ctypes.byref(ptr), ctypes.c_size_t(spare), pool, stream),
               "cuMemAllocFromPoolAsync")
        _check(lib.cuMemFreeAsync(ptr, stream), "cuMemFreeAsync")
        _check(lib.cuStreamSynchronize(stream), "cuStreamSynchronize")
    finally:
        lib.cuStreamDestroy_v2(stream)
    return True


def pool_bytes() -> tuple[int, int]:
    """(reserved, used) bytes of the default memory pool of the device MLX runs on; (0, 0) where `available()`
    is not."""
    if not available():
        return 0, 0
    return _pool_bytes(*_mlx_pool())


def _pool_bytes(lib, pool) -> tuple[int, int]:
    out = []
    for attr in (5, 7):  # CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, CU_MEMPOOL_ATTR_USED_MEM_CURRENT
        value = ctypes.c_uint64()
        _check(lib.cuMemPoolGetAttribute(pool, attr, ctypes.byref(value)), "cuMemPoolGetAttribute")
        out.append(value.value)
    return out[0], out[1]


def _mlx_pool() -> tuple:
    """(the driver, the default memory pool of the device MLX's default stream runs on), that device's context
    made current on this thread."""
    lib, device, pool = _driver(), ctypes.c_int(), ctypes.c_void_p()
    _, addr = _allocator()(inputs=[mx.array(0, mx.uint8)], grid=(1, 1, 1), threadgroup=(1, 1, 1),
                           output_shapes=[(1,), (1,)], output_dtypes=[mx.uint8, mx.uint64])
    _, ordinal = _make_current(addr.item())
    _check(lib.cuDeviceGet(ctypes.byref(device), ordinal), "cuDeviceGet")
    _check(lib.cuDeviceGetDefaultMemPool(ctypes.byref(pool), device), "cuDeviceGetDefaultMemPool")
    return lib, pool


def to_host(x: mx.array, stream=None) -> np.ndarray:
    """The bytes of 1-D uint8 array `x` (lazy or evaluated, on the GPU) as a new numpy uint8 array.

    `x` and its copy into a buffer of this module's kernel are evaluated on `stream`
    (default: the default stream), so the copy waits only for work queued there; the
    bytes then cross to the host by the copy engine while the GIL is released. Raises
    RuntimeError if CUDA reports an error, ValueError for an array that is not 1-D uint8;
    call only where `available()`.
    """
    if x.ndim != 1 or x.dtype != mx.uint8:
        raise ValueError(f"to_host copies 1-D uint8 arrays; got {x.dtype} of shape {tuple(x.shape)}")
    n = x.size
    out = np.empty(n, np.uint8)
    if n == 0:
        return out
    blocks = max(1, min(BLOCKS, -(-n // (16 * THREADS))))
    # `blob` (a local, so held until this returns) is the buffer whose address the copies read
    blob, addr = _kernel()(inputs=[x], grid=(blocks * THREADS, 1, 1), threadgroup=(THREADS, 1, 1),
                           output_shapes=[(n,), (1,)], output_dtypes=[mx.uint8, mx.uint64], stream=stream)
    mx.eval(blob, addr)
    device_ptr, lib = addr.item(), _driver()
    slot = _take_slot(device_ptr)
    try:
        for at in range(0, n, STAGING_BYTES):
            size = min(STAGING_BYTES, n - at)
            _check(lib.cuMemcpyDtoHAsync_v2(slot.staging, device_ptr + at, size, slot.stream), "cuMemcpyDtoHAsync")
            _check(lib.cuStreamSynchronize(slot.stream), "cuStreamSynchronize")
            out[at: at + size] = slot.view[:size]
    finally:
        with _lock:
            _slots.append(slot)
    return out


def _take_slot(device_ptr: int) -> _Slot:
    """An idle `_Slot` in the context of the device that holds `device_ptr` (made if none), that context made
    current on this thread; give it back to `_slots` when done."""
    ctx, _ = _make_current(device_ptr)
    with _lock:
        slot = next((s for s in _slots if s.ctx.value == ctx.value), None)
        if slot is not None:
            _slots.remove(slot)
    return slot if slot is not None else _Slot(ctx)


def to_device(arrays: list, stream=None) -> tuple[mx.array, list[int]]:
    """The bytes of numpy arrays `arrays` in one new 1-D uint8 device array, evaluated, and where each begins.

    Array i's bytes (in C order) start at `offsets[i]`, a multiple of ALIGN, so a view of them
    (`blob[o : o + n].view(dtype).reshape(shape)`) is aligned for any kernel. The buffer
    is allocated by a kernel on `stream` (default: the default stream), so it waits only
    for work queued there; the bytes cross through page-locked memory by the copy engine
    (a transfer per STAGING_BYTES, on a stream of this module's own, waited for before
    this returns), and both copies run without the GIL. Raises ValueError if the arrays
    need more than MAX_BYTES together (`groups` splits them), RuntimeError if CUDA
    reports an error; call only where `available()`.
    """
    offsets, total = [], 0
    for a in arrays:
        offsets.append(_aligned(total))
        total = offsets[-1] + a.nbytes
    if total > MAX_BYTES:
        raise ValueError(f"to_device makes buffers of at most {MAX_BYTES} bytes; these arrays need {total}: "
                         "split them with cudacopy.groups")
    blob, addr = _allocator()(inputs=[mx.array(0, mx.uint8)], grid=(1, 1, 1), threadgroup=(1, 1, 1),
                              output_shapes=[(max(total, 1),), (1,)], output_dtypes=[mx.uint8, mx.uint64],
                              stream=stream)
    mx.eval(blob, addr)
    device_ptr = addr.item()
    slot = _take_slot(device_ptr)
    try:
        start, end = 0, 0  # the blob offset the staging buffer's first byte goes to; the bytes filled
        for a, at in zip(arrays, offsets):
            data = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
            done = 0
            while done < data.size:
                pos = at + done - start  # (the padding between arrays goes along, unused)
                if pos >= STAGING_BYTES:
                    _to_blob(slot, device_ptr + start, end)
                    start, end, pos = at + done, 0, 0
                n = min(data.size - done, STAGING_BYTES - pos)
                slot.view[pos: pos + n] = data[done: done + n]  # numpy copies without the GIL
                end, done = pos + n, done + n
        if end:
            _to_blob(slot, device_ptr + start, end)
    finally:
        with _lock:
            _slots.append(slot)
    return blob, offsets


def groups(sizes: list[int]) -> list[list[int]]:
    """The indices of arrays of `sizes` bytes, in order, cut into runs that each fit one `to_device` buffer
    (MAX_BYTES with every array at a multiple of ALIGN). Raises ValueError for an array larger than MAX_BYTES."""
    out, total = [[]], 0
    for i, n in enumerate(sizes):
        if n > MAX_BYTES:
            raise ValueError(f"an array of {n} bytes is larger than the {MAX_BYTES} bytes a buffer holds")
        start = _aligned(total)
        if out[-1] and start + n > MAX_BYTES:
            out.append([])
            start = 0
        out[-1].append(i)
        total = start + n
    return out if out[-1] else []


def _aligned(offset: int) -> int:
    """`offset` rounded up to a multiple of ALIGN: where `to_device` puts the array that follows it."""
    return -(-offset // ALIGN) * ALIGN


def _to_blob(slot: _Slot, device_ptr: int, n: int) -> None:
    """Copy the first `n` staging bytes of `slot` to `device_ptr` and wait for it (ctypes drops the GIL)."""
    lib = _driver()
    _check(lib.cuMemcpyHtoDAsync_v2(device_ptr, slot.staging, n, slot.stream), "cuMemcpyHtoDAsync")
    _check(lib.cuStreamSynchronize(slot.stream), "cuStreamSynchronize")
