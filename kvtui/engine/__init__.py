"""The inspection engine: loads a model, owns the chat session and its cache, emits snapshots.

It imports no Textual and no Rich (a test checks), so it runs headless, in tests and in notebooks.
"""

from .sampling import SamplerSettings
from .session import CacheOverflowError, ChatSession, SessionConfig, SessionError
from .snapshot import BufferToken, Diagnostic, LayerInfo, StepSnapshot, TokenBuffer, TopToken, VerifyResult

__all__ = [
    "BufferToken", "CacheOverflowError", "ChatSession", "Diagnostic", "LayerInfo", "SamplerSettings",
    "SessionConfig", "SessionError", "StepSnapshot", "TokenBuffer", "TopToken", "VerifyResult",
]
