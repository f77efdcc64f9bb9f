"""An agent's journal: the append-only record of its turns, the source of truth for its history.

`journal.msgpack` starts with `JOURNAL_MAGIC`, then one frame per record:
little-endian u32 payload length, u32 crc32 of the payload, payload = a msgpack map
(seq, turn_id, role, sender, text, time; an agent's records also name the seq that
started their conversation, `conv`, and carry its system prompt's `prompt_check`,
`check`); seqs rise strictly. Reading resynchronises on the frames past damaged
bytes (a damaged magic included) and keeps every record that checks (`scan_journal`),
in time linear in the file; an incomplete or damaged
last frame is a torn tail (a crash in the middle of an append). Opening the journal for appends (`open_journal`) moves a torn tail aside to
`journal.torn-<time>`; mid-file or header damage keeps the whole damaged file as
`journal.damaged-<time>` and rewrites the journal from its good frames. An append
that fails (a full disk) cuts the file back to its last good frame before raising
(`append_frames`). The cache only accelerates; the journal is what an agent's history is.

Beside it, `journal.seq` holds the journal's high-water mark: the highest seq ever
appended (`record_high_seq`, written with each append, before the append is
acknowledged; `high_seq` reads it). A journal whose tail was cut exactly between
frames reads as a shorter, undamaged journal; the mark is what says records were
lost, and it keeps their seqs from being used again.
"""

from __future__ import annotations

import bisect
import errno
import os
import re
import struct
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import msgpack

from runtime.errors import KvactorsError
from runtime.files import (HIGH_FILE, JOURNAL_FILE, agent_dir, make_dirs, open_file, own_file, refuse_links,
                           remove_temps, removed_if_failed, write_atomic)

JOURNAL_MAGIC = b"kvactors-journal-1\n"
_FRAME = struct.Struct("<II")
_HIGH = struct.Struct("<4sqI")  # magic, seq, crc32 of the 12 bytes before: 16 bytes, within one disk sector
_HIGH_MAGIC = b"kvhs"


class JournalError(KvactorsError, OSError):
    """A journal that cannot be read at all (another format, no permission); it is left untouched. An OSError: a
    file's problem.

    The agent it belongs to cannot work until the file is fixed or moved aside; other
    agents are not affected.
    """


def journal_record(
    seq: int, role: str, text: str, *, turn_id: str | None = None, sender: str | None = None, **extra
) -> dict:
    """A journal record (a plain dict, msgpack-ready) for one turn; `time` is now if not given."""
    record = {"seq": int(seq), "turn_id": turn_id, "role": role, "sender": sender, "text": text, "time": time.time()}
    record.update(extra)
    check_record(record)
    return record


_OPTIONAL = {"turn_id": str, "conv": int, "check": int, "tokens": list, "finish_reason": str,
             "upto": int}  # when present and set


def check_record(record: dict) -> None:
    """Raise ValueError unless `record` has an int `seq`, str `role` and str `text`, and the fields the runtime
    reads back have their types where set (`turn_id` str, `conv`, `check` and `upto` int, `tokens` list,
    `finish_reason` str). A frame whose record fails this is damage, as one whose CRC fails. `upto`, on the first
    record of an append of several (a reset's system record), is the seq of the append's last record."""
    if not isinstance(record, dict):
        raise ValueError(f"a journal record is a dict, got {type(record).__name__}")
    seq, role, text = record.get("seq"), record.get("role"), record.get("text")
    if not (isinstance(seq, int) and isinstance(role, str) and isinstance(text, str)):
        raise ValueError(f"journal record needs int seq, str role and str text: {record!r:.200}")
    for key, kind in _OPTIONAL.items():
        value = record.get(key)
        if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
            raise ValueError(f"journal record's {key} must be a {kind.__name__}, got {type(value).__name__}: "
                             f"{record!r:.200}")


def encode_records(records) -> bytes:
    """The journal frames of `records` (each checked by `check_record`), ready to append.

    Each payload is a msgpack map whose first key is "seq" (`journal_record` makes them so; others are
    reordered), which lets a reader find frames again past damaged bytes without trying every byte.
    """
    out = bytearray()
    for r in records:
        check_record(r)
        payload = msgpack.packb({"seq": r["seq"], **r}, use_bin_type=True)  # seq first: what `_resync` looks for
        out += _FRAME.pack(len(payload), zlib.crc32(payload)) + payload
    return bytes(out)


@dataclass(frozen=True)
class JournalScan:
    """What the bytes of a journal hold.

    `records`: every record whose frame checks, oldest first, seqs strictly rising;
    `frames`: their (start, stop) byte spans; `end`: where the last good frame ends
    (where the next append goes); `damaged`: (start, stop) spans between good frames
    that did not check (mid-file damage: records were lost there); `size`: bytes
    scanned; `header_damaged`: the file did not start with JOURNAL_MAGIC, yet good
    frames follow (their records are kept; the header is rewritten on repair). Bytes
    from `end` to `size` are a torn tail (an append cut short).
    """

    records: list
    frames: list
    end: int
    damaged: list
    size: int
    header_damaged: bool = False

    @property
    def needs_repair(self) -> bool:
        """Whether `repair_journal` has anything to do: damage, a torn tail, a header to rewrite or to write."""
        return bool(self.rewritten or self.torn or self.end < len(JOURNAL_MAGIC))

    @property
    def rewritten(self) -> bool:
        """Whether `repair_journal` rewrites the journal from its good frames, keeping the whole file as
        journal.damaged-* (mid-file damage or a damaged header), rather than cutting a torn tail off alone."""
        return bool(self.damaged or self.header_damaged)

    @property
    def last_seq(self) -> int:
        """The seq of the last good record, -1 if none."""
        return self.records[-1]["seq"] if self.records else -1

    @property
    def torn(self) -> int:
        """Bytes of the torn tail."""
        return self.size - self.end

    def losses(self) -> list[str]:
        """One line per damaged span: where, how many bytes, between which seqs records were lost (and one for a
        damaged header, where none were)."""
        out = []
        if self.header_damaged:
            out.append(f"the header (first {len(JOURNAL_MAGIC)} B) was unreadable and is rewritten")
        for start, stop in self.damaged:
            before = [r["seq"] for r, (_, e) in zip(self.records, self.frames) if e <= start]
            after = [r["seq"] for r, (s, _) in zip(self.records, self.frames) if s >= stop]
            upto = f"seq {after[0]}" if after else "the end"
            between = f"after seq {before[-1] if before else 'start'} and before {upto}"
            out.append(f"bytes {start}..{stop} ({stop - start} B) unreadable: records {between} lost")
        return out


def _frame_at(view: memoryview, pos: int):
    """(record, end) of a frame that checks at `pos`, else None."""
    if pos + _FRAME.size > len(view):
        return None
    n, crc = _FRAME.unpack_from(view, pos)
    stop = pos + _FRAME.size + n
    if n == 0 or stop > len(view):
        return None
    payload = view[pos + _FRAME.size : stop]
    if zlib.crc32(payload) != crc:
        return None
    try:
        record = msgpack.unpackb(payload, raw=False)
        check_record(record)
    except (ValueError, TypeError, msgpack.UnpackException):
        return None
    return record, stop


_SEQ_KEY = re.compile(re.escape(msgpack.packb("seq")))  # a frame's payload starts with a map whose first key is "seq"
_MAP_HEADS = ((5, (0xDF,)), (3, (0xDE,)), (1, range(0x80, 0x90)))  # map 32, map 16, fixmap: (bytes, first byte)
_NEWER = re.compile(rb"kvactors-journal-([0-9]+)\n")


def _resync(view: memoryview, pos: int):
    """The first position from `pos` on where a good frame starts, or None.

    Only places where a payload's first key "seq" follows a map header are tried (`encode_records` puts it
    first), so garbage costs time linear in its length: a random length field is not checked by CRC at every byte.
    """
    for key in _SEQ_KEY.finditer(view, pos + _FRAME.size + 1):
        for size, firsts in _MAP_HEADS:
            p = key.start() - size - _FRAME.size
            if p >= pos and view[p + _FRAME.size] in firsts and _frame_at(view, p) is not None:
                return p
    return None


def _past_damaged_header(view: memoryview) -> int:
    """Where the first good frame starts in journal bytes that do not start with JOURNAL_MAGIC (a damaged header).

    A newer journal version (the magic with a higher number) or bytes with no good frame in them are another
    format: JournalError, and they are left untouched.
    """
    newer = _NEWER.match(view)
    if newer and int(newer.group(1)) > 1:
        raise JournalError(f"a newer journal version ({int(newer.group(1))}) than this kvactors reads (1); it is left "
                           "untouched: upgrade kvactors, or move it aside")
    pos = _resync(view, 0)
    if pos is None:
        raise JournalError("not a kvactors journal (bad magic bytes and no record in it); it is left untouched: "
                           "move it aside")
    return pos


def scan_journal(data, acknowledged: int | None = None) -> JournalScan:
    """Decode journal bytes, resynchronising on the length+CRC frames past damaged bytes.

    An append that the journal's last good frames start but do not finish (`_unfinished_append`) goes with the
    torn tail, unless `acknowledged` (the journal's high-water mark, `high_seq`) says it was acknowledged: then
    its records that landed stay, and the mark reports the rest as lost. Where the mark is known, damage past
    the last acknowledged frame starts the torn tail, good frames after it included (`_damage_past`): they were
    never acknowledged.

    A damaged frame followed by good ones is mid-file damage: the good ones are kept
    and the span is reported in `damaged`; a damaged or incomplete frame with no good
    one after it is the torn tail. Frames that check but whose seqs break the rising
    order are damage too, the fewest possible (`_rising`). A file that does not start with JOURNAL_MAGIC but
    holds good frames has a damaged header (`header_damaged`; the bytes before its
    first good frame past the header's length are reported in `damaged`). Raises
    JournalError for a newer journal version or bytes with no good frame that do not
    start with JOURNAL_MAGIC (empty, or a prefix of the magic, is a journal whose
    creation was cut short). Time is linear in the bytes.
    """
    view = memoryview(data)
    if len(view) < len(JOURNAL_MAGIC) and bytes(view) == JOURNAL_MAGIC[: len(view)]:
        return JournalScan([], [], 0, [], len(view))  # creation was cut short: nothing was ever recorded
    header = bytes(view[: len(JOURNAL_MAGIC)]) != JOURNAL_MAGIC
    pos = _past_damaged_header(view) if header else len(JOURNAL_MAGIC)
    first = pos  # where frames start: a damaged header's bytes before it are no lost records
    records, frames, damaged = [], [], [(len(JOURNAL_MAGIC), pos)] if pos > len(JOURNAL_MAGIC) else []
    while pos < len(view):
        found = _frame_at(view, pos)
        if found is None:
            nxt = _resync(view, pos + 1)
            if nxt is None:
                break  # a torn tail
            damaged.append((pos, nxt))
            pos = nxt
            continue
        record, stop = found
        records.append(record)
        frames.append((pos, stop))
        pos = stop
    kept = _rising([r["seq"] for r in records])
    damaged = _merged(damaged + [f for i, f in enumerate(frames) if i not in kept])
    records, frames = [records[i] for i in sorted(kept)], [frames[i] for i in sorted(kept)]
    if acknowledged is not None:
        torn = _damage_past(records, frames, [d for d in damaged if d[0] >= first], acknowledged)
        if torn is not None:  # what follows was never acknowledged: it goes with the damage, as a torn tail
            pos, n = torn
            records, frames = records[:n], frames[:n]
    while True:
        pos = min(pos, frames[-1][1] if frames else first)  # damage or dropped frames past the last kept one: torn
        cut = _unfinished_append(records, frames, pos, -1 if acknowledged is None else acknowledged)
        if cut is None:
            break
        # an append is acknowledged once all its records are on disk: one the journal ends inside (a turn's user
        # record without its reply, a reset's system record without all its records), whether the cut fell inside
        # a frame or right between two, goes with the torn tail (else a retry would repeat it, or a reset leave
        # half a conversation)
        pos = frames[cut][0]
        records, frames = records[:cut], frames[:cut]
    damaged = [d for d in damaged if d[0] < pos]  # spans in the torn tail are the tail's, not mid-file losses
    return JournalScan(records, frames, pos, damaged, len(view), header)


def _damage_past(records: list, frames: list, damaged: list, acknowledged: int) -> tuple[int, int] | None:
    """(The start of the first `damaged` span past the last frame acknowledged (seq up to `acknowledged`), the
    number of records before it) where the good frames after it are one append's at most, or None.

    Only the journal's last append can be unacknowledged, and only its pages can have reached the disk out of
    order (those before it were fsynced before they were acknowledged): a later frame landed, an earlier one did
    not, which would otherwise leave, say, a turn's reply without its user record, kept past mid-file damage.
    Such a tail goes whole, as a torn append does. More than one append after the damage means the mark is behind
    (a mark that could not be written does not stop acknowledgements): that is mid-file damage, as before.
    """
    acked = bisect.bisect_right([r["seq"] for r in records], acknowledged)
    start = frames[acked - 1][1] if acked else 0
    at = next((a for a, _ in damaged if a >= start), None)
    if at is None:
        return None
    n = bisect.bisect_left([s for s, _ in frames], at)
    after = records[n:]
    return (at, n) if not after or all(r["seq"] <= _append_reaches(after[0]) for r in after) else None


def _unfinished_append(records: list, frames: list, pos: int, acknowledged: int) -> int | None:
    """The index of the first record of an append that the journal's last good frames (contiguous up to `pos`)
    start but do not finish and that was not acknowledged (its last seq past `acknowledged`), or None."""
    last = records[-1]["seq"] if records else None
    i = len(records) - 1
    while i >= 0 and frames[i][1] == (pos if i == len(records) - 1 else frames[i + 1][0]):
        reach = _append_reaches(records[i])
        if reach > last:
            return i if reach > acknowledged else None
        i -= 1
    return None


def _append_reaches(record: dict) -> int:
    """The seq of the last record of the append `record` belongs to, as far as `record` says: `upto` where set; a
    turn's user record (a note's has no turn id) is followed by its reply's in the same append."""
    if record.get("upto") is not None:
        return record["upto"]
    return record["seq"] + (record.get("role") == "user" and record.get("turn_id") is not None)


def _rising(seqs: list) -> set:
    """The indexes of a longest run of `seqs` (not necessarily adjacent) whose values rise strictly.

    Seqs rise strictly in a journal; frames that check but break that order (a stray
    record spliced in, a repeated seq) are the fewest dropped. O(n log n).
    """
    tails, tail_at, before = [], [], [-1] * len(seqs)  # tails[k]: the least last seq of a rising run of k + 1
    for i, seq in enumerate(seqs):
        k = bisect.bisect_left(tails, seq)
        before[i] = tail_at[k - 1] if k else -1
        if k == len(tails):
            tails.append(seq)
            tail_at.append(i)
        elif seq < tails[k]:
            tails[k], tail_at[k] = seq, i
    kept, i = set(), tail_at[-1] if tail_at else -1
    while i >= 0:
        kept.add(i)
        i = before[i]
    return kept


def _merged(spans: list) -> list:
    """(start, stop) spans sorted, those that touch or overlap joined."""
    out = []
    for start, stop in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], stop))
        else:
            out.append((start, stop))
    return out


def parse_journal(data) -> tuple[list, int]:
    """Decode journal bytes; return (records, end of the last good frame). See `scan_journal`."""
    scan = scan_journal(data)
    return scan.records, scan.end


def read_journal_bytes(path: Path) -> bytes | None:
    """The bytes of the journal at `path`, None if there is none.

    Never follows a symlink. Raises JournalError (naming the file and what to do) when
    it exists but cannot be read: no permission, a folder, a link.
    """
    try:
        fd = open_file(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.EINVAL:
            raise JournalError(f"the journal {path} is not a regular file; move it aside") from e
        if e.errno == errno.ELOOP:
            raise JournalError(f"the journal {path} is a symlink, which kvactors never follows; put the file itself "
                               "in its place") from e
        raise JournalError(
            f"cannot read the journal {path}: {e.strerror or e}; fix its permissions or move it aside"
        ) from e
    try:
        with open(fd, "rb", closefd=False) as f:
            return f.read()
    except OSError as e:
        raise JournalError(f"cannot read the journal {path}: {e.strerror or e}; fix it or move it aside") from e
    except MemoryError as e:
        raise JournalError(f"the journal {path} ({os.fstat(fd).st_size} B) is too large to read into memory; "
                           "move it aside") from e
    finally:
        os.close(fd)


def scan_folder(folder: Path) -> JournalScan | None:
    """The scan of agent folder `folder`'s journal as the runtime reads it, with the folder's high-water mark
    (`scan_journal`), or None where there is no journal; raises as `read_journal_bytes`."""
    data = read_journal_bytes(folder / JOURNAL_FILE)
    return None if data is None else scan_journal(data, high_seq(folder))


def read_journal(cache_dir, spec, agent: str) -> list:
    """All records of `agent`'s journal that check, oldest first ([] if none); see `scan_folder`."""
    folder = agent_dir(cache_dir, spec.fingerprint, agent)
    refuse_links(folder)
    scan = scan_folder(folder)
    return [] if scan is None else scan.records


def current_conversation(records) -> list:
    """The records of the current conversation, oldest first: those from the seq its last record names as `conv` on.

    Each record names the seq of the record that started its conversation (`conv`):
    the system record written at the agent's first start or by a reset. So the
    boundary holds even when damage destroyed that record. Records written before
    `conv` existed fall back to the old rule: from the last system record on (all if
    none). Older records stay in the journal but are no longer part of the history.
    """
    if not records:
        return []
    conv = records[-1].get("conv")
    if conv is not None:
        return [r for r in records if r["seq"] >= conv]
    starts = [i for i, r in enumerate(records) if r["role"] == "system"]
    return list(records[starts[-1]:] if starts else records)


def prompt_check(system: str) -> int:
    """The checksum of system prompt `system`, which every record of its conversation carries (`check`)."""
    return zlib.crc32(system.encode("utf-8"))


def conversation_prompt(history) -> str | None:
    """The system prompt of conversation `history` (see `current_conversation`); None when it was lost.

    It is the text of the conversation's last system record (the one that started it,
    or one that restored it); "" when the conversation never had one. None when the
    record that started the conversation is gone (journal damage) and no later one
    restored the prompt: it is unknown, and only the records' `check` says what it was.
    """
    prompts = [r["text"] for r in history if r["role"] == "system"]
    if prompts:
        return prompts[-1]
    conv = history[-1].get("conv") if history else None
    return None if conv is not None and history[0]["seq"] != conv else ""


def repair_journal(path: Path, scan: JournalScan) -> None:
    """Make the journal at `path` hold exactly the good frames of `scan`, keeping what it drops.

    Mid-file damage or a damaged header: the whole file is kept as `journal.damaged-<ns>` and the journal
    is rewritten (atomically) from its good frames. A torn tail alone is moved aside to
    `journal.torn-<ns>` and cut off. A journal cut short at creation gets its magic.
    """
    data = read_journal_bytes(path) or b""
    if scan.end < len(JOURNAL_MAGIC):
        if data:
            write_atomic(path.with_name(f"journal.torn-{time.time_ns()}"), data)
        write_atomic(path, JOURNAL_MAGIC)
    elif scan.rewritten:
        write_atomic(path.with_name(f"journal.damaged-{time.time_ns()}"), data)
        write_atomic(path, JOURNAL_MAGIC + b"".join(data[a:b] for a, b in scan.frames))
    elif scan.torn:
        write_atomic(path.with_name(f"journal.torn-{time.time_ns()}"), data[scan.end :])
        fd = open_file(path, os.O_WRONLY)
        try:
            os.ftruncate(fd, scan.end)
            os.fsync(fd)
        finally:
            os.close(fd)


def _read_high_file(folder: Path, size: int, offset: int) -> bytes | None:
    """`size` bytes at `offset` of the high-water mark's file in `folder`; None if absent, unreadable or short."""
    try:
        fd = open_file(folder / HIGH_FILE, os.O_RDONLY)
    except OSError:
        return None
    try:
        data = os.pread(fd, size, offset)
    except OSError:
        return None
    finally:
        os.close(fd)
    return data if len(data) == size else None


def high_seq(folder: Path) -> int | None:
    """The journal's high-water mark in agent folder `folder` (see `record_high_seq`), None if absent or unreadable."""
    data = _read_high_file(folder, _HIGH.size, 0)
    if data is None:
        return None
    magic, seq, crc = _HIGH.unpack(data)
    return seq if magic == _HIGH_MAGIC and crc == zlib.crc32(data[:12]) else None


def record_high_seq(folder: Path, seq: int) -> None:
    """Durably set the journal's high-water mark in agent folder `folder` to `seq`.

    Call it with the highest seq of an append before acknowledging it: then no
    acknowledged seq is ever used twice, even when the journal loses its tail. Lower
    it only back to its previous value, when the append failed and was cut back. The 16 bytes are rewritten in place and fsynced, needing no
    new disk space once the file exists; the first call creates it (`write_atomic`),
    as it replaces anything not a regular file in its place. Never follows a symlink.
    """
    data = _HIGH.pack(_HIGH_MAGIC, seq, zlib.crc32(_HIGH.pack(_HIGH_MAGIC, seq, 0)[:12]))
    try:
        fd = open_file(folder / HIGH_FILE, os.O_WRONLY)
    except OSError as e:
        if e.errno not in (errno.ENOENT, errno.EINVAL, errno.ENXIO):
            raise
        write_atomic(folder / HIGH_FILE, data)  # none yet, or something not a file in its place (a pipe)
        return
    try:
        os.pwrite(fd, data, 0)
        os.fsync(fd)
    finally:
        os.close(fd)


_LOSS = struct.Struct("<4sqqI")  # magic, journal's last seq, high mark, crc32 of the 20 bytes before: 24 bytes
_LOSS_MAGIC = b"kvlr"
_LOSS_AT = _HIGH.size  # in the high-water mark's file, after the mark (which `high_seq` reads alone)


def reported_loss(folder: Path) -> tuple[int, int] | None:
    """The (journal's last seq, mark) of the loss last reported for agent folder `folder` (`record_reported_loss`), or None."""
    data = _read_high_file(folder, _LOSS.size, _LOSS_AT)
    if data is None:
        return None
    magic, last, mark, crc = _LOSS.unpack(data)
    return (last, mark) if magic == _LOSS_MAGIC and crc == zlib.crc32(data[:20]) else None


def record_reported_loss(folder: Path, last: int, mark: int) -> None:
    """Durably note that the loss of the journal's records after seq `last` up to seq `mark` was reported.

    A journal that ends below the seqs its other files used (a cut tail, a deleted
    journal) stays so until an append passes the mark: each start would find the
    same loss again. This note, after the high-water mark in its file (the mark is
    left as it is), lets the next start know it was said. Needs the mark's file
    (`record_high_seq`); raises OSError when it cannot be written.
    """
    data = _LOSS.pack(_LOSS_MAGIC, last, mark, zlib.crc32(_LOSS.pack(_LOSS_MAGIC, last, mark, 0)[:20]))
    fd = open_file(folder / HIGH_FILE, os.O_WRONLY)
    try:
        os.pwrite(fd, data, _LOSS_AT)
        os.fsync(fd)
    finally:
        os.close(fd)


def lost_records(missing: bool, cache_seq: int | None, last: int, mark: int) -> str:
    """What a journal that ends at seq `last` lost (`missing`: there is none), when its agent's other files used seqs
    up to `mark` (> `last`): its cache at `cache_seq` (None: none), or its high-water mark. One sentence, for the
    persistence actor's log and `kvactors inspect`."""
    if missing:
        return (f"its journal is missing but its files reached seq {mark}: the journal was deleted (or never "
                f"written), its history starts empty; new turns continue after seq {mark}")
    if cache_seq is not None and cache_seq > last:
        return (f"its cache (seq {cache_seq}) is newer than its journal (last seq {last}): the journal lost records, "
                f"their turns are not in the history; new turns continue after seq {mark}")
    return (f"its journal ends at seq {last}, but records up to seq {mark} were written ({HIGH_FILE}): its tail was "
            f"cut off and those records are lost; new turns continue after seq {mark}")


def unread_tail(scan: JournalScan, acknowledged: bool) -> str:
    """What the torn tail of `scan` was (`acknowledged`: the agent's other files used seqs past its last kept
    record) and where `repair_journal` puts it: damage to acknowledged records, whose loss `lost_records` says,
    or an append cut short. One phrase, for the persistence actor's log and `kvactors inspect`."""
    what = "damage to acknowledged records" if acknowledged else "a torn tail: an append cut short"
    where = "kept with the whole file in journal.damaged-*" if scan.rewritten else "moved aside to journal.torn-*"
    return f"the journal's last {scan.torn} B did not read ({what}): {where}"


def open_journal(folder: Path) -> tuple[JournalScan | None, int]:
    """Make `folder`'s journal ready for appends; return (its scan as found, the byte to append at).

    The scan is None when there was no journal. Creates the folders and an empty
    journal as needed (where that fails, the folders it made are removed again), removes temp files of crashed writers, gives the journal and its mark
    their own copies where they had other hard links (`own_file`), and repairs damage
    (`repair_journal`). Raises JournalError for a journal that cannot be read (it is
    left untouched) and UnsafePath for a symlink in the store.
    """
    with removed_if_failed(make_dirs(folder)):  # a journal that cannot be made leaves no empty agent folder
        remove_temps(folder)
        for name in (JOURNAL_FILE, HIGH_FILE):  # both are written in place: never shared with another agent's folder
            own_file(folder / name)
        path = folder / JOURNAL_FILE
        scan = scan_folder(folder)
        if scan is None:
            write_atomic(path, JOURNAL_MAGIC)
            return None, len(JOURNAL_MAGIC)
    if scan.needs_repair:
        repair_journal(path, scan)
    return scan, len(JOURNAL_MAGIC) + sum(b - a for a, b in scan.frames)


_pwrite = os.pwrite  # the one call that puts journal bytes on disk (tests inject a full disk here)


def append_frames(path: Path, data: bytes, end: int) -> int:
    """Write the frames `data` at byte `end` of the journal at `path`, fsync; return the new end.

    All or nothing: on any failure (a full disk, an I/O error) the file is cut back to
    `end` and fsynced before the error is raised, so later appends follow the last good
    frame. If even that fails the error is raised as is: reopen the journal
    (`open_journal` repairs the tail) before appending again. Bytes past `end` (left by
    such a failure) are cut first. Never follows a symlink and never creates the file:
    a journal deleted underneath raises FileNotFoundError.
    """
    fd = open_file(path, os.O_WRONLY)
    try:
        size = os.fstat(fd).st_size
        if size < end:
            raise JournalError(f"the journal {path} shrank underneath kvactors ({size} < {end} bytes): another writer?")
        try:
            if size > end:
                os.ftruncate(fd, end)
            at = 0
            while at < len(data):
                at += _pwrite(fd, data[at:], end + at)
            os.fsync(fd)
        except BaseException:
            os.ftruncate(fd, end)
            os.fsync(fd)
            raise
    finally:
        os.close(fd)
    return end + len(data)


def fresh_records(records, last_seq: int) -> list:
    """The records of `records` that go after seq `last_seq`: in seq order, each seq above the one before.

    A record at or below `last_seq`, or repeating a seq, is left out, so a retried
    write appends nothing twice.
    """
    new = []
    for r in sorted(records, key=lambda r: r["seq"]):
        if r["seq"] > last_seq:
            new.append(r)
            last_seq = r["seq"]
    return new


def append_journal(cache_dir, spec, agent: str, records) -> list:
    """Durably append `records` to `agent`'s journal; return the records appended.

    Records whose seq is not above the journal's last seq are skipped (retries are
    idempotent: `fresh_records`); the high-water mark follows (`record_high_seq`). Creates and repairs the journal as `open_journal`
    does; a failed append leaves the journal as it was (`append_frames`). The
    persistence actor runs the same steps, keeping the journal's end between writes.
    """
    folder = agent_dir(cache_dir, spec.fingerprint, agent)
    scan, end = open_journal(folder)
    new = fresh_records(records, -1 if scan is None else scan.last_seq)
    if new:
        append_frames(folder / JOURNAL_FILE, encode_records(new), end)
        record_high_seq(folder, max(new[-1]["seq"], high_seq(folder) or -1))
    return new
