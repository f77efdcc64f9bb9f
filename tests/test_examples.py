"""Smoke tests: every example (and `kvactors demo`) runs on the embedded tiny model.

Each runs as a subprocess with tiny --max-tokens; the tests check the exit code
and the lines that show what the example is about.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
ALL = ["quickstart", "debate", "crash_and_recover", "resume", "prisoners_dilemma"]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """The subprocesses' environment: one KVACTORS_HOME for the module, tiny model built once."""
    home = tmp_path_factory.mktemp("examples_home")
    env = {**os.environ, "KVACTORS_HOME": str(home), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    subprocess.run([sys.executable, "-c", "from runtime.tiny import tiny_llama_path; tiny_llama_path()"],
                   env=env, cwd=ROOT, check=True, timeout=120)
    return env


def run(env, *args):
    p = subprocess.run([sys.executable, *map(str, args)], env=env, cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, f"exit {p.returncode}\n--- stdout\n{p.stdout}\n--- stderr\n{p.stderr}"
    return p.stdout


def cache_states(out):
    """The cache states of the turns printed as `cache=STATE`, in order."""
    return re.findall(r"cache=(cold|hot|warm)\b", out)


def agent_states(out):
    """{agent: [cache states]} of the turns printed as `  AGENT STATE  ttft ...`."""
    states = {}
    for agent, state in re.findall(r"^  (\w+) +(cold|hot|warm) +ttft", out, re.MULTILINE):
        states.setdefault(agent, []).append(state)
    return states


def test_every_example_is_tested():
    assert {p.stem for p in EXAMPLES.glob("*.py")} - {"common"} == set(ALL)


def test_help(env):
    procs = [subprocess.Popen([sys.executable, EXAMPLES / f"{name}.py", "--help"], env=env, cwd=ROOT,
                              stdout=subprocess.PIPE, text=True) for name in ALL]
    for name, p in zip(ALL, procs):
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0 and "--model" in out and "--cache-dir" in out and "--max-tokens" in out, name
        # Runtime(model=None) takes $KVACTORS_MODEL first, as `kvactors demo --help` says; "SmolLM2" alone was wrong
        assert "$KVACTORS_MODEL" in out, name


def test_quickstart(env, tmp_path):
    out = run(env, EXAMPLES / "quickstart.py", "--max-tokens", 4, "--cache-dir", tmp_path)
    assert cache_states(out) == ["cold", "cold", "hot", "hot"]
    assert "ttft=" in out and "nonsense" in out


def test_debate(env, tmp_path):
    out = run(env, EXAMPLES / "debate.py", "--max-tokens", 4, "--rounds", 2, "--cache-dir", tmp_path)
    assert out.count("[round 1]") == 2 and out.count("[round 2]") == 2
    assert "[round 2] pro (hot" in out and "[round 2] con (hot" in out


def test_crash_and_recover(env):
    out = run(env, EXAMPLES / "crash_and_recover.py", "--max-tokens", 4)
    assert "AgentCrashed: turn ada-" in out and "restarted" in out
    assert cache_states(out) == ["cold", "hot", "warm", "hot"]
    assert "TTFT after the crash (warm)" in out


def test_resume_twice(env, tmp_path):
    cache_dir = tmp_path / "resume"
    first = run(env, EXAMPLES / "resume.py", "--max-tokens", 4, "--cache-dir", cache_dir)
    assert "nothing stored" in first and cache_states(first) == ["cold", "hot"]
    second = run(env, EXAMPLES / "resume.py", "--max-tokens", 4, "--cache-dir", cache_dir)
    assert "found scribe" in second and "2 earlier turns" in second
    assert cache_states(second) == ["warm", "hot"]
    fresh = run(env, EXAMPLES / "resume.py", "--max-tokens", 4, "--cache-dir", cache_dir, "--fresh")
    assert "nothing stored" in fresh and cache_states(fresh) == ["cold", "hot"]


def test_prisoners_dilemma(env, tmp_path):
    out = run(env, EXAMPLES / "prisoners_dilemma.py", "--max-tokens", 4, "--cache-dir", tmp_path)
    for phase in range(1, 6):
        assert f"Phase {phase}:" in out
    assert agent_states(out) == {"warden": ["cold", "warm"], "marco": ["cold", "hot", "hot", "warm"],
                      "danny": ["cold", "hot", "hot", "warm"], "analyst": ["cold"]}
    assert " years" in out


def test_kvactors_demo(env, tmp_path):
    out = run(env, "-m", "runtime.api.cli", "demo", "--max-tokens", 4, "--cache-dir", tmp_path)
    assert agent_states(out) == {"alice": ["cold", "hot", "warm"], "bob": ["cold", "hot", "warm"]}
    # what each Runtime found stored as it came up: nothing, then both on disk (warm) after the restart
    assert re.findall(r"agents stored (.*), caches in", out) == [
        "none yet", "alice (2 turns, cache warm), bob (2 turns, cache warm)"]
    assert re.search(r"^  alice +prefill \[#{20}\] (\d+)/\1 tok$", out, re.MULTILINE)  # the progress bar, full
    assert "nonsense" in out
    summary = out.strip().splitlines()[-1]
    assert summary.startswith("mean TTFT:") and "warm/cold" in summary
