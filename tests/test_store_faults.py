"""`kvactors inspect`, the CLI and the store's loading path on damaged or odd cache folders: what inspect says is what an
agent loads, one agent's odd files never stop the others', and every loss is said."""

import logging
import os
import shutil
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
    root = tmp_path_factory.mktemp("review_store") / "store"
    with Runtime(cache_dir=root, hot_budget=0) as rt:
        for name in ("good", "victim"):
            agent = rt.spawn(name, system=SYSTEM)
            for text in TURNS:
                agent.ask(text, max_tokens=3)
    return root


@pytest.fixture
def cache_dir(template, tmp_path):
    root = tmp_path / "store"
    shutil.copytree(template, root, symlinks=True)
    return root


def folder(cache_dir, agent="victim") -> Path:
    return next(cache_dir.glob(f"*/{agent}"))


def row(cache_dir, agent="victim") -> str:
    return next(line for line in store.inspect_table(cache_dir).splitlines() if line.split()[:1] == [agent])


def kvactors(*args, env=None, obey_permissions=False):
    """Run the CLI; `obey_permissions`: as root, without the capabilities that bypass file permissions."""
    cmd = [sys.executable, "-m", "runtime.api.cli", *args]
    if obey_permissions and os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("root reads any file and setpriv is not here to drop that")
        cmd = [setpriv, "--bounding-set=-dac_override,-dac_read_search", *cmd]
    return subprocess.run(cmd, capture_output=True, timeout=180, cwd=ROOT, env={**os.environ, **(env or {})})


# 1. an agent folder that cannot be searched is left out of `inspect` (and `rt.agents()`), not reported

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


# 2. retention stops at the first agent whose cache is a folder: later agents' idle caches are kept

def test_retention_prunes_past_an_agent_whose_cache_is_a_folder(cache_dir):
    bad = folder(cache_dir, "good") / store.CACHE_FILE  # "good" sorts before "victim"
    bad.unlink()
    bad.mkdir()
    with Runtime(cache_dir=cache_dir, retention_s=0):
        pass
    left = sorted(p.name for p in folder(cache_dir).iterdir())
    assert store.CACHE_FILE not in left, left
    assert not [n for n in left if n.endswith(".delta.safetensors")], left


# 3. a cache folder whose path is not UTF-8: `inspect` and `demo` fail with an encoding error under a UTF-8 locale

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


# 4. a file where a folder is expected: inspect says nothing, while every agent of the model fails

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


# 5. a cache of another model: inspect counts its tokens and promises a partial prefill; the agent uses none of it

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


# 6. a damaged delta file is dropped at load without a word (a damaged full file is logged)

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


# 7. --help says the default model is SmolLM2, but $KVACTORS_MODEL (set for these tests: tiny) is the default

def test_model_help_names_the_environment_default():
    assert os.environ.get("KVACTORS_MODEL") == "tiny"
    for command in ("demo", "serve"):
        out = kvactors(command, "--help")
        assert b"KVACTORS_MODEL" in out.stdout, out.stdout.decode()


# 8. `inspect ''` inspects the current folder; `serve --cache-dir ''` refuses an empty path

def test_inspect_refuses_an_empty_cache_dir_as_serve_does():
    out = kvactors("inspect", "")
    assert out.returncode == 2 and b"cache_dir is empty" in out.stderr, out.stdout
