"""The public surface: one root error, every error importable from `runtime`, the README's API section true to the code."""

import ast
import builtins
import dataclasses
import importlib
import inspect
import pkgutil
import pydoc
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
    """Every exception class defined in a module of `runtime` (its subpackages included) or `actors`."""
    found = []
    for package in (runtime, actors):
        for info in pkgutil.walk_packages(package.__path__, f"{package.__name__}."):
            module = importlib.import_module(info.name)
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
        "BatcherStopped": runtime.TurnError, "CallbackFailed": runtime.TurnError, "WaitTimeout": TimeoutError,
    }
    for name, base in expect.items():
        assert issubclass(getattr(runtime, name), base), (name, base)
    assert not issubclass(KvactorsError, (ValueError, RuntimeError, OSError))
    # a stored cache or journal that cannot be used is a file's problem, as gzip's BadGzipFile is
    for name in ("CacheError", "CacheMissing", "CorruptCache", "ChecksumMismatch", "UnreadableCache", "JournalError"):
        assert issubclass(getattr(runtime, name), OSError), name


def test_every_error_has_a_builtin_base_that_says_its_kind():
    """`except ValueError` (OSError, RuntimeError, ...) catches each kvactors error of that kind: none derives from
    Exception alone, but the root and the mixin of advice, and ApiError, an HTTP answer the server's app raises
    and answers itself."""
    mixins = {"KvactorsError", "AdvisedError", "ApiError"}
    for cls in _error_classes():
        kinds = [k for k in cls.__mro__ if k.__module__ == "builtins" and k not in (Exception, BaseException, object)]
        assert kinds or cls.__name__ in mixins, f"{cls.__module__}.{cls.__name__} has no builtin base but Exception"


def test_a_bad_argument_is_a_kvactors_error_that_keeps_its_builtin_kind(tmp_path):
    """`except KvactorsError` catches bad arguments too, and `except ValueError` / `TypeError` still do."""
    from actors.supervisor import Backoff
    from runtime import InvalidArgument, InvalidArgumentType, Runtime
    from runtime.api.facade import check_turn_options

    cases = [
        (InvalidArgument, ValueError, "max_batch", lambda: Runtime(cache_dir=tmp_path, max_batch=0)),
        # start-up walked every size below it: 10**12 wedged the batcher
        (InvalidArgument, ValueError, "max_batch must be <= 4096", lambda: Runtime(cache_dir=tmp_path, max_batch=10**12)),
        # an int past a float's range: math.isfinite raised OverflowError
        (InvalidArgument, ValueError, "restart_period", lambda: Runtime(cache_dir=tmp_path, restart_period=10**400)),
        (InvalidArgument, ValueError, "temperature", lambda: check_turn_options("hi", 8, 10**400, 1.0, 0, (), None)),
        (InvalidArgument, ValueError, "timeout", lambda: check_turn_options("hi", 8, 0.0, 1.0, 0, (), 10**400)),
        (InvalidArgumentType, TypeError, "kv_bits must be an int", lambda: Runtime(cache_dir=tmp_path, kv_bits="4")),
        (InvalidArgumentType, TypeError, "kv_scheme must be a name", lambda: Runtime(cache_dir=tmp_path, kv_scheme=5)),
        (InvalidArgumentType, TypeError, "cache_dir must be", lambda: Runtime(cache_dir=5)),
        (InvalidArgumentType, TypeError, "cache_dir must be", lambda: Runtime(cache_dir=bytes(tmp_path))),
        (InvalidArgument, ValueError, "NUL", lambda: Runtime(cache_dir=f"{tmp_path}/a\0b")),
        (InvalidArgumentType, TypeError, "max_batch", lambda: Runtime(cache_dir=tmp_path, max_batch="8")),
        (InvalidArgument, ValueError, "min <= max", lambda: Backoff(min=2.0, max=1.0)),
        (InvalidArgument, ValueError, "top_p", lambda: check_turn_options("hi", 8, 0.0, 1.5, 0, (), None)),
        (InvalidArgumentType, TypeError, "text must be a str",
         lambda: check_turn_options(b"hi", 8, 0.0, 1.0, 0, (), None)),
    ]
    for kind, builtin, match, call in cases:
        with pytest.raises(kind, match=match) as e:
            call()
        assert isinstance(e.value, KvactorsError) and isinstance(e.value, builtin)
    assert not list(tmp_path.iterdir())  # refused before the Runtime took anything


def test_refs_names_and_group_sends_are_checked_before_anything_runs(tmp_path):
    """`broadcast` (and `converse`) to a group with a stopped agent sent the earlier agents their turns (committed,
    their futures lost) before raising; a spawn's system prompt that can never fit was stored, and every turn failed; a
    200 MB conversation_id went into the journal; `running()` and `agent()` answered after `shutdown()`."""
    from runtime import InvalidAgentId, InvalidArgument, Runtime, RuntimeClosed, SystemPromptTooLong, UnknownAgent

    rt = Runtime(model=None, cache_dir=tmp_path)
    a, b, c = rt.spawn("a"), rt.spawn("b"), rt.spawn("c")
    b.stop()
    with pytest.raises(UnknownAgent, match="'b'"):
        rt.broadcast([a, c, b], "Hello all.", max_tokens=4)
    with pytest.raises(UnknownAgent, match="'b'"):  # a answered, and its reply was lost with the error
        rt.converse([a, b], "Hello you two.", 1, max_tokens=4)
    assert a.history() == [] and c.history() == []  # nobody took a turn
    with pytest.raises(SystemPromptTooLong, match=rf"system prompt is \d+ characters: more tokens, whatever they are, "
                                                  rf"than the model's {rt.max_context} positions, so it leaves none"):
        rt.spawn("big", system="x" * (rt.max_context * rt.longest_token_chars + 1))
    assert not rt.stored("big")
    with pytest.raises(InvalidArgument, match="conversation_id has"):
        a.send("Hi.", max_tokens=4, conversation_id="c" * 5000)
    with pytest.raises(InvalidAgentId):
        rt.agent(["a"])
    rt.shutdown()
    for call in (rt.running, lambda: rt.agent("a")):
        with pytest.raises(RuntimeClosed):
            call()


def test_a_system_prompt_whose_tokens_fill_the_model_is_refused_at_spawn_and_reset(tmp_path):
    """A system prompt short enough in characters but not in tokens was accepted: the agent was stored with it and
    every turn failed with TurnTooLong. Now spawn and reset refuse it before anything starts or is recorded; one a
    token shorter is served."""
    from runtime import Runtime, SystemPromptTooLong, chat

    with Runtime(model=None, cache_dir=tmp_path) as rt:
        words = "plan " * rt.max_context
        count = len(chat.encode_text(rt.tokenizer, words))
        assert count >= rt.max_context and len(words) < rt.max_context * rt.longest_token_chars
        with pytest.raises(SystemPromptTooLong, match=rf"system prompt is {count} tokens of the model's"):
            rt.spawn("big", system=words)
        assert not rt.stored("big") and "big" not in rt.running()
        ref = rt.spawn("ok", system="Be brief.")
        with pytest.raises(SystemPromptTooLong) as e:
            ref.reset([], system=words)
        assert e.value.tokens == count and e.value.limit == rt.max_context and isinstance(e.value, ValueError)
        assert ref.ask("Hi.", max_tokens=2).text is not None
        assert [r["text"] for r in ref.history() if r["role"] == "system"] == ["Be brief."]


def test_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        runtime.Nope  # noqa: B018


def test_importing_the_machinery_or_the_root_error_never_imports_the_actors():
    code = ("import sys, runtime, runtime.engine, runtime.store; runtime.KvactorsError; "
            "assert not [m for m in sys.modules if m.split('.')[0] == 'actors'], 'actors imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


# ---------------------------------------------------------------- the layers

_MAY_IMPORT = {"machinery": {"machinery"}, "actors": {"machinery", "actors"}, "api": {"machinery", "actors", "api"}}


def _layer(module: str) -> str:
    """`module`'s layer: "api" (runtime.api), "actors", or "machinery" (the rest of runtime)."""
    if module == "runtime.api" or module.startswith("runtime.api."):
        return "api"
    return "actors" if module.split(".")[0] == "actors" else "machinery"


def _imports(path: Path) -> set[str]:
    """The kvactors modules (or their names) that the file `path` imports anywhere, lazy imports included.

    `from runtime import Runtime` counts as importing the module that defines
    `Runtime`, since `runtime` re-exports it from there on first use.
    """
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: a relative import"
            found.add(node.module)
            for a in node.names:
                found.add(runtime._MODULE_OF.get(a.name, f"{node.module}.{a.name}") if node.module == "runtime"
                          else f"{node.module}.{a.name}")
    return {m for m in found if m.split(".")[0] in ("runtime", "actors")}


def test_the_import_graph_is_one_way_machinery_then_actors_then_api():
    edges = set()
    for package in ("runtime", "actors"):
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            for imported in _imports(path):
                edges.add((_layer(module), _layer(imported)))
                assert _layer(imported) in _MAY_IMPORT[_layer(module)], (
                    f"{module} ({_layer(module)}) imports {imported} ({_layer(imported)}): "
                    f"the {_layer(module)} may import only {sorted(_MAY_IMPORT[_layer(module)])}")
    assert {("api", "actors"), ("api", "machinery"), ("actors", "machinery")} <= edges  # the walk saw the stack
    assert _layer(runtime.Runtime.__module__) == "api" and _layer(runtime.Reply.__module__) == "actors"


# ---------------------------------------------------------------- the turn's options

_TURN_METHODS = {  # method -> what it leaves out of `send`'s keyword options
    runtime.AgentRef.ask: set(), runtime.AgentRef.ask_async: set(),
    runtime.AgentRef.stream: {"on_token"}, runtime.AgentRef.astream: {"on_token"},
    runtime.AgentRef.send_to: {"sender"},
    runtime.Runtime.converse: {"sender", "conversation_id", "turn_id", "on_token", "on_progress", "cancel"},
    runtime.Runtime.broadcast: {"sender", "conversation_id", "turn_id", "on_token", "on_progress", "cancel"},
}


def _keywords(fn) -> dict[str, inspect.Parameter]:
    return {n: p for n, p in inspect.signature(fn).parameters.items() if p.kind is p.KEYWORD_ONLY}


def test_turn_options_are_keyword_parameters_with_the_engines_defaults():
    from runtime.engine import Sampling, Turn
    from runtime.api.facade import TURN_TIMEOUT

    send = _keywords(runtime.AgentRef.send)
    turn = {f.name: f.default for f in dataclasses.fields(Turn)}
    sampling = {f.name: f.default for f in dataclasses.fields(Sampling)}
    defaults = {"max_tokens": turn["max_tokens"], **sampling, "stop": (), "timeout": TURN_TIMEOUT}
    assert {n: send[n].default for n in defaults} == defaults == {
        "max_tokens": 128, "temperature": 0.0, "top_p": 1.0, "seed": 0, "stop": (), "timeout": 60.0}
    assert set(send) - set(defaults) == {"sender", "conversation_id", "turn_id", "on_token", "on_progress", "cancel"}
    for fn, left_out in _TURN_METHODS.items():
        params = inspect.signature(fn).parameters.values()
        assert not any(p.kind is p.VAR_KEYWORD for p in params), f"{fn.__qualname__} takes **options"
        got = _keywords(fn)
        assert set(got) == set(send) - left_out, fn.__qualname__
        assert all(got[n].default == send[n].default for n in got), fn.__qualname__
    assert "max_tokens: 'int' = 128" in pydoc.render_doc(runtime.AgentRef.ask, renderer=pydoc.plaintext)


def test_public_methods_have_no_private_or_catch_all_parameters():
    for cls in (runtime.Runtime, runtime.AgentRef, runtime.ReplyFuture):
        for name, fn in inspect.getmembers(cls, inspect.isfunction):
            if name.startswith("_"):
                continue
            for p in inspect.signature(fn).parameters.values():
                assert not p.name.startswith("_"), f"{cls.__name__}.{name} takes {p.name}"
                assert p.kind is not p.VAR_KEYWORD, f"{cls.__name__}.{name} takes **{p.name}"
    assert "_reply_to_agent" not in inspect.signature(runtime.AgentRef.send).parameters


def test_an_unknown_option_is_a_type_error_at_the_call():
    ref = runtime.AgentRef(None, "a")  # binding the arguments fails before the runtime is touched
    with pytest.raises(TypeError, match="max_token"):
        ref.ask("hi", max_token=4)
    with pytest.raises(TypeError, match="_reply_to_agent"):
        ref.send("hi", _reply_to_agent="b")


def test_the_packages_ship_py_typed():
    for package in (runtime, actors):
        assert (Path(package.__file__).parent / "py.typed").is_file(), package.__name__
    assert '"py.typed"' in (ROOT / "pyproject.toml").read_text()


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


def _parameters(obj) -> dict:
    """`obj`'s parameters (a dataclass's fields) and their defaults (`inspect.Parameter.empty`: none)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: f.default for f in dataclasses.fields(obj)}
    return {n: p.default for n, p in inspect.signature(obj).parameters.items()}


def test_readme_api_section_names_only_what_exists():
    spans = re.findall(r"`([^`]+)`", _api_section())
    checked = defaults = 0
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
            if "=" in arg:
                try:
                    said = ast.literal_eval(arg.split("=", 1)[1].strip())
                except (ValueError, SyntaxError):
                    continue  # not a literal ("1 GiB"): the text explains it
                if said is Ellipsis:
                    continue  # "...": the text explains it
                assert params[name] == said, f"README: {span} says {name}={said!r}, but the default is {params[name]!r}"
                defaults += 1
    assert checked >= 40 and defaults >= 30, (checked, defaults)


def test_runtime_internals_are_private_and_faults_live_in_a_testing_helper(tmp_path):
    from runtime import AgentCrashed, AgentRef, Runtime
    from runtime.api import testing

    for name in ("env", "services", "supervisor", "escalation"):
        assert not hasattr(Runtime, name)
    assert not hasattr(AgentRef, "inject_crash")
    with Runtime(model="tiny", cache_dir=tmp_path) as rt:
        for name in ("env", "services", "supervisor", "escalation"):
            assert not hasattr(rt, name), name
        alice = rt.spawn("alice", system="Be brief.")
        testing.inject_crash(alice)
        with pytest.raises(AgentCrashed):
            alice.ask("Hello?", max_tokens=2, timeout=60)
        assert alice.ask("Hello again?", max_tokens=2, timeout=60).text is not None  # restarted


def test_an_io_timeout_beyond_what_a_wait_can_take_serves_as_the_longest_wait(tmp_path):
    """Any finite positive io_timeout is valid; one past threading.TIMEOUT_MAX (which overflowed every agent's
    first wait and escalated) waits as long as a wait can."""
    import threading

    from runtime import Runtime

    with Runtime(model="tiny", cache_dir=tmp_path, io_timeout=17179833343.0) as rt:
        assert rt.spawn("probe", system="Be brief.").ask("Hello.", max_tokens=2, timeout=60).agent == "probe"
        assert rt._env.io_timeout == threading.TIMEOUT_MAX


def test_text_with_a_lone_surrogate_is_refused_in_the_caller_with_what_to_do(tmp_path):
    """A str holding half a surrogate pair can be neither tokenized nor journaled: every text the facade takes
    refuses it with a ValueError naming the field, and the agent goes on."""
    from runtime import Runtime

    bad = "hi \ud800 there"
    with Runtime(model="tiny", cache_dir=tmp_path) as rt:
        with pytest.raises(ValueError, match="^system is not valid Unicode.*lone surrogate"):
            rt.spawn("probe", system="Be brief. \udfff")
        a = rt.spawn("probe", system="Be brief.")
        with pytest.raises(ValueError, match="^text is not valid Unicode.*character 3"):
            a.ask(bad, max_tokens=2, timeout=60)
        with pytest.raises(ValueError, match="stop string is not valid Unicode"):
            a.ask("Hello.", max_tokens=2, stop=["\ud800"], timeout=60)
        with pytest.raises(ValueError, match="conversation_id is not valid Unicode"):
            a.ask("Hello.", max_tokens=2, conversation_id="c\udc00", timeout=60)
        with pytest.raises(ValueError, match="note's text is not valid Unicode"):
            a.note(bad)
        with pytest.raises(ValueError, match="record's text is not valid Unicode"):
            a.reset([{"role": "user", "text": bad}])
        assert a.ask("Hello.", max_tokens=2, timeout=60).text is not None
        assert [r["role"] for r in a.history()] == ["system", "user", "assistant"]


def test_a_text_of_the_wrong_type_is_an_invalid_argument_type_wherever_the_facade_takes_one(tmp_path):
    """A wrong type raises InvalidArgumentType (a TypeError), as `runtime.errors` says: `ask(5)` and
    `spawn(system=5)` did, but `note(5)` and `reset([], system=5)` raised InvalidArgument (a ValueError)."""
    from runtime import InvalidArgument, InvalidArgumentType, Runtime

    with Runtime(model="tiny", cache_dir=tmp_path) as rt:
        a = rt.spawn("typed", system="Be brief.")
        for call in (lambda: a.ask(5), lambda: rt.spawn("other", system=5), lambda: a.note(5),
                     lambda: a.reset([], system=5)):
            with pytest.raises(InvalidArgumentType, match="must be a str"):
                call()
        with pytest.raises(InvalidArgument):  # the right type, an empty value
            a.note("")
        assert [r["role"] for r in a.history()] == ["system"]  # nothing reached the agent


def test_a_cache_dir_that_is_a_symlink_to_nothing_is_refused_with_where_it_points(tmp_path):
    """It failed with a bare FileExistsError; `kvactors inspect` said "no such folder"."""
    from runtime import NotAFolder, Runtime, store

    link = tmp_path / "agents"
    link.symlink_to(tmp_path / "gone")
    for path in (link, link / "more"):
        with pytest.raises(NotAFolder, match="symbolic link to .*gone.*which does not exist"):
            Runtime(model="no-such-model-is-loaded", cache_dir=path)
        with pytest.raises(NotAFolder, match="make the folder it points to"):
            store.inspect_table(path)
    (tmp_path / "gone").mkdir()
    assert "no agents stored" in store.inspect_table(link)


def test_a_cache_dir_that_is_a_file_is_refused_before_the_model_loads(tmp_path):
    """It failed with a bare FileExistsError ("[Errno 17] File exists") from deep in the start-up."""
    from runtime import KvactorsError, NotAFolder, Runtime

    afile = tmp_path / "notes.txt"
    afile.write_text("not a folder")
    for path in (afile, afile / "agents"):
        with pytest.raises(NotAFolder, match="is a file, not a cache folder") as e:
            Runtime(model="no-such-model-is-loaded", cache_dir=path)
        assert isinstance(e.value, (KvactorsError, NotADirectoryError))


def test_an_empty_model_is_refused_not_read_as_the_current_folder(tmp_path, monkeypatch, tiny_model_path):
    """model="" (`--model "$MODEL"` with MODEL unset) loaded the current folder: a model folder there was served
    under the default model's name, and anywhere else it failed saying ". has no config.json"."""
    from runtime import InvalidArgument, Runtime

    monkeypatch.chdir(tiny_model_path())
    for model in ("", "  "):
        with pytest.raises(InvalidArgument, match="model is empty"):
            Runtime(model=model, cache_dir=tmp_path / "c")
    rt = Runtime(model=".", cache_dir=tmp_path / "c")  # the current folder, named: served
    rt.shutdown()
