"""Replay a recorded trace without a model: rebuild every step's snapshot from its trace line.

The buffer is rebuilt the way the session built it: each step truncates to what the cache held
before it (buffer_length - fed) and appends the fed tokens; lists are shared between steps
(append-only, a truncation starts a new list), so holding every step costs O(total tokens).
"""

from __future__ import annotations

from ...fmt import quantization_text
from .codec import from_record
from .snapshot import BufferToken, Diagnostic, RowView, StepSnapshot, TokenBuffer, unknown_token
from .token_bytes import TokenBytes
from .trace import Trace, TraceError

ROLES = {"system": "system", "user": "user", "assistant": "assistant", "forced": "assistant"}


class SnapshotBuilder:
    """Step records -> snapshots, one at a time, keeping only the buffers' token lists (no history):
    the live viewer of the engine process rebuilds its snapshots with this, the way replay does."""

    def __init__(self, path=None):
        self.path = path  # named in errors
        self._items: list[BufferToken] = []
        self._caches: dict[str, list[BufferToken]] = {}  # a watched program's caches, by cache_id
        self._row_items: list[list[BufferToken]] = []
        self._requests: dict[tuple, list[BufferToken]] = {}  # a packed forward's requests, by (cache_id, request)
        self.token_bytes: dict[int, bytes] = {}  # learned from the lines' "bytes", shared by every snapshot
        self.count = 0

    def add(self, record: dict) -> StepSnapshot:
        self.count += 1
        number, path = self.count, self.path
        try:
            fed = [from_record(BufferToken, t) for t in record.get("fed") or []]
        except (KeyError, TypeError, AttributeError) as exc:
            raise TraceError(f"{path}: step line {number}: a fed token is malformed ({exc!r})") from None
        if len(fed) != len(record["input_ids"]):
            raise TraceError(f"{path}: step {record['step']} has no 'fed' tokens (recorded by an older kvtui?)")
        try:
            if record.get("requests") is not None:  # a packed forward: its rows are requests, row 0 the step's
                packed = self._request_rows(record)
                lead = packed[0].buffer if packed else TokenBuffer([])
                return from_record(StepSnapshot, record, buffer=lead, rows=packed, token_bytes=self.token_bytes)
            items = self._cache_items(record)
            self._items = _extend(items, record.get("buffer_length", len(items) + len(fed)), fed)
            if record.get("cache_id"):
                self._caches[record["cache_id"]] = self._items
            rows = None
            if record.get("rows"):
                while len(self._row_items) < len(record["rows"]):
                    self._row_items.append([])
                views = []
                for view in record["rows"]:
                    index = view["row"]
                    row_fed = [from_record(BufferToken, t) for t in view["fed"]]
                    self._row_items[index] = _extend(self._row_items[index], view["buffer_length"], row_fed)
                    views.append(from_record(RowView, view, buffer=TokenBuffer(self._row_items[index])))
                rows = tuple(views)
            return from_record(
                StepSnapshot, record, buffer=TokenBuffer(self._items), rows=rows, token_bytes=self.token_bytes
            )
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
            raise TraceError(f"{path}: step line {number}: a field is missing or malformed ({exc!r})") from None

    def _request_rows(self, record: dict) -> tuple[RowView, ...]:
        """A packed forward's rows, each request's buffer rebuilt from what it was fed, after the prefix a prefix
        match shared with it (fed by another request: the trace carries it once, on the request's first row;
        a trace without it shows those positions as unknown tokens)."""
        views = []
        for view in record.get("rows") or ():
            key = (record.get("cache_id"), view.get("request_id"))
            row_fed = [from_record(BufferToken, t) for t in view["fed"]]
            items = self._requests.get(key)
            if items is None:
                items = [from_record(BufferToken, t) for t in view.get("shared_prefix") or ()]
                held = view["buffer_length"] - len(row_fed)
                items += [unknown_token(i) for i in range(len(items), held)]
            self._requests[key] = items = _extend(items, view["buffer_length"], row_fed)
            views.append(from_record(RowView, view, buffer=TokenBuffer(items)))
        return tuple(views)

    def _cache_items(self, record: dict) -> list[BufferToken]:
        """The tokens the step's cache held: kvtui's own chat has one cache; a watched program's caches each
        have theirs, a copy starting with its parent's tokens and a cache filled unseen with unknown ones."""
        cache_id = record.get("cache_id")
        if not cache_id:
            return self._items
        items = self._caches.get(cache_id)
        if items is None:
            lineage = record.get("lineage") or {}
            if lineage.get("parent") in self._caches:
                items = list(self._caches[lineage["parent"]][: lineage.get("copied_at") or 0])
            else:
                items = [unknown_token(i) for i in range(lineage.get("unknown_prefix") or 0)]
        return items


class Replay:
    """A trace's steps as snapshots, with what each step's screen needs kept as running totals (the alarms so
    far, this turn's prefill, the tokens re-encoded so far), so showing step i costs O(1) lookups. `add_record`
    takes the records of a trace still being written, one at a time, in file order."""

    def __init__(self, trace: Trace):
        self.trace = trace
        self.header = trace.header
        self.snapshots: list[StepSnapshot] = []
        self._builder = SnapshotBuilder(trace.path)
        self._events: dict[int, list[dict]] = {}  # step -> what happened right after it (rewind, force, verify...)
        self._alarms: list[Diagnostic] = []  # every alarm in the order written: the steps' own, then records'
        self._alarm_counts: list[int] = []  # per snapshot: how many of _alarms had been raised by then
        self._prefills: list[int] = []  # per snapshot: the index of the last prefill at or before it (-1: none)
        self._recomputed: list[int] = []  # per snapshot: tokens re-encoded that another cache held, so far
        for record in trace.steps:
            self.add(record)
        for event in trace.events:  # read apart from the steps: a run's own alarms are shown from its last step
            self._add_event(event)

    def events_at(self, step: int) -> list[dict]:
        """The records written after step `step` and before the next one: verify, rewind, force, sampler..."""
        return self._events.get(step, [])

    def add(self, record: dict) -> StepSnapshot:
        """Rebuild one more step (a live source appends as records arrive)."""
        snapshot = self._builder.add(record)
        index = len(self.snapshots)
        self._alarms.extend(snapshot.diagnostics)
        self._prefills.append(index if snapshot.phase == "prefill" else self._prefills[-1] if index else -1)
        self._recomputed.append((self._recomputed[-1] if index else 0) + (snapshot.recomputed or 0))
        self._alarm_counts.append(len(self._alarms))
        self.snapshots.append(snapshot)  # last: another thread may read snapshots while this one appends
        return snapshot

    def add_record(self, record: dict) -> StepSnapshot | None:
        """Any record of the trace, in file order (a followed trace): a step is rebuilt and returned."""
        kind = record.get("type")
        if kind == "step":
            return self.add(record)
        if kind == "header":
            self.header = self.trace.header = record
        elif kind == "buffer":
            self.trace.buffers.append(record)
        else:
            self.trace.events.append(record)
            self._add_event(record)
        return None

    def _add_event(self, event: dict) -> None:
        if isinstance(event.get("step"), int):
            self._events.setdefault(event["step"], []).append(event)
        if event.get("type") == "diagnostic":  # a run's alarm raised after its steps (rank-desync): shown from now
            try:
                alarm = from_record(Diagnostic, event)
            except (KeyError, TypeError, ValueError) as exc:  # a code this kvtui does not register, a field missing
                raise TraceError(f"a diagnostic line kvtui cannot read ({exc})") from None
            self._alarms.append(alarm)
            if self._alarm_counts:
                self._alarm_counts[-1] = len(self._alarms)

    def diagnostics_through(self, index: int) -> tuple[Diagnostic, ...]:
        """Every alarm raised up to snapshot `index` (and the run's own alarms written after it)."""
        return tuple(self._alarms[: self._alarm_counts[index]])

    def prefill_for(self, index: int) -> StepSnapshot | None:
        """The last prefill at or before snapshot `index`: the turn's reuse meter."""
        found = self._prefills[index]
        return self.snapshots[found] if found >= 0 else None

    def recomputed_through(self, index: int) -> int:
        return self._recomputed[index]

    def snapshot_at(self, step: int) -> StepSnapshot | None:
        """The snapshot of step number `step` (an alarm's step), None if none was recorded."""
        return next((s for s in self.snapshots if s.step == step), None)

    @property
    def diagnostics(self) -> tuple[Diagnostic, ...]:
        return tuple(self._alarms)

    def __len__(self) -> int:
        return len(self.snapshots)

    def describe(self) -> str:
        h = self.header
        return (
            # most telling first: a narrow status line drops the parts at the end
            f"replay · {h.get('model', '?')} · {h.get('device', '?')} · {h.get('dtype', '?')} · "
            f"{h.get('cache', '?')} cache · {h.get('model_class', '?')} · transformers {h.get('transformers', '?')}"
            + (f" · tensor parallel over {h['tensor_parallel']} ranks" if h.get("tensor_parallel") else "")
        )


def transcript(buffer, token_bytes: TokenBytes | None = None) -> list[dict]:
    """The chat as recorded: runs of tokens by role (template markup left out), each run's text rebuilt from its
    tokens' bytes (`token_bytes`: where a piece is not its token's bytes), so a split character comes back whole."""
    table = token_bytes or {}
    messages: list[dict] = []
    for token in buffer:
        role = ROLES.get(token.origin)
        if role is None:
            continue
        data = table.get(token.id)
        if data is None:
            data = token.piece.encode()
        if messages and messages[-1]["role"] == role and messages[-1]["turn"] == token.turn:
            messages[-1]["content"] += data
        else:
            messages.append({"role": role, "content": data, "turn": token.turn})
    return [{"role": m["role"], "content": m["content"].decode("utf-8", errors="replace")} for m in messages]


def describe_event(event: dict) -> str:
    """One line for a recorded event, as replay shows it."""
    kind = event.get("type")
    if kind == "rewind":
        return f"rewind: the cache went back from {event.get('from_length')} to {event.get('to_length')} tokens"
    if kind == "force":
        return f"forced {event.get('text')!r} (id {event.get('id')}, rank {event.get('rank')}) as the next token"
    if kind == "sampler":
        return "sampler changed: " + ", ".join(
            f"{k} {event[k]}" for k in ("temperature", "top_k", "top_p", "repetition_penalty", "seed") if k in event
        )
    if kind == "watch":
        return f"watching {event.get('text')!r} (id {event.get('id')})"
    if kind == "verify":
        verdict = "matched" if event.get("ok") else "DIFFERED FROM"
        errors = [tuple(pair) for pair in event.get("layer_errors") or ()]
        return (
            f"verify: the cache {verdict} a full recompute (max |diff| {event.get('max_abs_diff', 0):.2e})"
            + quantization_text(tuple(errors) or None)
        )
    if kind == "diagnostic":
        return f"{event.get('severity')} {event.get('code')}: {event.get('message')}"
    if kind == "reset":
        return "the cache and the chat were reset"
    if kind == "export":
        return "the cache was exported" + (f" to {event['path']}" if event.get("path") else "")
    return str(kind)


def _extend(items: list[BufferToken], length: int, fed: list[BufferToken]) -> list[BufferToken]:
    """The buffer after a step: what the cache held before it (length - fed), then the fed tokens."""
    keep = length - len(fed)
    if keep < len(items):
        items = items[:keep]  # a rewind, a crop or a template drift: a new list, earlier views stay valid
    items.extend(fed)
    return items
