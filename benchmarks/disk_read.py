"""How fast this machine's disk gives back a cache-sized file, by the way it is read.

A warm turn with the page cache dropped reads the agent's whole cache file first (740 MB at
16K tokens on the 8B shape), so the disk's rate bounds the warm TTFT. This writes a file of
--mb megabytes, then, with the page cache dropped before each (where this process may), reads
it: with one `read` into a buffer; through a memory map touched page by page (what a cache
load's copies do); through a map whose whole range was first asked for with MADV_WILLNEED
(the kernel reads ahead of the copies); and with several threads reading parts of it at once
(`os.pread`, which releases the GIL). GB/s each.

    python -m benchmarks.disk_read --mb 740
"""

from __future__ import annotations

import concurrent.futures
import mmap
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import bench_parser, environment, write_results
from benchmarks.ttft import drop_caches

COLUMNS = ["way", "gb_s", "seconds", "page_cache"]
PAGE = mmap.PAGESIZE


def _evict(path: Path) -> bool:
    """Ask the OS to drop `path`'s pages from the page cache (no root needed for a clean file); whether it could."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def read_once(path: Path) -> None:
    with open(path, "rb", buffering=0) as f:
        f.readinto(bytearray(os.fstat(f.fileno()).st_size))


def mapped(path: Path, willneed: bool) -> None:
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    if willneed:
        m.madvise(mmap.MADV_WILLNEED)
    data = np.frombuffer(m, np.uint8)
    out = np.empty(8 << 20, np.uint8)
    for at in range(0, data.size, out.size):  # copies of 8 MB, as a load's staging copies are
        n = min(out.size, data.size - at)
        out[:n] = data[at: at + n]
    del data
    m.close()


def threads(path: Path, n: int) -> None:
    size = path.stat().st_size
    part = -(-size // n // PAGE) * PAGE
    fd = os.open(path, os.O_RDONLY)
    try:
        with concurrent.futures.ThreadPoolExecutor(n) as pool:
            list(pool.map(lambda i: _pread_all(fd, i * part, min(part, size - i * part)), range(n)))
    finally:
        os.close(fd)


def _pread_all(fd: int, at: int, n: int) -> None:
    buf, done = bytearray(min(n, 8 << 20)), 0
    while done < n:
        got = os.preadv(fd, [memoryview(buf)[: min(len(buf), n - done)]], at + done)
        if not got:
            return
        done += got


WAYS = {"read": read_once, "mmap": lambda p: mapped(p, False), "mmap+willneed": lambda p: mapped(p, True),
        "4 threads": lambda p: threads(p, 4), "16 threads": lambda p: threads(p, 16)}


def main(argv=None):
    p = bench_parser(__doc__)
    p.add_argument("--mb", type=int, default=740, help="file size in MB")
    p.add_argument("--dir", default=None, help="folder for the file (default: the temp folder)")
    args = p.parse_args(argv)
    env = environment()
    print(env)
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        path = Path(tmp) / "file"
        path.write_bytes(np.random.default_rng(0).integers(0, 256, args.mb << 20, dtype=np.uint8).tobytes())
        os.sync()
        for way, fn in WAYS.items():
            dropped = drop_caches() or _evict(path)
            t0 = time.perf_counter()
            fn(path)
            s = time.perf_counter() - t0
            rows.append(dict(way=way, gb_s=round(path.stat().st_size / s / 1e9, 2), seconds=round(s, 3),
                             page_cache="dropped" if dropped else "kept"))
            print(rows[-1], flush=True)
    write_results(args.name or "disk_read", env, rows, COLUMNS, args.out,
                  f"a {args.mb} MB file in {args.dir or 'the temp folder'}; --model is not used.")


if __name__ == "__main__":
    main()
