"""The `kvactors` command line: demo, serve, inspect, prune, import-gguf, bench."""

from __future__ import annotations

import argparse
import faulthandler
import logging
import math
import os
import re
import sys
from pathlib import Path

from runtime.errors import KvactorsError


def _demo(args) -> int:
    from runtime.api.demo import run_demo

    return run_demo(model=args.model, cache_dir=args.cache_dir, max_tokens=args.max_tokens, kv_bits=args.kv_bits,
                    kv_scheme=args.kv_scheme)


def _serve(args) -> int:
    try:
        from runtime.api.serve import serve
    except ImportError as e:
        print(f"kvactors serve needs the serve extra ({e.name} is missing): pip install 'kvactors[serve]'",
              file=sys.stderr)
        return 2
    # an empty --api-key is refused (serve's check), not taken as none; an empty $KVACTORS_API_KEY is unset
    api_key = args.api_key if args.api_key is not None else os.environ.get("KVACTORS_API_KEY") or None
    return serve(model=args.model, cache_dir=args.cache_dir, host=args.host, port=args.port,
                 api_key=api_key, max_agents=args.max_agents,
                 default_max_tokens=args.max_tokens, turn_timeout=args.turn_timeout, log_level=args.log_level,
                 durability=args.durability, max_batch=args.max_batch)


def _inspect(args) -> int:
    from runtime.store import inspect_table

    if not args.cache_dir:  # as Runtime(cache_dir="") and `serve --cache-dir ''` say, not the current folder
        raise ValueError("cache_dir is empty: give a folder, or leave it out for the default")
    print(inspect_table(args.cache_dir))
    return 0


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def duration_s(text: str) -> float:
    """Seconds in `text`: a number of seconds, or one with the suffix s, m, h or d ("90", "30m", "12h", "30d");
    ValueError saying the form otherwise."""
    number, unit = (text[:-1], text[-1]) if text[-1:].lower() in _UNITS else (text, "s")
    try:
        seconds = float(number) * _UNITS[unit.lower()]
    except ValueError:
        seconds = math.nan
    if number.strip() != number or not math.isfinite(seconds) or seconds < 0:  # float() allows spaces, nan, inf
        raise ValueError(f"bad duration {text!r}: give seconds, or a number >= 0 with s, m, h or d after it "
                         "(90, 30m, 12h, 30d)")
    return seconds


def _prune(args) -> int:
    from runtime.store import CacheDirInUse, check_cache_folder, counted, human_bytes, lock_cache_dir, prune_agents

    if not args.cache_dir:  # as inspect says
        raise ValueError("cache_dir is empty: give a folder, or leave it out for the default")
    max_age = duration_s(args.older_than)
    logging.basicConfig(format="kvactors prune: %(message)s")  # the store's warning per agent it cannot prune
    root = check_cache_folder(Path(args.cache_dir).expanduser())
    if not root.is_dir():  # lock_cache_dir would make it
        raise FileNotFoundError(f"{root}: no such folder")
    try:
        lock = lock_cache_dir(root)  # the lock a Runtime holds on it: never prune under a running one
    except CacheDirInUse:
        raise CacheDirInUse(f"{root} is in use by a running Runtime (or kvactors serve): shut it down first, or give "
                            "it retention_s to prune at its start") from None
    try:
        pruned = prune_agents(root, max_age, dry_run=args.dry_run)
    finally:
        os.close(lock)
    verb = "would delete" if args.dry_run else "deleted"
    if not pruned:
        print(f"no agent's cache idle over {args.older_than} in {root}: nothing to delete")
        return 0
    for p in pruned:
        if p.paths:
            print(f"{p.folder.relative_to(root)}: {verb} {', '.join(f.name for f in p.paths)} ({human_bytes(p.nbytes)})")
    done = [p for p in pruned if p.paths and not p.error]
    failed = [p for p in pruned if p.error]
    freed = sum(p.nbytes for p in pruned)
    print(f"{verb} the caches of {counted(len(done), 'agent')} idle over {args.older_than}: "
          f"{human_bytes(freed)} ({freed} bytes) {'would be ' if args.dry_run else ''}freed; journals kept"
          + (f"; {counted(len(failed), 'folder')} could not be pruned (the warnings say why)" if failed else ""))
    return 1 if failed else 0


def _import_gguf(args) -> int:
    from runtime.gguf import gguf_model_path, import_gguf, stderr_progress

    progress = stderr_progress(Path(args.file).name)
    if args.out is None:
        out = gguf_model_path(args.file, args.weights, progress)
    else:
        out = import_gguf(args.file, args.out, args.weights, progress)
    print(out)
    return 0


def _bench(args) -> int:
    sys.path.insert(0, os.getcwd())  # the benchmarks/ folder of a source checkout
    try:
        from benchmarks.__main__ import main as bench_main
    except ImportError:
        print("kvactors bench runs from a source checkout (the benchmarks/ folder); "
              "cd into it or run `python -m benchmarks`", file=sys.stderr)
        return 2
    return bench_main(args.bench_args)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the `kvactors` command."""
    p = argparse.ArgumentParser(
        prog="kvactors",
        description="Persistent LLM agents as actors, with batched 4-bit KV caches kept on disk.",
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    demo = sub.add_parser(
        "demo", help="run a short multi-agent demo (default: the embedded SmolLM2-135M-Instruct)",
        description="Two agents talk, then answer together (batched), then resume from disk after a restart: "
                    "prints each turn's cache state (cold / hot / warm) and time to first token.",
    )
    demo.add_argument("--model", default=None,
                      help="model folder, .gguf file, Hugging Face id or 'tiny' (default: $KVACTORS_MODEL if set, "
                           "else SmolLM2-135M-Instruct)")
    demo.add_argument("--cache-dir", default=None, help="where agent caches live (default: a fresh temporary folder)")
    demo.add_argument("--max-tokens", type=int, default=16, help="tokens generated per turn (default: 16)")
    kv = demo.add_mutually_exclusive_group()
    kv.add_argument("--kv-bits", type=int, choices=(4, 8), default=None,
                    help="a plain KV cache of this many bits for keys and values (SmolLM2-135M's answers degrade "
                         "at 4; default: the model's default KV scheme)")
    kv.add_argument("--kv-scheme", default=None,
                    help="KV scheme by name, e.g. k6v4-g64-hadamard (the default for most models) or k8v8-g64")
    demo.set_defaults(func=_demo)

    srv = sub.add_parser(
        "serve", help="serve an OpenAI-compatible endpoint where every conversation is a persistent agent",
        description="POST /v1/chat/completions (streaming and not), GET /v1/models, GET /health, and the native "
                    "agent routes under /v1/agents. A request's agent is named by the X-Agent-Id header, or "
                    "derived from its user field, system prompt and first user message. Ctrl-C or SIGTERM stops it: "
                    "it takes no new request and waits for the turns still running; a second Ctrl-C or SIGTERM stops "
                    "it at once, those turns unfinished and not saved (a streamed one may keep what it had sent), as does "
                    "one while the agents' state is being saved after that. Every turn already answered is saved "
                    "either way.",
    )
    srv.add_argument("--model", default=None,
                     help="model folder, .gguf file, Hugging Face id or 'tiny' (default: $KVACTORS_MODEL if set, "
                           "else SmolLM2-135M-Instruct)")
    srv.add_argument("--cache-dir", default=None, help="where agent caches live (default: ~/.cache/kvactors/agents)")
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s, loopback only)")
    srv.add_argument("--port", type=int, default=8000, help="port (default: %(default)s)")
    srv.add_argument("--api-key", default=None,
                     help="require 'Authorization: Bearer KEY' on every request but /health "
                          "(default: $KVACTORS_API_KEY, else none)")
    srv.add_argument("--max-agents", type=int, default=256,
                     help="agents kept running once their requests end (a busy one is never stopped); beyond it the "
                          "idle ones whose last request ended longest ago stop, and resume from disk when needed "
                          "(default: %(default)s)")
    srv.add_argument("--max-tokens", type=int, default=512,
                     help="tokens generated when a request gives no max_tokens (default: %(default)s)")
    srv.add_argument("--durability", default="durable", choices=["durable", "memory"],
                     help="durable: a reply is sent once its turn is fsynced in the journal (the cache file follows); "
                          "memory: at once (default: %(default)s)")
    srv.add_argument("--max-batch", type=int, default=16, help="turns decoded together at most (default: %(default)s)")
    srv.add_argument("--turn-timeout", type=float, default=600.0, help="seconds a turn may take (default: %(default)s)")
    srv.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                     help="uvicorn's log level: its startup, request and shutdown lines (default: %(default)s)")
    srv.set_defaults(func=_serve)

    ins = sub.add_parser(
        "inspect", help="list the agents stored in a cache folder",
        description="A table per model: each stored agent's cached tokens, bytes on disk, last turn and health "
                    "(ok, or what is wrong with which of its files and what to do). Reads only; follows no symlink "
                    "inside the cache folder.",
    )
    ins.add_argument("cache_dir", nargs="?", default="~/.cache/kvactors/agents", help="cache folder (default: %(default)s)")
    ins.set_defaults(func=_inspect)

    prn = sub.add_parser(
        "prune", help="delete the caches of agents idle longer than a duration (journals stay)",
        description="Deletes the cache files (never the journals) of the agents in a cache folder, of every model, "
                    "whose files were not written for --older-than: what Runtime(retention_s=...) deletes at its "
                    "start, without loading a model. Such an agent resumes from its journal (re-prefilled) at its "
                    "next turn. Prints one line per agent (what it deleted and the bytes) and a summary. Refused "
                    "while a Runtime (or kvactors serve) runs on the folder. Exit status 0, 1 when an agent's files "
                    "could not be deleted (a warning says which and why; the others are still pruned), 2 when "
                    "nothing could start (no such folder, a bad duration, the folder in use).",
        epilog="example: kvactors prune ~/.cache/kvactors/agents --older-than 30d --dry-run",
    )
    prn.add_argument("cache_dir", nargs="?", default="~/.cache/kvactors/agents", help="cache folder (default: %(default)s)")
    prn.add_argument("--older-than", required=True, metavar="DURATION",
                     help="idle time: seconds, or a number with s, m, h or d (90, 30m, 12h, 30d)")
    prn.add_argument("--dry-run", action="store_true", help="delete nothing: print what would be deleted")
    prn.set_defaults(func=_prune)

    imp = sub.add_parser(
        "import-gguf", help="convert a GGUF file (llama, qwen2) into an mlx-lm model folder",
        description="Converts FILE into the mlx-lm folder OUT (default: the model cache under $KVACTORS_HOME/models, "
                    "where Runtime(model=FILE) finds the folder of this machine's default --weights) and prints the folder; "
                    "how far the conversion is goes to standard error (tensors converted: at the first, every 2 s, and at the end). "
                    "Runtime(model=FILE) converts on first use by itself. OUT must not exist: an existing one is "
                    "refused and left as it is. The folder appears only once complete; a conversion killed midway "
                    "leaves no OUT, and the next one into OUT removes what it left. Of two conversions into one OUT "
                    "at once, the second waits for the first, then refuses OUT.",
    )
    imp.add_argument("file", help="the .gguf file")
    imp.add_argument("out", nargs="?", default=None,
                     help="the new model folder, which must not exist yet (default: the model cache)")
    imp.add_argument("--weights", choices=("float32", "quantized"), default=None,
                     help="exactly dequantized float32, or the file's 4/8-bit weights (default: float32 on CPU, "
                          "quantized on a GPU)")
    imp.set_defaults(func=_import_gguf)

    bench = sub.add_parser("bench", help="run the benchmarks from a source checkout (see `kvactors bench --help`)")
    bench.add_argument("bench_args", nargs=argparse.REMAINDER, help="arguments passed to the benchmark driver")
    bench.set_defaults(func=_bench)
    return p


def _negative_values_joined(argv: list[str], option: str) -> list[str]:
    """`argv` with `option VALUE` as `option=VALUE` where VALUE reads as a negative number ("-1d"), which argparse
    takes for an option ("expected one argument"): then the value's own check says what is wrong with it."""
    out = list(argv)
    for i in range(len(out) - 2, -1, -1):
        if out[i] == option and re.match(r"-[0-9.]", out[i + 1]):
            out[i : i + 2] = [f"{option}={out[i + 1]}"]
    return out


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `kvactors` console script; returns the process exit code."""
    argv = sys.argv[1:] if argv is None else argv
    if not faulthandler.is_enabled():  # a crash in native code (MLX, CUDA) leaves every thread's Python stack
        try:
            faulthandler.enable()
        except (RuntimeError, ValueError, OSError):  # no standard error to write it to (2>&-): run without it
            pass
    if hasattr(sys.stdout, "reconfigure"):  # paths that are not UTF-8 (os.fsdecode's surrogates) print as their bytes
        sys.stdout.reconfigure(errors="surrogateescape")
    if argv[:1] == ["bench"]:  # everything after `bench` belongs to the benchmark driver
        return _bench(argparse.Namespace(bench_args=argv[1:]))
    parser = build_parser()
    args = parser.parse_args(_negative_values_joined(argv, "--older-than"))
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        return args.func(args)
    except (KvactorsError, ValueError, OSError) as e:  # a bad option or path, a missing model: one line says it
        print(f"kvactors {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
