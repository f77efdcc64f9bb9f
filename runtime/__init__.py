"""kvactors' machinery: models, the Q4 cache, the engine, the store; and the `Runtime` facade.

`from runtime import Runtime` is lazy, so importing a submodule (e.g. `runtime.engine`,
which the actors import) never imports the actors. Every error kvactors defines is
importable from here; those the API raises derive from `KvactorsError` (see `runtime.errors`).
"""

import importlib

from runtime.errors import KvactorsError

# module -> the public names it defines, imported from there on first use
_EXPORTS = {
    "runtime.facade": ("Runtime", "AgentRef", "ReplyFuture", "DeadLetter", "AgentInfo",
                       "RuntimeEscalated", "RuntimeClosed", "SystemPromptChanged"),
    "actors.agent": ("Reply", "AgentError", "AgentCrashed", "TurnTimeout", "TurnNotSaved", "TurnTooLong",
                     "UnknownAgent"),
    "actors.batcher": ("BatcherStopped", "BatcherCrashed"),
    "actors.supervisor": ("UnknownChild",),
    "runtime.engine": ("TurnError", "TurnAbandoned", "TurnTooLarge"),
    "runtime.q4cache": ("Q4CacheError",),
    "runtime.store": ("CacheDirInUse", "InvalidAgentId", "JournalError", "UnsafePath", "CacheError", "CacheMissing",
                      "CorruptCache", "TruncatedCache", "UnsupportedVersion", "ChecksumMismatch", "ForeignModel",
                      "QuantizationMismatch", "ShapeMismatch", "UnreadableCache"),
    "runtime.model": ("ModelLoadError", "DefaultModelMissing"),
    "runtime.gguf": ("GGUFError", "UnsupportedGGUF"),
    "runtime.deadlines": ("DeadlinesClosed",),
    "runtime.serve": ("ApiError",),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = ["KvactorsError", *_MODULE_OF]


def __getattr__(name):
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'runtime' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__():
    return sorted({*globals(), *__all__})
