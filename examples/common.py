"""What the examples share: their command line."""

import argparse
import tempfile


def example_parser(doc: str, max_tokens: int, cache_dir: str | None = None) -> argparse.ArgumentParser:
    """An argument parser with the options every example takes: --model, --cache-dir, --max-tokens."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--model", default=None,
                        help="model folder, .gguf file, Hugging Face id, or 'tiny' (default: $KVACTORS_MODEL if set, "
                             "else SmolLM2-135M-Instruct)")
    parser.add_argument("--cache-dir", default=cache_dir,
                        help=f"where the agents' caches live (default: {cache_dir or 'a fresh temporary folder'})")
    parser.add_argument("--max-tokens", type=int, default=max_tokens,
                        help=f"tokens generated per turn (default: {max_tokens})")
    return parser


def cache_dir_of(args, name: str) -> str:
    """--cache-dir, or a fresh temporary folder named after the example."""
    return args.cache_dir or tempfile.mkdtemp(prefix=f"kvactors-{name}-")
