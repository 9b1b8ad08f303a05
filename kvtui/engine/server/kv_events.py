"""KV cache events as vLLM and SGLang publish them (ZeroMQ, msgpack), decoded into kvtui's own types.

A message is multipart `(topic, sequence number as 8 big-endian bytes, payload)`. The payload is an
EventBatch: `[ts, [event, ...]]`, with the data-parallel rank as a third item where the server sends it.
An event is a map with a `"type"` key (vLLM 0.32: `msgspec` tagged structs) or an array whose first item is
the type (older vLLM and SGLang: `array_like` structs); both decode here:

    BlockStored(block_hashes, parent_block_hash, token_ids, block_size, lora_id, [medium, lora_name, ...])
    BlockRemoved(block_hashes, [medium, ...])
    AllBlocksCleared()

Only newly stored full blocks are announced: a prefix hit stores nothing. Block hashes are ints (uint64) or
bytes depending on the server's settings; kvtui keys them as hex text, the same for both.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import field
from typing import Any

import msgpack

from ..records.snapshot import frozen

STORED = "stored"
REMOVED = "removed"
CLEARED = "cleared"
_UINT64 = 2**64 - 1


class UndecodablePayload(ValueError):
    """A payload that is not an event batch; the message says what was wrong, the caller skips it."""


@frozen
class BlocksStored:
    """Full blocks newly written to the prefix cache, in chain order: block i holds
    token_ids[i * block_size : (i + 1) * block_size] and is the parent of block i + 1."""

    hashes: tuple[str, ...]
    parent: str | None  # the block before the first one (None: the chain starts here)
    token_ids: tuple[int, ...]
    block_size: int  # 0: a store naming hashes only, no tokens (vLLM's offloading tiers without self-describing events)
    group: int = 0  # the KV cache group (one per attention kind in hybrid models)
    medium: str | None = None  # GPU / CPU / STORAGE where the server says
    lora: str | None = None
    kind: str | None = None  # full_attention / sliding_window ... where the server says
    extra: tuple[str, ...] = ()  # per block, the extra keys its hash covers (vLLM's extra_keys: LoRA, multimodal
    # ids, cache salt) as text; () where the server sends none
    session: str | None = None  # the session of the request that stored (or reused) them, where its client gave one
    # (vLLM 0.32's session_id: the request's `session_id`, its X-Session-ID header or vllm_xargs.session_id)
    type: str = STORED
    ids: array | None = field(default=None, compare=False, repr=False)  # token_ids as array('l'), where the decoder
    # made one (its check that they are ints): the index slices each block's tokens from it, and need not build it again


@frozen
class BlocksRemoved:
    hashes: tuple[str, ...]
    group: int | None = None
    medium: str | None = None
    type: str = REMOVED


@frozen
class AllCleared:
    type: str = CLEARED


Event = BlocksStored | BlocksRemoved | AllCleared


@frozen
class EventBatch:
    """One published message: its sequence number (per publisher), time, events and data-parallel rank."""

    seq: int
    ts: float
    events: tuple[Event, ...]
    dp_rank: int = 0
    skipped: int = 0  # events of a type kvtui does not know (counted, never silently lost)
    caught_up: bool = False  # given by the replay socket when kvtui attached: it happened before kvtui watched


def block_key(value: Any) -> str:
    """A block hash as kvtui keys it: ints as 16 hex digits (uint64), bytes as their hex."""
    if type(value) is int:  # what vLLM sends by default: first, one check (bool is not `int` here)
        return f"{value & _UINT64:016x}"
    if isinstance(value, bool) or value is None:
        raise UndecodablePayload(f"a block hash is {value!r}")
    if isinstance(value, int):
        return f"{value & _UINT64:016x}"
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).hex()
    if isinstance(value, str):
        return value
    raise UndecodablePayload(f"a block hash is a {type(value).__name__}")


def _keys(values: Any) -> tuple[str, ...]:
    if not isinstance(values, (list, tuple)):
        raise UndecodablePayload(f"block_hashes is a {type(values).__name__}, not a list")
    return tuple(map(block_key, values))


_LONGS = "l" if array("l").itemsize == 8 else "q"  # 64-bit ints; "l", as the index keeps tokens, where it is 64-bit


def _ints(values: Any, what: str) -> tuple[tuple[int, ...], array]:
    """The ids as a tuple, and as the array of 64-bit ints that checked them."""
    if not isinstance(values, (list, tuple)):
        raise UndecodablePayload(f"{what} is not a list of ints")
    try:
        ids = array(_LONGS, values)  # checks every item is an int in C (a Python loop costs more than a batch's rest)
    except (TypeError, OverflowError):
        raise UndecodablePayload(f"{what} is not a list of ints") from None
    return tuple(values), ids


def _text(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


def _stored(fields: dict[str, Any]) -> BlocksStored:
    hashes = _keys(fields.get("block_hashes"))
    parent = fields.get("parent_block_hash")
    tokens, ids = _ints(fields.get("token_ids"), "token_ids")
    size = fields.get("block_size")
    if not isinstance(size, int) or size < 0 or (size == 0 and tokens):  # 0 with no tokens: a store of hashes only
        raise UndecodablePayload(f"block_size is {size!r}")  # (vLLM's offloading connector names the medium only)
    if len(tokens) < len(hashes) * size:
        raise UndecodablePayload(f"{len(hashes)} blocks of {size} tokens announced with {len(tokens)} token ids")
    lora = fields.get("lora_name") if fields.get("lora_name") is not None else fields.get("lora_id")
    group = fields.get("group_idx")
    return BlocksStored(
        hashes=hashes,
        parent=None if parent is None else block_key(parent),
        token_ids=tokens,
        block_size=size,
        group=group if isinstance(group, int) else 0,
        medium=_text(fields.get("medium")),
        lora=None if lora is None else str(lora),
        kind=_text(fields.get("kv_cache_spec_kind")),
        extra=_extra_keys(fields.get("extra_keys"), len(hashes)),
        session=_text(fields.get("session_id")),
        ids=ids if ids.typecode == "l" else None,
    )


def _extra_keys(values: Any, blocks: int) -> tuple[str, ...]:
    """vLLM's extra_keys (one entry per block, None or a list of values) as text per block; () where absent."""
    if not isinstance(values, (list, tuple)) or not any(values):
        return ()
    return tuple("" if not v else repr(tuple(v) if isinstance(v, list) else v) for v in values[:blocks])


def _removed(fields: dict[str, Any]) -> BlocksRemoved:
    group = fields.get("group_idx")
    return BlocksRemoved(
        hashes=_keys(fields.get("block_hashes")),
        group=group if isinstance(group, int) else None,
        medium=_text(fields.get("medium")),
    )


# the array encoding's field order, per type (vLLM before the map encoding, SGLang)
_ARRAY_FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name"),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}


def decode_event(raw: Any) -> Event | None:
    """One event of either encoding; None for a type kvtui does not know."""
    if isinstance(raw, dict):
        kind, fields = _text(raw.get("type")), raw
    elif isinstance(raw, (list, tuple)) and raw and isinstance(raw[0], (str, bytes)):
        kind = _text(raw[0])
        names = _ARRAY_FIELDS.get(kind or "", ())
        fields = dict(zip(names, raw[1:], strict=False))
    else:
        raise UndecodablePayload(f"an event is a {type(raw).__name__} with no type")
    if kind == "BlockStored":
        return _stored(fields)
    if kind == "BlockRemoved":
        return _removed(fields)
    if kind == "AllBlocksCleared":
        return AllCleared()
    return None


def decode_payload(payload: bytes, seq: int = 0) -> EventBatch:
    """An EventBatch from its msgpack bytes (raises UndecodablePayload with what was wrong)."""
    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as error:  # noqa: BLE001  msgpack raises several types (ExtraData, FormatError ...)
        raise UndecodablePayload(f"not msgpack: {error}") from None
    if isinstance(batch, dict):  # a map-encoded batch (not sent by the servers known today; cheap to accept)
        batch = [batch.get("ts"), batch.get("events"), batch.get("data_parallel_rank")]
    if not isinstance(batch, (list, tuple)) or len(batch) < 2 or not isinstance(batch[1], (list, tuple)):
        raise UndecodablePayload("not an event batch [ts, [events...], (dp_rank)]")
    ts = batch[0] if isinstance(batch[0], (int, float)) else 0.0
    rank = batch[2] if len(batch) > 2 and isinstance(batch[2], int) else 0
    events: list[Event] = []
    skipped = 0
    for raw in batch[1]:
        event = decode_event(raw)
        if event is None:
            skipped += 1
        else:
            events.append(event)
    return EventBatch(seq=seq, ts=float(ts), events=tuple(events), dp_rank=rank, skipped=skipped)


def decode_message(frames: Sequence[bytes]) -> EventBatch:
    """A published message `(topic, seq, payload)`, or a replayed one `([topic,] seq, payload)`."""
    if len(frames) < 2:
        raise UndecodablePayload(f"a message of {len(frames)} frame(s); expected topic, sequence, payload")
    seq_bytes, payload = frames[-2], frames[-1]
    if len(seq_bytes) != 8:
        raise UndecodablePayload(f"a sequence number of {len(seq_bytes)} bytes; expected 8")
    return decode_payload(payload, int.from_bytes(seq_bytes, "big", signed=True))


def encode_batch(batch: EventBatch, *, arrays: bool = False) -> bytes:
    """The msgpack payload a server would publish for `batch` (maps as vLLM 0.32, or arrays as SGLang):
    for the benchmark's publisher and tests; a round trip through decode_payload gives `batch` back."""
    events = [_encode_event(event, arrays) for event in batch.events]
    return msgpack.packb([batch.ts, events, batch.dp_rank])


def _hash_value(key: str) -> int | bytes:
    return int(key, 16) if len(key) == 16 else bytes.fromhex(key)


def _encode_event(event: Event, arrays: bool) -> Any:
    if isinstance(event, BlocksStored):
        fields: dict[str, Any] = {
            "block_hashes": [_hash_value(h) for h in event.hashes],
            "parent_block_hash": None if event.parent is None else _hash_value(event.parent),
            "token_ids": list(event.token_ids),
            "block_size": event.block_size,
            "lora_id": None,
            "medium": event.medium,
            "lora_name": event.lora,
        }
        if arrays:
            return ["BlockStored", *(fields[name] for name in _ARRAY_FIELDS["BlockStored"])]
        session = {"session_id": event.session} if event.session is not None else {}
        return {"type": "BlockStored", **fields, "group_idx": event.group, "kv_cache_spec_kind": event.kind, **session}
    if isinstance(event, BlocksRemoved):
        hashes = [_hash_value(h) for h in event.hashes]
        if arrays:
            return ["BlockRemoved", hashes, event.medium]
        return {"type": "BlockRemoved", "block_hashes": hashes, "medium": event.medium, "group_idx": event.group}
    return ["AllBlocksCleared"] if arrays else {"type": "AllBlocksCleared"}
