"""5c. `kvtui attach` under load: KV events recorded from a real vLLM server (tests/data/kv_events), replayed by a
publisher of kvtui's own (vLLM's protocol, its own process) at a target rate for a while, into the attach screen.

Every cycle through the recording renames its blocks (fresh hashes, the same chains and token ids), so the viewer
stores, removes and checks new blocks all the time, as it would on a busy server. Reported: events published,
applied, counted lost (sequence gaps) and skipped; the rate the viewer sustained; how long keys took to answer
(pressed every 50 ms in the running app, measured to the next screen update); the blocks kept against the cap and
the process's peak memory.

    python benchmarks/b_kv_events.py [--rate 20000] [--seconds 30]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import resource
import statistics
import sys
import time
from collections import deque
from pathlib import Path
from types import SimpleNamespace

import msgpack

ROOT = Path(__file__).resolve().parents[1]
RECORDED = ROOT / "tests" / "data" / "kv_events" / "vllm-0.32-maps.msgpack"
# the publisher is a test fixture (tests/engine/server/local_publisher.py), not part of the package
sys.path.insert(0, str(ROOT / "tests" / "engine" / "server"))


def recorded_batches() -> list[list]:
    """The recorded batches' [ts, events, rank], BlockStored events only: the cache then grows as a busy server's
    does, and the viewer's --max-blocks cap is what bounds its memory."""
    out = []
    for frame in msgpack.unpackb(RECORDED.read_bytes()):
        ts, events, *rest = msgpack.unpackb(frame[2])
        stored = [e for e in events if e["type"] == "BlockStored"]
        if stored:
            out.append([ts, stored, *rest])
    return out


def renamed(batches: list[list], cycle: int) -> list[bytes]:
    """One pass through the recording with every block hash renamed (the same chains, new blocks)."""
    salt = (cycle + 1) * 0x9E3779B97F4A7C15 & (2**64 - 1)
    payloads = []
    for ts, events, *rest in batches:
        fresh = []
        for event in events:
            event = dict(event)
            event["block_hashes"] = [h ^ salt for h in event["block_hashes"]]
            if event.get("parent_block_hash") is not None:
                event["parent_block_hash"] ^= salt
            fresh.append(event)
        payloads.append(msgpack.packb([ts, fresh, *rest]))
    return payloads


def publish(port_box, rate: float, seconds: float, ready, counts, done) -> None:
    """The publisher process: bind, tell the port, wait for the viewer, publish at `rate` events/s."""
    from local_publisher import LocalPublisher

    batches = recorded_batches()
    per_pass = sum(len(b[1]) for b in batches)
    with LocalPublisher(replay=False) as publisher:  # vLLM's default high-water mark (100,000 messages)
        port_box.value = publisher.port
        ready.wait(30)
        time.sleep(0.5)
        start, cycle, events = time.perf_counter(), 0, 0
        while (elapsed := time.perf_counter() - start) < seconds:
            if events > elapsed * rate:
                time.sleep(0.001)
                continue
            for payload in renamed(batches, cycle):
                publisher.publish(payload)
            cycle += 1
            events += per_pass
        counts.value = publisher.sent
        while not done.wait(1.0):  # heartbeats (as a live server's next batches): their numbers reveal tail drops
            publisher.publish(msgpack.packb([time.time(), [], 0]))
            counts.value = publisher.sent


async def drive_app(app, seconds: float, lags: list[float]) -> None:
    """Run the app under the load and measure how late its event loop runs a callback due every 10 ms: how long a
    key waits before its handler runs (the handlers themselves are a tree cursor move: well under a ms)."""
    async with app.run_test(size=(140, 40)):
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            due = time.perf_counter() + 0.01
            await asyncio.sleep(0.01)
            lags.append(max(0.0, time.perf_counter() - due))


def bench(rate: float = 20_000, seconds: float = 30.0, max_blocks: int = 100_000, ui: bool = True) -> dict:
    from kvtui import viewers
    from kvtui.engine.reading.token_texts import TokenTexts
    from kvtui.engine.server.prefix_cache import PrefixCache
    from kvtui.engine.server.server_http import EventEndpoint
    from kvtui.engine.server.subscriber import YIELD_S, Subscriber

    context = multiprocessing.get_context("spawn")
    port_box, counts, ready, done = context.Value("i", 0), context.Value("q", 0), context.Event(), context.Event()
    publisher = context.Process(target=publish, args=(port_box, rate, seconds, ready, counts, done), daemon=True)
    publisher.start()
    while not port_box.value:
        time.sleep(0.05)
    cache = PrefixCache(TokenTexts(), max_blocks=max_blocks)
    endpoint = EventEndpoint(f"tcp://127.0.0.1:{port_box.value}", None, "kv-events", 0, "bench")
    subscriber = Subscriber([endpoint], cache, yield_s=YIELD_S if ui else 0.0)
    import threading

    reader = threading.Thread(target=subscriber.run, daemon=True)
    reader.start()
    subscriber.connected.wait(5)
    time.sleep(0.5)
    ready.set()
    session = SimpleNamespace(cache=cache, title="bench publisher", problems=deque(), error=None)
    lags: list[float] = []
    started = time.perf_counter()
    if ui:
        asyncio.run(drive_app(viewers.server(session=session), seconds + 1.0, lags))
    else:
        time.sleep(seconds + 1.0)
    during = cache.stats("bench").events  # applied while the publisher ran
    stats = cache.stats("bench")
    deadline = time.monotonic() + 90
    while stats.batches + stats.lost < counts.value and time.monotonic() < deadline:  # every batch applied or lost
        time.sleep(0.1)
    drained = time.perf_counter() - started
    sent = counts.value
    done.set()
    publisher.join(30)
    subscriber.stop.set()
    reader.join(10)
    elapsed = time.perf_counter() - started
    return {
        "target_events_s": rate,
        "seconds": seconds,
        "payloads_sent": sent,
        "batches_applied": stats.batches,
        "batches_lost": stats.lost,
        "events_applied": stats.events,
        "accounted": stats.batches + stats.lost == sent,
        "events_s_applied_while_publishing": during / (seconds + 1.0),
        "events_s_applied": stats.events / drained,  # over the whole run, until the last was applied or dropped
        "ui": ui,
        "elapsed_s": elapsed,
        "loop_lag_ms_median": 1000 * statistics.median(lags) if lags else None,
        "loop_lag_ms_p99": 1000 * sorted(lags)[int(0.99 * (len(lags) - 1))] if lags else None,
        "loop_lag_ms_max": 1000 * max(lags) if lags else None,
        "blocks_kept": cache.held,
        "blocks_let_go": cache.let_go,
        "max_blocks": max_blocks,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--rate", type=float, default=20_000)
    parser.add_argument("--seconds", type=float, default=30)
    parser.add_argument("--max-blocks", type=int, default=100_000)
    parser.add_argument("--no-ui", action="store_true", help="the reader alone (what `kvtui attach --headless` does)")
    args = parser.parse_args()
    result = bench(args.rate, args.seconds, args.max_blocks, ui=not args.no_ui)
    for key, value in result.items():
        print(f"{key:20} {value:.1f}" if isinstance(value, float) else f"{key:20} {value}")
