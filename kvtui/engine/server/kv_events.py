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

Decoding is typed first: msgspec reads a payload of either encoding straight into structs shaped as vLLM's own
(`vllm/distributed/kv_events.py`), checking each field's type in C (the whole decode 8 µs a message of
b_kv_events' traffic, 10.5 with msgpack's generic objects read field by field). What that fast path does not take
exactly (another type in a field, an event type kvtui does not know, a map-encoded batch, an extension type, a
malformed payload) is decoded by the generic reader as before (`_decode_generic`), so every payload decodes, or is
refused with the same words, exactly as it did.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Sequence
from dataclasses import field
from typing import Any

import msgpack
import msgspec

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
    for decoder in _TYPED:
        try:
            typed = decoder.decode(payload)
        except (msgspec.MsgspecError, _NotTyped):  # another shape or type somewhere: the next reader
            continue
        try:
            return _from_typed(typed, seq)
        except (_NotTyped, OverflowError):
            break
    return _decode_generic(payload, seq)


def _decode_generic(payload: bytes, seq: int = 0) -> EventBatch:
    """decode_payload for any payload: msgpack's generic objects, read field by field (the reference the typed
    path must equal)."""
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


# ---- the typed fast path: vLLM's own struct shapes (maps, tagged by "type"), and the array encoding -------------


class _NotTyped(Exception):
    """Something the typed path does not read exactly as _decode_generic does: that reader decodes the payload."""


_Hash = int | bytes  # vLLM's ExternalBlockHash


class _StoredMap(msgspec.Struct, tag="BlockStored", gc=False):
    block_hashes: list[_Hash]
    token_ids: list[int]
    block_size: int
    parent_block_hash: _Hash | None = None
    lora_id: int | str | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: Any = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    session_id: str | None = None


class _RemovedMap(msgspec.Struct, tag="BlockRemoved", gc=False):
    block_hashes: list[_Hash]
    medium: str | None = None
    group_idx: int | None = None


class _ClearedMap(msgspec.Struct, tag="AllBlocksCleared", gc=False):
    pass


class _BatchMaps(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_StoredMap | _RemovedMap | _ClearedMap]
    data_parallel_rank: int | None = None


class _StoredArray(msgspec.Struct, tag="BlockStored", array_like=True, gc=False):  # _ARRAY_FIELDS' order
    block_hashes: list[_Hash]
    parent_block_hash: _Hash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | str | None = None
    medium: str | None = None
    lora_name: str | None = None


class _RemovedArray(msgspec.Struct, tag="BlockRemoved", array_like=True, gc=False):
    block_hashes: list[_Hash]
    medium: str | None = None


class _ClearedArray(msgspec.Struct, tag="AllBlocksCleared", array_like=True, gc=False):
    pass


class _BatchArrays(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_StoredArray | _RemovedArray | _ClearedArray]
    data_parallel_rank: int | None = None


def _no_ext(code: int, data: memoryview) -> Any:
    raise _NotTyped  # msgpack and msgspec give extension types as different objects: the generic reader's


_TYPED = (
    msgspec.msgpack.Decoder(_BatchMaps, ext_hook=_no_ext),
    msgspec.msgpack.Decoder(_BatchArrays, ext_hook=_no_ext),
)
_PACKERS: dict[int, Any] = {}  # ids per event -> the Struct's pack for that many 64-bit ints
_PLAIN = (str, int, float, bytes, bool, type(None))  # extra keys' values both readers give as the same objects


def _plain_extra(values: Any) -> bool:
    """Whether extra keys decoded as msgspec's Any equal msgpack's generic objects (lists of plain values, a level
    of lists within: a LoRA name, (mm id, offset) pairs, a salt, digests); maps and the rest go the generic way."""
    for entry in values:
        if entry is None:
            continue
        if type(entry) is not list:
            return False
        for item in entry:
            if type(item) is list:
                if not all(type(x) in _PLAIN for x in item):
                    return False
            elif type(item) not in _PLAIN:
                return False
    return True


_HEX16 = "%016x".__mod__  # block_key of an int hash in [0, 2**64) (all msgspec gives is below 2**64)


def _typed_keys(values: list) -> tuple[str, ...]:
    """block_key of each hash; ints that are all >= 0 (vLLM's uint64: the usual list) in one C map."""
    try:
        if min(values, default=0) >= 0:  # (bytes among them: TypeError)
            return tuple(map(_HEX16, values))
    except TypeError:
        pass
    return tuple(map(block_key, values))


def _from_typed(batch: _BatchMaps | _BatchArrays, seq: int) -> EventBatch:
    """The EventBatch _decode_generic gives for the same payload; _NotTyped where a value would read otherwise
    there (an error it words, a field kept as another type)."""
    events: list[Event] = []
    for raw in batch.events:
        if isinstance(raw, (_StoredMap, _StoredArray)):
            size, values = raw.block_size, raw.token_ids
            hashes = _typed_keys(raw.block_hashes)
            if size < 0 or (size == 0 and values) or len(values) < len(hashes) * size:
                raise _NotTyped  # refused, in _decode_generic's words
            pack = _PACKERS.get(len(values))
            if pack is None:
                if len(_PACKERS) >= 1024:  # (a few lengths in practice: blocks of one size)
                    _PACKERS.clear()
                pack = _PACKERS[len(values)] = struct.Struct(f"{len(values)}q").pack
            try:  # the ids packed in C, then taken as the array's bytes: twice as quick as array(list)
                ids = array(_LONGS, pack(*values))
            except struct.error:  # an id past 64 bits: the generic reader's refusal
                raise _NotTyped from None
            parent = raw.parent_block_hash
            lora = raw.lora_name if raw.lora_name is not None else raw.lora_id
            if isinstance(raw, _StoredMap):
                extra_keys, group = raw.extra_keys, raw.group_idx
                if extra_keys is None or (type(extra_keys) is list and not any(extra_keys)):
                    extra: tuple[str, ...] = ()  # (vLLM sends None per block where no key is hashed in)
                elif type(extra_keys) is list and _plain_extra(extra_keys):
                    extra = _extra_keys(extra_keys, len(hashes))
                else:
                    raise _NotTyped
                kind_name, session = raw.kv_cache_spec_kind, raw.session_id
            else:
                extra, group, kind_name, session = (), None, None, None
            events.append(
                BlocksStored(
                    hashes,
                    None if parent is None else block_key(parent),
                    tuple(values),
                    size,
                    0 if group is None else group,
                    raw.medium,
                    None if lora is None else str(lora),
                    kind_name,
                    extra,
                    session,
                    STORED,
                    ids if ids.typecode == "l" else None,
                )
            )
        elif isinstance(raw, _RemovedMap):
            events.append(BlocksRemoved(_typed_keys(raw.block_hashes), raw.group_idx, raw.medium))
        elif isinstance(raw, _RemovedArray):
            events.append(BlocksRemoved(_typed_keys(raw.block_hashes), None, raw.medium))
        else:
            events.append(AllCleared())
    rank = batch.data_parallel_rank
    return EventBatch(seq, batch.ts, tuple(events), 0 if rank is None else rank)


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
