"""The store's folders and files: layout, agent ids, atomic writes, the `cache_dir` lock.

Layout, one folder per (model fingerprint, agent id), folders 0700, files 0600::

    cache_dir/<fingerprint>/<agent>/cache.safetensors   Q4 cache of the used tokens + metadata
    cache_dir/<fingerprint>/<agent>/cache.<k>.delta.safetensors   rows added since (k = 1, 2, ...)
    cache_dir/<fingerprint>/<agent>/journal.msgpack     append-only record of every turn
    cache_dir/<fingerprint>/<agent>/journal.seq         the highest seq ever appended (16 bytes, rewritten in place)
    cache_dir/<fingerprint>/model.json                  {"model_id": ...}: which model made the folder

Every write of a whole file goes to a temp file in the same folder, is fsynced,
renamed over the old file, and the folder is fsynced (`write_atomic`): after a crash
each file is the previous or the new complete version. One process writes a cache
folder at a time (`lock_cache_dir`). No file or folder inside `cache_dir` is followed
as a symlink: files are opened with O_NOFOLLOW, folders are checked (`refuse_links`).
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import mmap
import os
import re
import secrets
import stat
from pathlib import Path

from runtime.errors import KvactorsError

CACHE_FILE = "cache.safetensors"
DELTA_FILE = "cache.{}.delta.safetensors"  # k = 1, 2, ...: the rows turn after turn added
JOURNAL_FILE = "journal.msgpack"
HIGH_FILE = "journal.seq"  # the journal's high-water mark: seqs at or below it are never used again
MODEL_FILE = "model.json"  # in a fingerprint folder: the model id it was made by (for people: see inspect)
AGENT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
FINGERPRINT = re.compile(r"[A-Za-z0-9_-]{1,128}")  # a model folder's name (no dot: see cacheformat.model_tag)
_TMP_SUFFIX = ".tmp"


class InvalidAgentId(KvactorsError, ValueError):
    """An agent id that is not `[A-Za-z0-9][A-Za-z0-9._-]{0,127}`, or one that differs only in case from a running
    or stored agent's, `twin` (else None).

    `detail` is the message without its advice on what to call next (an HTTP server words its own).
    """

    def __init__(self, message: str, advice: str = "", twin: str | None = None):
        super().__init__(message + advice)
        self.detail, self.twin = message, twin


class UnsafePath(KvactorsError, OSError):
    """A symlink inside the store: kvactors never follows one there. Remove the link."""


class NotAFolder(KvactorsError, NotADirectoryError):
    """A cache_dir names a file (or a path under one), where a folder should be."""


class CacheDirInUse(KvactorsError, RuntimeError):
    """Another Runtime (in this or another process) is using the cache folder."""


class AgentInUse(KvactorsError, RuntimeError):
    """Another process sharing the cache folder (a node of the same cluster) runs this agent.

    One live actor per agent name: stop it there (or let its node die) first.
    """


def check_agent_id(agent: str) -> str:
    """Return `agent` if it is a valid id (`[A-Za-z0-9][A-Za-z0-9._-]{0,127}`, not MODEL_FILE's name in any case:
    that file lies beside the agent folders, and a case-insensitive file system takes MODEL.json for it), else
    raise InvalidAgentId."""
    if not isinstance(agent, str) or not AGENT_ID.fullmatch(agent):
        raise InvalidAgentId(
            f"invalid agent id {agent!r}: use 1-128 characters from A-Z a-z 0-9 . _ -, starting with a letter or digit"
        )
    if agent.lower() == MODEL_FILE:  # ids are ASCII: lower() is the case folding of every file system
        raise InvalidAgentId(f"invalid agent id {agent!r}: the store keeps a file named {MODEL_FILE!r} beside the "
                             "agents' folders (a case-insensitive file system takes the two for one); choose another "
                             "name")
    return agent


def agent_dir(cache_dir, fingerprint: str, agent: str) -> Path:
    """The folder of `agent`'s files under model `fingerprint` (validates both; creates nothing)."""
    if not isinstance(fingerprint, str) or not FINGERPRINT.fullmatch(fingerprint):
        raise ValueError(f"invalid model fingerprint {fingerprint!r}")
    return Path(cache_dir).expanduser() / fingerprint / check_agent_id(agent)


def lock_cache_dir(cache_dir, shared: bool = False) -> int:
    """Take the exclusive lock of `cache_dir` (created 0700); return the fd that holds it.

    Two writers would interleave journal appends: a second Runtime on the same folder
    raises CacheDirInUse instead. The lock is on the folder itself, not on a file in
    it, so deleting files cannot release it. Release with `os.close(fd)`; a crash
    releases it too. `shared=True` takes it shared instead, for the processes that
    share the folder and lock each agent (`lock_agent`): they exclude a Runtime of one
    machine, and it excludes them.
    """
    import fcntl

    root = Path(cache_dir).expanduser()
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise CacheDirInUse(
            f"{root} is in use by another Runtime; shut that one down or use another cache_dir"
        ) from None
    return fd


def lock_agent(cache_dir, fingerprint: str, agent: str) -> int:
    """Take the exclusive lock of `agent` under model `fingerprint`; return the fd that holds it.

    For processes that share one cache folder (the nodes of a cluster), each holding
    some of its agents: at most one of them runs a given agent, so its journal has one
    writer. The lock is a file `cache_dir/.locks/<fingerprint>/<agent>.lock` (0600), kept
    out of the agent folders so that deleting an agent's files cannot release it.
    Raises AgentInUse while another process holds it. Release with `os.close(fd)`;
    a crash (or the death of the node) releases it too, where the file system's
    `flock` is shared by the processes (local disks; NFS v4 and most cluster file
    systems emulate it).
    """
    import fcntl

    check_agent_id(agent)
    if not FINGERPRINT.fullmatch(fingerprint or ""):
        raise ValueError(f"invalid model fingerprint {fingerprint!r}")
    folder = Path(cache_dir).expanduser() / ".locks" / fingerprint
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = open_file(folder / f"{agent}.lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise AgentInUse(f"agent {agent!r} is running in another process on {cache_dir}; stop it there "
                         "first (one live actor per agent name)") from None
    return fd


def refuse_links(folder: Path) -> None:
    """Raise UnsafePath if the agent folder `folder` or its model folder is a symlink.

    `cache_dir` itself may be a link (the user's choice); nothing inside it may: files
    are opened with O_NOFOLLOW, folders are checked here.
    """
    for d in (folder.parent, folder):
        if d.is_symlink():
            raise UnsafePath(f"{d} is a symlink inside the store; kvactors never follows one there: remove it")


def make_dirs(folder: Path) -> list[Path]:
    """Create `folder` and its two parents (model folder, cache_dir) as needed, mode 0700 (cache_dir's own
    parents as `mkdir -p` makes them); return the folders this call created, outermost first, for `remove_empty`
    to remove again where the write they were made for fails.

    Raises UnsafePath if the model or agent folder is a symlink.
    """
    refuse_links(folder)
    made = make_missing(folder.parent.parent.parent)
    for d in (folder.parent.parent, folder.parent, folder):
        if not d.is_dir():
            made += make_missing(d, 0o700)
            os.chmod(d, 0o700)
    return made


def make_missing(folder: Path, mode: int = 0o777) -> list[Path]:
    """Create `folder` and those of its parents that are missing, each with `mode` (less the umask), as
    `mkdir -p` does; return the folders this call created, outermost first (one another process made meanwhile
    is not among them). FileExistsError where a file (or a link) is in the way. A folder on the way that another
    process removes meanwhile (a failed write's `remove_empty`) is made again."""
    made = []
    while True:
        missing = list(itertools.takewhile(lambda d: not d.is_dir(), (folder, *folder.parents)))
        for d in reversed(missing):
            try:
                d.mkdir(mode)
            except FileExistsError:
                if d.is_dir():
                    continue  # another made it
                if os.path.lexists(d):
                    raise
                break  # there at the mkdir, gone at this check: removed meanwhile, start over
            except FileNotFoundError:
                break  # a folder above it removed meanwhile: start over
            made.append(d)
        else:
            return made


def remove_empty(folders: list[Path]) -> None:
    """Remove those of `folders` (outermost first, as `make_missing` returns them) that are empty, innermost first,
    so that a failed write leaves none of the folders made for it; one that holds anything, or cannot be removed,
    stays."""
    for d in reversed(folders):
        with contextlib.suppress(OSError):
            d.rmdir()


@contextlib.contextmanager
def removed_if_failed(folders: list[Path]):
    """Run the block; if it raises, `remove_empty(folders)` (the folders made for it) before the error goes on."""
    try:
        yield
    except BaseException:
        remove_empty(folders)
        raise


def temp_path(path: Path) -> Path:
    """A fresh temp file name next to `path` (same folder, so the rename is atomic)."""
    return path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}{_TMP_SUFFIX}")


def open_file(path, flags: int, mode: int = 0o600) -> int:
    """`os.open` of a file in the store: never through a symlink, and only a regular file.

    Anything else (a named pipe, a device, a folder) raises OSError (EINVAL, "not a regular
    file") at once: it is opened non-blocking, so a pipe with no writer cannot stall the
    caller (the one persistence actor that serves every agent); the fd returned blocks as usual.
    """
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK, mode)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def own_file(path: Path) -> None:
    """Make the file at `path` its folder's alone: one with other hard links (a folder copied with `cp -al`, a
    backup that keeps links) is replaced by a copy (`write_atomic`), since files rewritten in place (the journal,
    its mark) would otherwise be written by two agents. A missing file is left missing."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
        write_atomic(path, read_file(path))


def open_private(path, flags: int) -> int:
    """`os.open` that creates files with mode exactly 0600 (an `opener` for `open`)."""
    fd = os.open(path, flags, 0o600)
    if flags & os.O_CREAT:
        os.fchmod(fd, 0o600)
    return fd


def fsync_dir(folder) -> None:
    """fsync a folder, making renames and new files in it durable."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(folder) -> None:
    """fsync every file and folder under `folder`, then `folder` itself: what was written into it is on disk,
    so that a rename of `folder` that follows (then `fsync_dir` of its parent) never names partial files.

    Files are opened as `open_file` opens them: a symlink or a file that is not regular raises OSError.
    """
    for root, _, names in os.walk(folder, topdown=False):
        for name in names:
            fd = open_file(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(root)


def write_atomic(path: Path, data) -> None:
    """Replace `path` by `data`: temp file in the same folder, fsync, rename, fsync the folder.

    `data` is bytes-like, or a list of bytes-like parts written in order (each handed
    to the OS as it is: large writes release the GIL).
    """
    tmp = temp_path(path)
    try:
        with open(tmp, "xb", opener=open_private) as f:
            for part in data if isinstance(data, list) else [data]:
                f.write(part)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def remove_temps(folder: Path) -> None:
    """Delete temp files a crashed writer left in `folder` (one writer per folder).

    kvactors makes temp files only: a folder of a temp file's name is not its own and is left alone.
    """
    for p in folder.glob(f".*{_TMP_SUFFIX}"):
        if p.is_symlink() or not p.is_dir():
            p.unlink(missing_ok=True)


def read_file(path: Path) -> bytearray:
    """The whole file at `path` in one buffer (one read, no extra copy)."""
    with open(open_file(path, os.O_RDONLY), "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        buf = bytearray(size)
        view, got = memoryview(buf), 0
        while got < size:
            n = f.readinto(view[got:])
            if not n:
                break
            got += n
    return buf[:got] if got < size else buf


def map_file(path: Path):
    """The bytes of the file at `path`, memory-mapped read-only (no copy out of the page cache).

    The returned tensors of `decode_cache` are views into the mapping; it stays open
    while any of them is alive. Files are replaced by rename, never rewritten in
    place, so a mapping always sees one complete version.
    """
    with open(open_file(path, os.O_RDONLY), "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return b""
        return memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
