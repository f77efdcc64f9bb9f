"""kvactors' machinery: models, the Q4 cache, the engine, the store; and the `Runtime` facade.

`from runtime import Runtime` is lazy, so importing a submodule (e.g. `runtime.engine`,
which the actors import) never imports the actors.
"""

_FACADE = ("Runtime", "AgentRef", "ReplyFuture", "RuntimeEscalated", "RuntimeClosed", "DeadLetter",
           "AgentInfo", "SystemPromptChanged")
_AGENT = ("Reply", "AgentCrashed", "TurnTimeout", "TurnNotSaved", "TurnTooLong", "UnknownAgent", "AgentError")
_STORE = ("CacheDirInUse", "InvalidAgentId", "JournalError", "UnsafePath")
_MODEL = ("ModelLoadError", "DefaultModelMissing")
_GGUF = ("GGUFError", "UnsupportedGGUF")

__all__ = [*_FACADE, *_AGENT, *_STORE, *_MODEL, *_GGUF]


def __getattr__(name):
    if name in _FACADE:
        from runtime import facade

        return getattr(facade, name)
    if name in _AGENT:
        from actors import agent

        return getattr(agent, name)
    if name in _STORE:
        from runtime import store

        return getattr(store, name)
    if name in _MODEL:
        from runtime import model

        return getattr(model, name)
    if name in _GGUF:
        from runtime import gguf

        return getattr(gguf, name)
    raise AttributeError(f"module 'runtime' has no attribute {name!r}")
