"""kvactors: `from runtime import Runtime`, and every error kvactors defines.

Three layers, each importing only the ones below it:

1. the machinery, `runtime/*.py`: models, the Q4 cache, the engine, the store; free
   of actor concerns, it never imports `actors` or `runtime.api`;
2. the actors, `actors/`: agents, the batcher, persistence and supervision, on the machinery;
3. the API, `runtime/api/`: `Runtime` and `AgentRef`, the CLI, the demo and the HTTP
   server, on top of both.

The names below are re-exported lazily (imported from their module on first use),
and this is why: the actors import machinery modules (`runtime.engine`,
`runtime.store`), and Python runs this file before any `runtime.*` module. Importing
`Runtime` here eagerly would make importing any machinery module import the actors
and the API, and the actors' own imports circular. `tests/test_api.py` checks the
layers in the source. Only `runtime.errors` (`KvactorsError`, the root of every
error the API raises, and the bad-argument errors) is imported at once.
"""

import importlib

from runtime.errors import AdvisedError, InvalidArgument, InvalidArgumentType, KvactorsError

# module -> the public names it defines, imported from there on first use
_EXPORTS = {
    "runtime.api.facade": ("Runtime", "AgentRef", "ReplyFuture", "DeadLetter", "AgentInfo",
                           "RuntimeEscalated", "RuntimeClosed", "SystemPromptChanged", "SystemPromptTooLong", "WaitTimeout",
                           "WaitsInCallback"),
    "actors.agent": ("Reply", "AgentError", "AgentCrashed", "AgentStopped", "TurnTimeout", "TurnNotSaved", "TurnTooLong",
                     "UnknownAgent"),
    "actors.batcher": ("BatcherStopped", "BatcherCrashed"),
    "actors.supervisor": ("UnknownChild",),
    "runtime.engine": ("TurnError", "TurnAbandoned", "TurnTooLarge", "CallbackFailed"),
    "runtime.q4cache": ("Q4CacheError",),
    "runtime.kvscheme": ("KVSchemeError",),
    "runtime.store": ("CacheDirInUse", "AgentInUse", "InvalidAgentId", "JournalError", "UnsafePath", "NotAFolder", "CacheError", "CacheMissing",
                      "CorruptCache", "TruncatedCache", "UnsupportedVersion", "ChecksumMismatch", "ForeignModel",
                      "QuantizationMismatch", "ShapeMismatch", "UnreadableCache"),
    "runtime.model": ("ModelLoadError", "DefaultModelMissing"),
    "runtime.chat": ("ChatTemplateError",),
    "runtime.gguf": ("GGUFError", "UnsupportedGGUF"),
    "runtime.deadlines": ("DeadlinesClosed",),
    "runtime.api.serve": ("ApiError",),
    "runtime.api.cluster": ("RayMissing", "NodeDown", "ClusterRuntime"),
    "runtime.api.rayhost": ("ClusterError",),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = ["KvactorsError", "AdvisedError", "InvalidArgument", "InvalidArgumentType", *_MODULE_OF]


def __getattr__(name):
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'runtime' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__():
    return sorted({*globals(), *__all__})
