"""The typed decoder (msgspec, vLLM's struct shapes) against the generic one it stands in front of: for any payload,
decode_payload gives what _decode_generic gives (the same events, the same token arrays, the same refusal in the
same words), and the payloads real servers send take the typed path."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtui.engine.server import kv_events
from kvtui.engine.server.kv_events import UndecodablePayload, _decode_generic, decode_payload

pytestmark = pytest.mark.version_free("a server's events, HTTP and traces, read by kvtui alone: no transformers code")

DATA = Path(__file__).resolve().parents[2] / "data" / "kv_events"


def outcome(decode, payload: bytes):
    """What a decoder gives: the batch with each event's token array (not part of an event's equality), or the
    refusal's words."""
    try:
        batch = decode(payload, 7)
    except UndecodablePayload as error:
        return ("refused", str(error))
    arrays = [getattr(e, "ids", None) for e in batch.events]
    return (batch, [None if a is None else (a.typecode, a.tolist()) for a in arrays])


def typed_takes(payload: bytes) -> bool:
    """Whether the typed path decodes `payload` itself (not handing it to the generic reader)."""
    for decoder in kv_events._TYPED:
        try:
            typed = decoder.decode(payload)
        except Exception:  # noqa: BLE001
            continue
        try:
            kv_events._from_typed(typed, 0)
        except Exception:  # noqa: BLE001
            return False
        return True
    return False


@pytest.mark.parametrize("name", ["vllm-0.32-maps.msgpack", "sglang-arrays.msgpack"])
def test_recorded_payloads_take_the_typed_path_and_decode_the_same(name):
    frames = msgpack.unpackb((DATA / name).read_bytes())
    assert len(frames) == 15
    for frame in frames:
        assert typed_takes(frame[2])
        assert outcome(decode_payload, frame[2]) == outcome(_decode_generic, frame[2])


def mostly(normal, odd, one_in: int = 40):
    """`normal`, but `odd` one time in `one_in`: most events are well formed (the typed path's), some are not.
    (A flatmap, not a composite: a composite built inside every draw reads its function's source each time, which
    was half the test's time; the examples come from the same distribution.)"""
    return st.integers(1, one_in).flatmap(lambda i: odd if i == 1 else normal)


small = st.one_of(st.none(), st.integers(-3, 70), st.text(max_size=4), st.binary(max_size=3), st.booleans())
hashes = mostly(
    st.one_of(st.integers(0, 2**64 - 1), st.binary(min_size=1, max_size=8)),
    st.one_of(st.integers(-(2**63), -1), st.text(max_size=3), st.booleans(), st.none()),
)
plain = st.one_of(st.none(), st.integers(-5, 2**40), st.text(max_size=4), st.binary(max_size=3), st.floats(0, 1))
extra_entry = mostly(
    st.one_of(st.none(), st.lists(st.one_of(plain, st.lists(plain, max_size=2)), max_size=3)),
    st.one_of(
        st.lists(st.dictionaries(st.text(max_size=2), plain, max_size=1), max_size=1),  # a map: the generic way
        st.lists(st.lists(st.lists(plain, max_size=1), max_size=1), max_size=1),  # two deep: the generic way
        plain,
    ),
)


def maybe_none(values):
    return mostly(st.one_of(st.none(), values), small)


@st.composite
def stored(draw, arrays: bool):
    size = draw(mostly(st.integers(1, 4), small))
    blocks = draw(st.integers(0, 3))
    per = size if type(size) is int and 0 < size <= 4 else 2
    tokens = draw(
        mostly(
            st.lists(st.integers(0, 50_000), min_size=blocks * per, max_size=blocks * per + 2),
            st.one_of(
                st.lists(st.one_of(st.integers(-(2**63), 2**64 - 1), st.booleans(), st.none()), max_size=6), small
            ),
        )
    )
    fields = {
        "block_hashes": draw(mostly(st.lists(hashes, min_size=blocks, max_size=blocks), small)),
        "parent_block_hash": draw(st.one_of(st.none(), hashes)),
        "token_ids": tokens,
        "block_size": size,
        "lora_id": draw(maybe_none(st.integers(0, 3))),
        "medium": draw(mostly(st.sampled_from([None, "GPU", "cpu", "DISK"]), small)),
        "lora_name": draw(maybe_none(st.text(max_size=3))),
    }
    if arrays:
        cut = draw(st.integers(3, 8))  # shorter arrays (SGLang's older schemas) and longer ones
        return ["BlockStored", *list(fields.values())[:cut], *([draw(small)] if cut == 8 else [])]
    fields |= {
        "extra_keys": draw(mostly(st.one_of(st.none(), st.lists(extra_entry, max_size=4)), small)),
        "group_idx": draw(maybe_none(st.integers(0, 3))),
        "kv_cache_spec_kind": draw(maybe_none(st.sampled_from(["full_attention", "mamba"]))),
        "session_id": draw(maybe_none(st.text(max_size=3))),
        "locality": draw(small),  # vLLM's fields kvtui does not read
    }
    leave_out = draw(mostly(st.just(set()), st.sets(st.sampled_from(sorted(fields)), max_size=2)))
    return {"type": "BlockStored", **{k: v for k, v in fields.items() if k not in leave_out}}


@st.composite
def removed(draw, arrays: bool):
    keys = draw(mostly(st.lists(hashes, max_size=3), small))
    medium = draw(mostly(st.sampled_from([None, "GPU", "CPU"]), small))
    if arrays:
        return ["BlockRemoved", keys, medium][: draw(st.integers(2, 3))]
    return {
        "type": "BlockRemoved",
        "block_hashes": keys,
        "medium": medium,
        "group_idx": draw(maybe_none(st.integers(0, 3))),
    }


@cache  # built once per encoding (a strategy is a description)
def event(arrays: bool):
    other = ["AllBlocksCleared"] if arrays else {"type": "AllBlocksCleared"}
    unknown = ["BlockMoved", 1] if arrays else {"type": "BlockMoved"}
    return mostly(
        st.one_of(stored(arrays), stored(arrays), removed(arrays), st.just(other)), st.one_of(st.just(unknown), small)
    )


@st.composite
def payloads(draw) -> bytes:
    arrays = draw(st.booleans())
    events = draw(st.lists(event(arrays), max_size=3))
    if draw(st.integers(0, 9)) == 0:  # an event of the other encoding in it
        events.append(draw(event(not arrays)))
    ts = draw(
        mostly(
            st.one_of(st.floats(0, 2e9), st.integers(0, 2**40)),
            st.one_of(st.none(), st.booleans(), st.text(max_size=2)),
        )
    )
    rank = draw(maybe_none(st.integers(0, 7)))
    batch = draw(
        mostly(
            st.sampled_from([[ts, events, rank], [ts, events]]),
            st.sampled_from([[ts, events, rank, "more"], {"ts": ts, "events": events}, [ts]]),
        )
    )
    data = msgpack.packb(batch)
    return data if draw(st.integers(0, 19)) else data[: draw(st.integers(0, len(data)))]  # sometimes cut short


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(payloads())
def test_the_typed_path_decodes_as_the_generic_reader(payload):
    assert outcome(decode_payload, payload) == outcome(_decode_generic, payload)


def test_ordinary_events_take_the_typed_path():
    """What vLLM 0.32 sends (maps: a LoRA's extra keys, a session too) and SGLang (arrays) is read typed."""
    vllm = {
        "type": "BlockStored",
        "block_hashes": [2**64 - 1, b"\x01\x02"],
        "parent_block_hash": None,
        "token_ids": list(range(8)),
        "block_size": 4,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": "sql",
        "extra_keys": [["sql", ["mm0", 3], b"\x00"], None],
        "group_idx": 1,
        "kv_cache_spec_kind": "full_attention",
        "session_id": "s1",
    }
    gone = {"type": "BlockRemoved", "block_hashes": [5], "medium": "GPU", "group_idx": 1}
    sglang = [["BlockStored", [7, 8], 6, list(range(4)), 2, None], ["BlockRemoved", [7]], ["AllBlocksCleared"]]
    for batch in ([1.5, [vllm, gone, {"type": "AllBlocksCleared"}], 0], [2, sglang]):
        payload = msgpack.packb(batch)
        assert typed_takes(payload)
        assert outcome(decode_payload, payload) == outcome(_decode_generic, payload)
    stored_event = decode_payload(msgpack.packb([1.5, [vllm], 0])).events[0]
    assert stored_event.extra == ("('sql', ['mm0', 3], b'\\x00')", "")
    assert stored_event.hashes == ("ffffffffffffffff", "0102") and stored_event.lora == "sql"


@pytest.mark.parametrize("value", [msgpack.ExtType(5, b"ab"), msgpack.Timestamp(5)])
def test_extension_types_decode_as_the_generic_reader(value):
    """msgspec and msgpack give extension types (and timestamps) as other objects: such payloads go the generic way,
    in an event's extra keys and as the batch's time alike."""
    stored = {"type": "BlockStored", "block_hashes": [1], "token_ids": [1, 2], "block_size": 2}
    for batch in ([1.0, [stored | {"extra_keys": [[value]]}], 0], [value, [stored], 0]):
        payload = msgpack.packb(batch)
        assert not typed_takes(payload)
        assert outcome(decode_payload, payload) == outcome(_decode_generic, payload)
    assert decode_payload(msgpack.packb([1.0, [stored | {"extra_keys": [[value]]}], 0])).events[0].extra == (
        f"({value!r},)",
    )
