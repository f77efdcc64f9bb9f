"""Shared test fixtures: tiny local models, offline, in session temp folders."""

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

# Never touch the network or the user's real cache from the test suite.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Runtime() with no model runs the tiny random-weight llama here; the real default
# (SmolLM2-135M-Instruct) has its own tests, which name it explicitly.
os.environ["KVACTORS_MODEL"] = "tiny"
# MLX-CUDA multiplies float32 matrices in TF32 (a 10-bit mantissa) unless told not to: the tiny float32
# models then differ between batch sizes by about 1e-3, where the tests compare at float32 tolerances.
# Read at MLX's first matmul; other backends ignore it.
os.environ.setdefault("MLX_ENABLE_TF32", "0")
# Child Pythons the tests start (CLI runs, crash children, servers) import this checkout first and whatever the
# runner's own path held after it (where MLX may come from).
ROOT = str(Path(__file__).resolve().parents[1])
os.environ["PYTHONPATH"] = os.pathsep.join(
    [ROOT, *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != ROOT)])


@pytest.fixture(scope="session", autouse=True)
def kvactors_home(tmp_path_factory):
    """Point KVACTORS_HOME at a session temp folder for the whole session."""
    home = tmp_path_factory.mktemp("kvactors_home")
    old = os.environ.get("KVACTORS_HOME")
    os.environ["KVACTORS_HOME"] = str(home)
    yield home
    if old is None:
        os.environ.pop("KVACTORS_HOME", None)
    else:
        os.environ["KVACTORS_HOME"] = old


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory):
    """``tiny_model_path(arch="llama", **overrides) -> Path``, built once per session.

    Builds with ``runtime.tiny.make_tiny_model`` (seed 0, float32) and caches
    by ``(arch, overrides)``. Treat the folders as read-only.
    """
    from runtime.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("tiny_models")
    built = {}

    def get(arch="llama", **overrides):
        key = (arch, tuple(sorted((k, repr(v)) for k, v in overrides.items())))
        if key not in built:
            built[key] = make_tiny_model(root / f"{arch}-{len(built)}", arch=arch, **overrides)
        return built[key]

    return get


@pytest.fixture(scope="session")
def load_tiny(tiny_model_path):
    """``load_tiny(arch="llama") -> (model, tokenizer)`` via ``mlx_lm.load``, cached; on CUDA with
    float expert layers mended as `load_model` does there (MLX-CUDA misreads gpt_oss's otherwise).

    The objects are shared across tests: do not mutate the model.
    """
    import mlx_lm

    from runtime.prepare import prepare_model

    loaded = {}

    def get(arch="llama"):
        if arch not in loaded:
            loaded[arch] = mlx_lm.load(str(tiny_model_path(arch)))
            # only what every model needs there (none of the GEMV, dense or compiled paths): nothing off CUDA
            prepare_model(loaded[arch][0], gemv=False, dense=False, compile_decode=False)
        return loaded[arch]

    return get


@pytest.fixture
def kill_mid_build():
    """``kill_mid_build(command, folder, env=None)``: run ``command`` (a process that builds a model folder in
    ``folder``, emptied first) and SIGKILL it while its temporary folder (``.<name>.tmp-*``) is there, trying
    again until a kill lands so (at most 20 times; then the test fails). The killed build's leftovers stay."""
    def writing(folder):
        return folder.is_dir() and any(".tmp-" in n for n in os.listdir(folder))

    def kill(command, folder, env=None):
        folder = Path(folder)
        for _ in range(20):
            shutil.rmtree(folder, ignore_errors=True)
            child = subprocess.Popen(command, cwd=Path(__file__).resolve().parents[1], env=env,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and child.poll() is None:
                if writing(folder):
                    child.send_signal(signal.SIGKILL)
                    break
                time.sleep(0.0005)
            child.wait()
            if child.returncode == -signal.SIGKILL and writing(folder):
                return
        pytest.fail("never killed the child while it wrote")

    return kill
