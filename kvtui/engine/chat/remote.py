"""The app's view of the ChatSession that runs in the engine process: what its records said last
(the chat and the alarms are the app's own `messages` and `diagnostics`).

Plain values only (no torch, no Textual); the app updates it on its own thread from the `ready`,
`session` and `state` records (engine/records/stream.py) and the step snapshots rebuilt from step records.
"""

from __future__ import annotations

from ..records.codec import from_record
from ..records.snapshot import Diagnostic, TokenBuffer
from .settings import SamplerSettings


class RemoteSession:
    def __init__(self, ready: dict):
        self.pid: int = ready.get("pid", 0)
        self._description: str = ready.get("description", "")
        self._description_parts: list[str] | None = ready.get("description_parts")
        self.query_heads = ready.get("query_heads")
        self.kv_heads = ready.get("kv_heads")
        self.steps = self.turn = self.cache_length = 0
        self.capacity: int | None = None
        self.sampler = SamplerSettings()
        self.buffer = TokenBuffer([])  # the latest step's buffer, as the step records rebuilt it
        self.restorable: dict = {}  # what a restarted engine needs besides the tokens (session.restorable())
        self.update(ready)

    @property
    def description(self) -> str:
        """The status line's model text, naming the sampler in use now (`o` changes it after `ready`)."""
        if self._description_parts is None:
            return self._description
        head, tail = self._description_parts
        return f"{head} · {self.sampler.describe()}{tail}"

    def update(self, record: dict) -> None:
        for key in ("steps", "turn", "cache_length", "capacity", "restorable"):
            if key in record:
                setattr(self, key, record[key])
        if "sampler" in record:
            self.sampler = SamplerSettings(**record["sampler"])
        if record.get("buffer_length") == 0:  # rewound to nothing or reset: no step record says so
            self.buffer = TokenBuffer([])


def diagnostics_from(records: list[dict]) -> tuple[Diagnostic, ...]:
    return tuple(from_record(Diagnostic, d) for d in records)
