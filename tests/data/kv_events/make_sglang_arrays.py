"""Re-encode vLLM 0.32's map-encoded KV event payloads (vllm-0.32-maps.msgpack, recorded from a real server) with
SGLang's wire schema: msgspec `array_like` + `tag` structs as python/sglang/srt/disaggregation/kv_events.py
declares them. Run with a Python that has msgspec (the vLLM environment):
    .venv-vllm/bin/python tests/data/kv_events/make_sglang_arrays.py IN OUT"""

import sys
from typing import Any, Optional, Union

import msgspec


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: Optional[int]  # noqa: UP045  (SGLang's own spelling)
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]  # noqa: UP045


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]  # noqa: UP007


def main(source: str, target: str) -> None:
    decoder = msgspec.msgpack.Decoder()
    encoder = msgspec.msgpack.Encoder()
    out = []
    for topic, seq, payload in decoder.decode(open(source, "rb").read()):
        ts, events, *_ = decoder.decode(payload)
        converted: list[Any] = []
        for e in events:
            if e["type"] == "BlockStored":
                fields = (e["block_hashes"], e["parent_block_hash"], e["token_ids"], e["block_size"], e["lora_id"])
                converted.append(BlockStored(*fields))
            elif e["type"] == "BlockRemoved":
                converted.append(BlockRemoved(e["block_hashes"]))
            else:
                converted.append(AllBlocksCleared())
        out.append([topic, seq, encoder.encode(KVEventBatch(ts, converted))])
    open(target, "wb").write(encoder.encode(out))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
