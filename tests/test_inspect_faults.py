"""`kvactors inspect` on stores the real runtime wrote, then damaged on disk: each fault is said on its agent's row
(what, which file, what to do), the hint is checked against what the runtime then does, healthy agents read ok,
and inspect follows no symlink, changes nothing and never stops at a bad agent."""

import logging
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from runtime import Runtime, store

ROOT = Path(__file__).resolve().parent.parent
SYSTEM = "You are a careful planner. " * 40  # long enough that later turns write delta files
TURNS = ("Plan a bake sale.", "Go on.", "Who bakes?")


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """A store the runtime wrote: agents "good" and "victim", three turns each (a full cache file, two deltas)."""
    root = tmp_path_factory.mktemp("inspect_store") / "store"
    with Runtime(cache_dir=root, hot_budget=0) as rt:
        for name in ("good", "victim"):
            agent = rt.spawn(name, system=SYSTEM)
            for text in TURNS:
                agent.ask(text, max_tokens=3)
    return root


@pytest.fixture
def cache_dir(template, tmp_path):
    """A fresh copy of `template` for one test (links copied as links)."""
    root = tmp_path / "store"
    shutil.copytree(template, root, symlinks=True)
    return root


def folder(cache_dir, agent="victim") -> Path:
    return next(cache_dir.glob(f"*/{agent}"))


def as_folder(path: Path) -> None:
    """Put an empty folder where the file `path` was."""
    path.unlink()
    path.mkdir()


def as_symlink(path: Path, elsewhere: Path) -> None:
    """Move what is at `path` to `elsewhere` and put a symlink to it at `path`."""
    path.rename(elsewhere)
    path.symlink_to(elsewhere)


def row(cache_dir, agent="victim") -> str:
    return next(line for line in store.inspect_table(cache_dir).splitlines() if line.split()[:1] == [agent])


def turn(cache_dir, agent="victim"):
    with Runtime(cache_dir=cache_dir, hot_budget=0) as rt:
        rt.spawn(agent, system=SYSTEM).ask("More?", max_tokens=3)


def snapshot(root: Path) -> dict:
    """Every entry under `root` (links not followed): its kind, size, mtime and bytes."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = os.lstat(p)
            data = p.read_bytes() if p.is_file() and not p.is_symlink() else None
            out[p] = (st.st_mode, st.st_size, st.st_mtime_ns, data)
    return out


def flip(path: Path, at: int = -10) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def test_journal_seq_as_a_folder_says_remove_it_and_removing_it_heals(cache_dir):
    seq = folder(cache_dir) / store.HIGH_FILE
    as_folder(seq)
    line = row(cache_dir)
    assert "journal.seq is a folder, not a file" in line and "remove it" in line
    assert row(cache_dir, "good").endswith("  ok")
    seq.rmdir()  # what the hint says
    turn(cache_dir)
    assert row(cache_dir).endswith("  ok")


@pytest.mark.parametrize("garbage", [b"\x00" * 16, b"not a mark at all!", b"kvhs"])
def test_damaged_journal_seq_is_said_and_rewritten_with_the_next_turn(cache_dir, garbage):
    (folder(cache_dir) / store.HIGH_FILE).write_bytes(garbage)
    assert "journal.seq damaged (no valid high-water mark in it): rewritten with the agent's next turn" in row(cache_dir)
    turn(cache_dir)
    assert store.high_seq(folder(cache_dir)) is not None and row(cache_dir).endswith("  ok")


def test_journal_seq_as_a_named_pipe_is_said(cache_dir):
    seq = folder(cache_dir) / store.HIGH_FILE
    seq.unlink()
    os.mkfifo(seq)
    assert "journal.seq is a named pipe, not a file: kvactors replaces it" in row(cache_dir)
    turn(cache_dir)
    assert row(cache_dir).endswith("  ok")


def test_a_symlinked_agent_folder_is_said_and_not_followed(cache_dir, tmp_path):
    agent = folder(cache_dir)
    outside = tmp_path / "outside"
    agent.rename(outside)
    flip(outside / store.CACHE_FILE)  # were the link followed, this damage would show
    agent.symlink_to(outside)
    line = row(cache_dir)
    assert "symlink (to " in line and str(outside) in line and "UnsafePath" in line and "remove the link" in line
    assert "ChecksumMismatch" not in line and line.split()[1:4] == ["-", "-", "-"]
    assert row(cache_dir, "good").endswith("  ok")
    assert [p.name for p in store.agent_folders(cache_dir)] == ["good"]


def test_a_symlinked_model_folder_is_said_and_not_followed(cache_dir, tmp_path):
    model = folder(cache_dir).parent
    outside = tmp_path / "elsewhere"
    shutil.copytree(model, outside)
    (cache_dir / "linkedmodel").symlink_to(outside)
    table = store.inspect_table(cache_dir)
    line = next(line for line in table.splitlines() if line.startswith("model linkedmodel"))
    assert "symlink (to " in line and "UnsafePath" in line and "never follows" in line
    assert table.count("victim") == 1  # the agents behind the link are not listed (nor read)
    assert [p.parent.name for p in store.agent_folders(cache_dir)] == [model.name, model.name]


def test_only_symlinked_model_folders_is_not_no_agents(tmp_path, template):
    model = next(p for p in template.iterdir() if p.is_dir())
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / model.name).symlink_to(model)
    table = store.inspect_table(tmp_path / "store")
    assert "no agents stored" not in table and "the model folder is a symlink" in table


def test_a_damaged_delta_file_is_named_not_taken_for_a_cache_lag(cache_dir):
    assert row(cache_dir).endswith("  ok")
    flip(folder(cache_dir) / store.DELTA_FILE.format(2))
    line = row(cache_dir)
    assert "bad cache delta: cache.2.delta.safetensors is damaged (ChecksumMismatch)" in line
    assert "the agent's next cache write replaces it" in line
    turn(cache_dir)
    assert row(cache_dir).endswith("  ok")


def test_a_delta_file_replaced_by_a_folder_says_remove_it(cache_dir):
    delta = folder(cache_dir) / store.DELTA_FILE.format(1)
    as_folder(delta)
    line = row(cache_dir)
    assert "bad cache delta: cache.1.delta.safetensors is a folder, not a file" in line and "remove it" in line


@pytest.mark.parametrize("damage", ["tensors", "header", "cut"])
def test_a_damaged_cache_file_says_which_file_and_what_happens(cache_dir, damage):
    path = folder(cache_dir) / store.CACHE_FILE
    if damage == "cut":
        path.write_bytes(path.read_bytes()[:-3])
    else:
        flip(path, -10 if damage == "tensors" else 40)
    line = row(cache_dir)
    assert "bad cache: " in line and "(cache.safetensors is " in line
    assert "re-prefills from its journal, and its next turn rewrites the file" in line
    turn(cache_dir)
    assert row(cache_dir).endswith("  ok")


def test_a_cache_file_replaced_by_a_folder_says_remove_it(cache_dir):
    path = folder(cache_dir) / store.CACHE_FILE
    as_folder(path)
    line = row(cache_dir)
    assert "bad cache: cache.safetensors is a folder, not a file" in line and "remove it" in line
    assert line.split()[1] == "-"


def test_a_symlinked_cache_file_is_not_followed_and_replaced_by_the_next_turn(cache_dir, tmp_path):
    path = folder(cache_dir) / store.CACHE_FILE
    as_symlink(path, tmp_path / "elsewhere.safetensors")
    line = row(cache_dir)
    assert "bad cache: cache.safetensors is a symlink (to " in line and "its next turn replaces it" in line
    turn(cache_dir)
    assert not path.is_symlink() and row(cache_dir).endswith("  ok")


def test_a_leftover_temp_folder_is_said(cache_dir):
    tmp = folder(cache_dir) / ".cache.safetensors.4242.0badc0de.tmp"
    tmp.mkdir()
    (tmp / "something").write_bytes(b"x")
    line = row(cache_dir)
    assert ".cache.safetensors.4242.0badc0de.tmp/ is a folder named like a kvactors temp file" in line
    assert "remove it" in line
    turn(cache_dir)
    assert tmp.is_dir() and ".tmp/ is a folder" in row(cache_dir)  # kvactors leaves it: only a person removes it


def test_an_unreadable_journal_gives_no_seq_hint(cache_dir):
    journal = folder(cache_dir) / store.JOURNAL_FILE
    as_folder(journal)
    line = row(cache_dir)
    assert "is not a regular file; move it aside" in line
    assert "newer than its journal" not in line  # its records are unknown, not missing


def test_a_symlinked_journal_is_not_blamed_on_permissions(cache_dir, tmp_path):
    journal = folder(cache_dir) / store.JOURNAL_FILE
    as_symlink(journal, tmp_path / "journal.msgpack")
    line = row(cache_dir)
    assert "journal.msgpack is a symlink (to " in line and "put the file itself in its place" in line
    assert "permissions" not in line


def test_a_journal_cut_between_frames_is_said_by_its_mark(cache_dir):
    agent = folder(cache_dir)
    journal = agent / store.JOURNAL_FILE
    data, pos, starts = journal.read_bytes(), len(store.JOURNAL_MAGIC), []
    while pos < len(data):
        starts.append(pos)
        pos += 8 + struct.unpack_from("<I", data, pos)[0]
    journal.write_bytes(data[: starts[-1]])  # the last record gone, no torn bytes
    for p in agent.glob("cache*"):
        p.unlink()  # only the mark says it
    line = row(cache_dir)
    assert "journal ends at seq 6, but records up to seq 7 were written (journal.seq)" in line
    assert "new turns continue after seq 7" in line


def test_a_damaged_journal_header_is_said(cache_dir):
    flip(folder(cache_dir) / store.JOURNAL_FILE, 3)
    assert "journal header damaged: repaired at the agent's next start" in row(cache_dir)


def test_a_record_with_an_odd_time_does_not_stop_inspect(cache_dir):
    journal = folder(cache_dir) / store.JOURNAL_FILE
    with journal.open("ab") as f:
        f.write(store.encode_records([{"seq": 99, "role": "user", "text": "x", "time": "yesterday"}]))
    assert "#99 user 20" in row(cache_dir)  # the journal's time instead
    assert row(cache_dir, "good").endswith("  ok")


def test_a_named_pipe_for_model_json_does_not_stall_inspect(cache_dir):
    model_json = folder(cache_dir).parent / store.MODEL_FILE
    model_json.unlink()
    os.mkfifo(model_json)
    out = subprocess.run([sys.executable, "-m", "runtime.api.cli", "inspect", str(cache_dir)], capture_output=True,
                         text=True, timeout=30, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "good" in out.stdout


def test_every_fault_at_once_each_on_its_row_and_nothing_changed(cache_dir, tmp_path):
    """One store, one fault per agent: each row says its own, the healthy agent reads ok, no file changes."""
    model = folder(cache_dir).parent
    for name in ("seqdir", "seqbad", "link", "delta", "cache", "tmpdir"):
        shutil.copytree(folder(cache_dir), model / name)
    as_folder(model / "seqdir" / store.HIGH_FILE)
    (model / "seqbad" / store.HIGH_FILE).write_bytes(b"garbage garbage!")
    as_symlink(model / "link", tmp_path / "linked")
    flip(model / "delta" / store.DELTA_FILE.format(1))
    flip(model / "cache" / store.CACHE_FILE)
    (model / "tmpdir" / ".journal.msgpack.1.ab.tmp").mkdir()
    before = snapshot(cache_dir)
    table = store.inspect_table(cache_dir)
    assert snapshot(cache_dir) == before
    rows = {line.split()[0]: line for line in table.splitlines()[3:]}
    assert sorted(rows) == ["cache", "delta", "good", "link", "seqbad", "seqdir", "tmpdir", "victim"]
    assert rows["good"].endswith("  ok") and rows["victim"].endswith("  ok")
    says = {"seqdir": "journal.seq is a folder", "seqbad": "journal.seq damaged", "link": "agent folder is a symlink",
            "delta": "cache.1.delta.safetensors is damaged", "cache": "bad cache: ChecksumMismatch",
            "tmpdir": ".journal.msgpack.1.ab.tmp/ is a folder"}
    for name, text in says.items():
        assert text in rows[name], rows[name]


def kvactors(*args, env=None, obey_permissions=False):
    """Run the CLI; `obey_permissions`: as root, without the capabilities that bypass file permissions."""
    cmd = [sys.executable, "-m", "runtime.api.cli", *args]
    if obey_permissions and os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("root reads any file and setpriv is not here to drop that")
        cmd = [setpriv, "--bounding-set=-dac_override,-dac_read_search", *cmd]
    return subprocess.run(cmd, capture_output=True, timeout=180, cwd=ROOT, env={**os.environ, **(env or {})})


# an agent folder that cannot be searched is listed with its reason (it was left out, as from `rt.agents()`)

def test_inspect_reports_an_agent_folder_it_cannot_read(cache_dir):
    victim = folder(cache_dir)
    victim.chmod(0)
    try:
        out = kvactors("inspect", cache_dir, obey_permissions=True)
    finally:
        victim.chmod(0o700)
    text = out.stdout.decode()
    assert out.returncode == 0, out.stderr
    assert "(2 agents)" in text, text  # was "(1 agents)": victim silently missing
    victim_row = next(line for line in text.splitlines() if line.startswith("victim"))
    assert "fix its permissions" in victim_row


# retention goes on past an agent whose cache is a folder (it stopped there, keeping later agents' idle caches)

def test_retention_prunes_past_an_agent_whose_cache_is_a_folder(cache_dir):
    bad = folder(cache_dir, "good") / store.CACHE_FILE  # "good" sorts before "victim"
    bad.unlink()
    bad.mkdir()
    with Runtime(cache_dir=cache_dir, retention_s=0):
        pass
    left = sorted(p.name for p in folder(cache_dir).iterdir())
    assert store.CACHE_FILE not in left, left
    assert not [n for n in left if n.endswith(".delta.safetensors")], left


# retention that fails partway through an agent's folder still lists what it deleted there (it listed none of it)

@pytest.mark.parametrize("journals", [False, True])
def test_retention_lists_what_it_deleted_before_a_file_it_could_not_delete(cache_dir, journals):
    good, victim = folder(cache_dir, "good"), folder(cache_dir)  # "good" is pruned first
    deltas = sorted(good.glob(store.DELTA_FILE.format("*")))
    as_folder(good / store.HIGH_FILE if journals else deltas[-1])  # deleted after the cache file (and the journal)
    before = {agent: list(agent.iterdir()) for agent in (good, victim)}
    gone = store.prune(cache_dir, 0, journals=journals, now=float("inf"))
    removed = {agent: [p for p in files if not os.path.lexists(p)] for agent, files in before.items()}
    assert good / store.CACHE_FILE in removed[good] and good.exists()  # it failed partway through "good"
    assert sorted(gone) == sorted(removed[good] + ([victim] if journals else removed[victim])), gone
    assert not victim.exists() if journals else not list(victim.glob("cache.*"))  # and went on to "victim"


# a cache folder whose path is not UTF-8 prints as its bytes (inspect and demo failed under a strict UTF-8 stdout)

@pytest.mark.parametrize("command", ["inspect", "demo"])
def test_a_non_utf8_cache_dir_is_printed_not_refused(tmp_path, command):
    raw = os.fsencode(tmp_path) + b"/caches-\xff"
    env = {"PYTHONIOENCODING": "utf-8"}  # stdout as under LANG=en_US.UTF-8: strict UTF-8
    if command == "inspect":
        os.mkdir(raw)
        out = kvactors("inspect", raw, env=env)
        assert out.returncode == 0 and b"no agents stored" in out.stdout, out.stderr
    else:
        out = kvactors("demo", "--model", "tiny", "--cache-dir", raw, env=env)
        assert out.returncode == 0 and b"mean TTFT" in out.stdout, out.stderr
    assert b"codec can't encode" not in out.stderr


# a file where a folder is expected is said (inspect said nothing while every agent of the model failed)

def test_inspect_reports_a_file_in_place_of_a_model_folder(cache_dir):
    model = folder(cache_dir).parent
    shutil.rmtree(model)
    model.write_bytes(b"")
    text = store.inspect_table(cache_dir)
    assert model.name in text, text  # was "<cache_dir>: no agents stored"


def test_inspect_reports_a_file_in_place_of_an_agent_folder(cache_dir):
    victim = folder(cache_dir)
    shutil.rmtree(victim)
    victim.write_bytes(b"")
    assert [line for line in store.inspect_table(cache_dir).splitlines() if line.startswith("victim")]


# a cache of another model counts no tokens (inspect promised a partial prefill; the agent uses none of it)

def test_inspect_does_not_count_a_foreign_models_cache(cache_dir):
    victim = folder(cache_dir)
    host, meta = store.decode_cache(store.read_file(victim / store.CACHE_FILE))
    foreign = store.encode_cache(host, meta, "0" * 32)  # the same rows, tagged as another model's
    store.remove_deltas(victim)
    store.write_atomic(victim / store.CACHE_FILE, foreign)
    health = row(cache_dir)
    assert "cache of another model" in health
    with Runtime(cache_dir=cache_dir, hot_budget=0) as rt:
        reply = rt.spawn("victim", system=SYSTEM).ask("More?", max_tokens=3)
    assert reply.cache == "cold"  # none of it was used
    assert health.split()[1] == "-", health  # was the foreign cache's token count
    assert "prefills the turns after it" not in health, health


# a damaged delta file dropped at load is logged once, as a damaged full file is

def test_a_damaged_delta_is_said_when_loading_drops_it(cache_dir, caplog):
    delta = folder(cache_dir) / store.DELTA_FILE.format(2)
    data = bytearray(delta.read_bytes())
    data[-10] ^= 0xFF  # its rows: the header (seq, link) still reads
    delta.write_bytes(bytes(data))
    caplog.set_level(logging.INFO)
    with Runtime(cache_dir=cache_dir, hot_budget=0) as rt:
        reply = rt.spawn("victim", system=SYSTEM).ask("More?", max_tokens=3)
    assert reply.cache == "warm"
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "victim" in r.getMessage()]
    assert len([m for m in said if "delta" in m]) == 1, said


# --help names $KVACTORS_MODEL (set for these tests: tiny) as the default model before SmolLM2

def test_model_help_names_the_environment_default():
    assert os.environ.get("KVACTORS_MODEL") == "tiny"
    for command in ("demo", "serve"):
        out = kvactors(command, "--help")
        assert b"KVACTORS_MODEL" in out.stdout, out.stdout.decode()


# `inspect ''` is refused as `serve --cache-dir ''` is (it inspected the current folder)

def test_inspect_refuses_an_empty_cache_dir_as_serve_does():
    out = kvactors("inspect", "")
    assert out.returncode == 2 and b"cache_dir is empty" in out.stderr, out.stdout
