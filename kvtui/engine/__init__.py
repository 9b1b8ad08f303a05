"""The inspection engine: loads a model, owns the chat session and its cache, emits snapshots.

It imports no Textual and no Rich (a test checks), so it runs headless, in tests and in notebooks.
Exports resolve lazily: the TUI imports `kvtui.engine.records.snapshot` for its first frame without paying
for torch and transformers, which load in the model worker.
"""

from importlib import import_module

_EXPORTS = {
    "SamplerSettings": "chat.settings",
    "CacheOverflowError": "chat.session",
    "ChatSession": "chat.session",
    "SessionConfig": "chat.session",
    "SessionError": "chat.session",
    "BufferToken": "records.snapshot",
    "Diagnostic": "records.snapshot",
    "LayerInfo": "records.snapshot",
    "StepSnapshot": "records.snapshot",
    "TokenBuffer": "records.snapshot",
    "TopToken": "records.snapshot",
    "VerifyResult": "records.snapshot",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
