"""The root of kvactors' errors: `KvactorsError`.

Every error the API raises derives from `KvactorsError` and also keeps the builtin
base that says what kind of problem it is (`ValueError` for a bad argument, `OSError`
for a file, `RuntimeError` for a state, `KeyError` for a missing name), so
`except KvactorsError` catches every one of them and `except ValueError` still catches
the bad arguments. Every error type kvactors defines is importable from `runtime`; the
engine's `TurnError` family and `Q4CacheError`, which stay inside the runtime, do not
derive from it yet.

This module imports nothing: any module may import it without an import cycle.
"""


class KvactorsError(Exception):
    """Base class of every error kvactors defines; catch it to handle all of them."""
