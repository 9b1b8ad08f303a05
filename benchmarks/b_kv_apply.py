"""The attach reader's own CPU per event, with no sockets: b_kv_events.py's two-origin traffic (new tokens and hashes
each pass) decoded and folded into one PrefixCache in a plain loop, as the subscriber does (the garbage collector
frozen every 200 batches, as it is after each drain). Reported: CPU µs per event for decoding and for applying, the
median of `--reps` runs, beside the 1-minute load average; and the notes raised (the same in every run and every
version of the code: a check that what is computed did not change).

    python benchmarks/b_kv_apply.py [--passes 300] [--max-blocks 10000] [--reps 5]

`--max-blocks` below the blocks stored (73 a pass per origin) puts the cache where a busy server's viewer is: at its
cap, letting the oldest blocks go as new ones come (b_kv_events.py runs at 100,000, reached after about 700 passes).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from b_kv_events import ORIGINS, new_traffic, recorded_batches  # noqa: E402


def traffic(passes: int) -> tuple[list[tuple[str, list[bytes]]], int]:
    """The messages of `passes` passes per origin, in the order the two publishers send them; the events in all."""
    batches = recorded_batches()
    out: list[tuple[str, list[bytes]]] = []
    seqs = [0] * ORIGINS
    for cycle in range(passes):
        for index in range(ORIGINS):
            for payload in new_traffic(batches, cycle * ORIGINS + index + 1):
                out.append((f"bench{index}", [b"kv-events", seqs[index].to_bytes(8, "big"), payload]))
                seqs[index] += 1
    return out, sum(len(b[1]) for b in batches) * passes * ORIGINS


def run(messages, max_blocks: int) -> tuple[float, float, dict]:
    """Decode and apply every message once into a fresh cache: CPU seconds decoding, applying; the note counts."""
    from kvtui.engine.server.kv_events import decode_message
    from kvtui.engine.server.prefix_cache import PrefixCache

    cache = PrefixCache(max_blocks=max_blocks)
    gc.collect()
    gc.freeze()
    decoding = applying = 0.0
    clock = time.process_time
    for n, (origin, frames) in enumerate(messages):
        t0 = clock()
        batch = decode_message(frames)
        t1 = clock()
        cache.apply(batch, origin)
        applying += clock() - t1
        decoding += t1 - t0
        if n % 200 == 199:
            gc.freeze()
    gc.unfreeze()
    return decoding, applying, dict(cache.note_counts)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--passes", type=int, default=300)
    parser.add_argument("--max-blocks", type=int, default=10_000)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    messages, events = traffic(args.passes)
    rows = []
    for _ in range(args.reps):
        decoding, applying, notes = run(messages, args.max_blocks)
        rows.append((decoding / events * 1e6, applying / events * 1e6))
        print(f"decode {rows[-1][0]:.1f}  apply {rows[-1][1]:.1f}  total {sum(rows[-1]):.1f} µs/event", flush=True)
    decode, apply = statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows)
    print(
        f"median: decode {decode:.1f}, apply {apply:.1f},"
        f" total {statistics.median(sum(r) for r in rows):.1f} µs/event over {events} events; load "
        f"{os.getloadavg()[0]:.2f}; notes {notes}"
    )


if __name__ == "__main__":
    main()
