"""The public surface: one root error, every error importable from `runtime`, the README's API section true to the code."""

import builtins
import dataclasses
import importlib
import inspect
import os
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import pytest

import actors
import runtime
from runtime import KvactorsError

ROOT = Path(__file__).resolve().parent.parent


def _error_classes() -> list[type]:
    """Every exception class defined in a module of `runtime` or `actors`."""
    found = []
    for package in (runtime, actors):
        for info in pkgutil.iter_modules(package.__path__):
            module = importlib.import_module(f"{package.__name__}.{info.name}")
            for _, cls in inspect.getmembers(module, inspect.isclass):
                if cls.__module__ == module.__name__ and issubclass(cls, BaseException):
                    found.append(cls)
    return found


def test_every_error_derives_from_kvactors_error_and_is_importable_from_runtime():
    errors = _error_classes()
    assert len(errors) >= 30, [e.__name__ for e in errors]
    for cls in errors:
        assert getattr(runtime, cls.__name__) is cls, f"{cls.__module__}.{cls.__name__} is not exported by runtime"
        assert cls.__name__ in runtime.__all__
        assert issubclass(cls, KvactorsError), f"{cls.__module__}.{cls.__name__} does not derive from KvactorsError"


def test_errors_keep_their_builtin_base():
    expect = {
        "InvalidAgentId": ValueError, "SystemPromptChanged": ValueError, "UnsafePath": OSError,
        "CacheDirInUse": RuntimeError, "RuntimeClosed": RuntimeError, "RuntimeEscalated": RuntimeError,
        "AgentCrashed": RuntimeError, "UnknownAgent": KeyError, "UnknownChild": LookupError,
        "ModelLoadError": RuntimeError, "UnsupportedGGUF": RuntimeError, "DeadlinesClosed": RuntimeError,
        "BatcherStopped": runtime.TurnError,
    }
    for name, base in expect.items():
        assert issubclass(getattr(runtime, name), base), (name, base)
    assert not issubclass(KvactorsError, (ValueError, RuntimeError, OSError))


def test_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        runtime.Nope  # noqa: B018


def test_importing_the_machinery_or_the_root_error_never_imports_the_actors():
    code = ("import sys, runtime, runtime.engine, runtime.store; runtime.KvactorsError; "
            "assert not [m for m in sys.modules if m.split('.')[0] == 'actors'], 'actors imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})


# ---------------------------------------------------------------- the README's API section


def _api_section() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("## The API")
    return text[start : text.index("\n## ", start + 1)]


_OWNERS = {"rt": runtime.Runtime, "ref": runtime.AgentRef, "a": runtime.AgentRef, "Reply": runtime.Reply}


def _resolve(callee: str):
    """The object a README name like `Runtime`, `rt.spawn` or `Reply.text` stands for; None for anything else."""
    owner, _, attr = callee.rpartition(".")
    if owner:
        cls = _OWNERS.get(owner)
        if cls is None:
            return None
        fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
        assert attr in fields or hasattr(cls, attr), f"README names {callee}, but {cls.__name__} has no {attr!r}"
        return getattr(cls, attr, None)
    if callee[:1].isupper():
        if hasattr(builtins, callee):
            return getattr(builtins, callee)
        assert callee in runtime.__all__, f"README names {callee}, which runtime does not export"
        return getattr(runtime, callee)
    return None


def _parameters(obj) -> set[str]:
    if dataclasses.is_dataclass(obj):
        return {f.name for f in dataclasses.fields(obj)}
    sig = inspect.signature(obj)
    names = set(sig.parameters)
    if any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
        names |= set(inspect.signature(runtime.AgentRef.send).parameters)  # options are `send`'s
    return names


def test_readme_api_section_names_only_what_exists():
    spans = re.findall(r"`([^`]+)`", _api_section())
    checked = 0
    for span in spans:
        m = re.fullmatch(r"(?:await |async for \w+ in )?([A-Za-z_][\w.]*)(?:\((.*)\))?", span)
        if m is None:
            continue
        callee, args = m.groups()
        obj = _resolve(callee)
        if obj is None or args is None:
            checked += obj is not None
            continue
        checked += 1
        params = _parameters(obj)
        for arg in (a.strip() for a in args.split(",")):
            name = arg.split("=")[0].strip()
            if not re.fullmatch(r"[a-z_]\w*", name):
                continue
            if "=" in arg or dataclasses.is_dataclass(obj):
                assert name in params, f"README: {span} names {name!r}, which {callee} does not take"
    assert checked >= 40, checked
