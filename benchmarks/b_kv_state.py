"""The whole state of a PrefixCache after b_kv_events' two-origin traffic, printed as text, to compare two versions of
the reader's code byte for byte (what it computes must not change when it gets cheaper):

    PYTHONHASHSEED=0 PYTHONPATH=<one checkout> python benchmarks/b_kv_state.py --passes 150 > a.txt
    PYTHONHASHSEED=0 PYTHONPATH=<the other>   python benchmarks/b_kv_state.py --passes 150 > b.txt
    cmp a.txt b.txt

Printed: every note with its words, the counts by code, each origin's counts, every block's fields in the index's
order (its parent and children by key), the tops, the content and sibling indexes, what was removed, the requests,
the fleet series and the rules' memory. Also the two recorded streams of tests/data/kv_events (`--recorded`).
PYTHONHASHSEED fixed: kvtui's content hash of a chain's tokens is Python's hash.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import msgpack

sys.path.insert(0, str(Path(__file__).resolve().parent))
from b_kv_apply import traffic  # noqa: E402

SLOTS = (
    "key origin tokens group medium chain depth stored_batch stored_ts orphan sibling_key content hits lora extra "
    "noted media".split()
)


def show(value) -> str:
    """A value as text, a Block by its key (the graph printed once, in the index)."""
    if type(value).__name__ == "Block":
        return f"<{value.origin}/{value.group}/{value.key}>"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{show(k)}: {show(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)) or type(value).__name__ == "deque":
        return "[" + ", ".join(show(v) for v in value) + "]"
    if isinstance(value, set):
        return "{" + ", ".join(sorted(show(v) for v in value)) + "}"
    if type(value).__name__ == "array":
        return repr(value.tolist())
    if hasattr(value, "__dataclass_fields__"):
        return (
            f"{type(value).__name__}("
            + ", ".join(f"{n}={show(getattr(value, n))}" for n in value.__dataclass_fields__)
            + ")"
        )
    return repr(value)


def dump(cache) -> list[str]:
    out = [f"batches {cache.batches} chains {cache.chains} let_go {cache.let_go} held {cache.held}"]
    out += [f"note {show(note)}" for note in cache.notes]
    out.append(f"counts {show(cache.note_counts)}")
    out += [f"origin {name} {show(stats)}" for name, stats in cache.origins.items()]
    for ident, block in cache.blocks.items():
        fields = ", ".join(f"{name}={show(getattr(block, name))}" for name in SLOTS)
        out.append(f"block {show(ident)} parent={show(block.parent)} children={show(block.children)} {fields}")
    # the indexes as their readers see them (a version may keep one block in place of a list or map of one)
    out.append(f"by_content {show({key: cache.holders(*key) for key in cache.by_content})}")
    one = {key: [v] if type(v).__name__ == "Block" else v for key, v in cache._by_first.items()}
    out.append(f"_by_first {show(one)}")
    for name in ("tops", "_removed_at", "_elsewhere", "_first_tier", "_gone_roots", "_twice"):
        out.append(f"{name} {show(getattr(cache, name))}")
    out.append(f"requests {show(vars(cache.requests))}")
    out.append(f"fleet {show(vars(cache.fleet))}")
    rules = cache.rules
    out.append(f"rules {show({k: v for k, v in vars(rules).items() if k != 'cache'})}")
    return out


def main() -> None:
    from kvtui.engine.server.kv_events import decode_message
    from kvtui.engine.server.prefix_cache import PrefixCache

    parser = argparse.ArgumentParser()
    parser.add_argument("--passes", type=int, default=150)
    parser.add_argument("--max-blocks", type=int, default=100_000)
    parser.add_argument("--recorded", action="store_true", help="the recorded streams of tests/data/kv_events")
    args = parser.parse_args()
    if args.recorded:
        data = Path(__file__).resolve().parents[1] / "tests" / "data" / "kv_events"
        for name in ("vllm-0.32-maps.msgpack", "sglang-arrays.msgpack"):
            cache = PrefixCache(max_blocks=args.max_blocks)
            for frames in msgpack.unpackb((data / name).read_bytes()):
                cache.apply(decode_message(frames), name)
            print("\n".join(dump(cache)))
        return
    messages, _ = traffic(args.passes)
    cache = PrefixCache(max_blocks=args.max_blocks)
    for origin, frames in messages:
        cache.apply(decode_message(frames), origin)
    print("\n".join(dump(cache)))


if __name__ == "__main__":
    main()
