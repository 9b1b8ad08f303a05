"""5c. `kvtui attach` under load: KV events recorded from a real vLLM server (tests/data/kv_events), replayed by
two publishers of kvtui's own (vLLM's protocol, each in its own process: two servers of a fleet) at a target rate
in all for a while, into the attach screen.

The workload is a busy fleet's: every pass through the recording is new traffic, new tokens under new hashes (each
pass shifts the token ids past those of every other pass and origin, and renames the blocks), so the viewer
stores, and lets go past its cap, new blocks all the time. The notes it raises are then the recording's own (one
pass raises a few `recomputed-prefix` and `varying-start`: its prompts differ a few tokens in), once per pass, and
no miss cause that a real fleet would not have (`hash-mismatch`, `held-elsewhere`, `evicted-prefix`): the notes
are counted by code, checked against one pass applied alone times the passes applied, and printed.

Three ways to read (`--reader`): `process` (what `kvtui attach` does with its TUI: the reader in a child process,
the screen asking it for frames over a pipe), `thread` (the reader on a thread beside the screen, in one
interpreter: what it did before), `alone` (no screen, what `--headless` does). Reported: events published,
applied, counted lost (sequence gaps) per origin; the rate the viewer sustained; the screen's refreshes (views
built) per second; how late its event loop ran a callback due every 10 ms (how long a key waits); the blocks kept
against the cap and the peak memory (of the process that holds the cache).

    python benchmarks/b_kv_events.py [--rate 20000] [--seconds 30] [--reader process|thread|alone]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import resource
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import msgpack

ROOT = Path(__file__).resolve().parents[1]
RECORDED = ROOT / "tests" / "data" / "kv_events" / "vllm-0.32-maps.msgpack"
# the publisher is a test fixture (tests/engine/server/local_publisher.py), not part of the package
sys.path.insert(0, str(ROOT / "tests" / "engine" / "server"))

ORIGINS = 2
TOKEN_SHIFT = 1 << 16  # above every token id of the recording (< 41,000): pass k's tokens are id + k * TOKEN_SHIFT
FALSE_CAUSES = ("hash-mismatch", "held-elsewhere", "evicted-prefix")  # none of these is in this traffic


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


def new_traffic(batches: list[list], k: int) -> list[bytes]:
    """Pass `k` (>= 1) through the recording as new traffic: its tokens shifted to ids no other pass has, its blocks
    renamed (new tokens, new hashes; the same chains and the same edits between its prompts)."""
    salt = k * 0x9E3779B97F4A7C15 & (2**64 - 1)
    shift = k * TOKEN_SHIFT
    payloads = []
    for ts, events, *rest in batches:
        fresh = []
        for event in events:
            event = dict(event)
            event["block_hashes"] = [h ^ salt for h in event["block_hashes"]]
            if event.get("parent_block_hash") is not None:
                event["parent_block_hash"] ^= salt
            event["token_ids"] = [t + shift for t in event["token_ids"]]
            fresh.append(event)
        payloads.append(msgpack.packb([ts, fresh, *rest]))
    return payloads


def notes_per_pass() -> Counter:
    """The notes one pass raises, applied alone to a fresh cache (the independent count the run is checked by)."""
    from kvtui.engine.server.kv_events import decode_message
    from kvtui.engine.server.prefix_cache import PrefixCache

    cache = PrefixCache()
    for seq, payload in enumerate(new_traffic(recorded_batches(), 1)):
        cache.apply(decode_message([b"kv-events", seq.to_bytes(8, "big"), payload]), "one")
    return Counter(cache.note_counts)


def _cpu_s(pid: int | None = None) -> float:
    """CPU seconds (user + system) a live process has used (or this one)."""
    if pid is None:
        return time.process_time()
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def publish(index: int, port_box, rate: float, seconds: float, ready, counts, passes, done, cpu=None) -> None:
    """One publisher process (origin `index` of ORIGINS): bind, tell the port, wait for the viewer, publish its
    share of the traffic at `rate` events/s, then a heartbeat a second until `done`."""
    from local_publisher import LocalPublisher

    parent = os.getppid()
    batches = recorded_batches()
    per_pass = sum(len(b[1]) for b in batches)
    with LocalPublisher(replay=False) as publisher:  # vLLM's default high-water mark (100,000 messages)
        port_box.value = publisher.port
        ready.wait(120)
        time.sleep(0.5)
        start, cycle, events, cpu0 = time.perf_counter(), 0, 0, time.process_time()
        while (elapsed := time.perf_counter() - start) < seconds:
            if events > elapsed * rate:
                time.sleep(0.001)
                continue
            for payload in new_traffic(batches, cycle * ORIGINS + index + 1):
                publisher.publish(payload)
            cycle += 1
            events += per_pass
        passes.value = cycle
        counts.value = publisher.sent
        if cpu is not None:
            cpu.value = time.process_time() - cpu0  # what publishing cost
        while not done.wait(1.0) and os.getppid() == parent:  # heartbeats (as a live server's next batches):
            # their numbers reveal tail drops; until the bench says done, or is gone (killed: no orphan left)
            publisher.publish(msgpack.packb([time.time(), [], 0]))
            counts.value = publisher.sent


async def drive_app(app, seconds: float, lags: list[float], after) -> dict:
    """Run the app under the load and measure how late its event loop runs a callback due every 10 ms: how long a
    key waits before its handler runs (the handlers themselves are a tree cursor move: well under a ms). Then,
    the app still running, `after()` (on a thread: it waits for the reader to apply or count every batch)."""
    async with app.run_test(size=(140, 40)):
        screen = app.screen
        before = screen.refreshes
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            due = time.perf_counter() + 0.01
            await asyncio.sleep(0.01)
            lags.append(max(0.0, time.perf_counter() - due))
        refreshes = screen.refreshes - before
        result = await asyncio.to_thread(after)
        result["refreshes"] = refreshes
        # what the screen shows once all is applied or counted: its own last frame's numbers (events, lost)
        want = result["stats"]
        for _ in range(50):
            shown = screen._stats
            if shown is not None and (shown.events, _lost(shown)) == (want.events, _lost(want)):
                break
            await asyncio.sleep(0.1)
        result["shown"] = None if shown is None else (shown.events, _lost(shown))
        return result


def _lost(stats) -> int:
    return sum(c.lost for _, c in stats.origins)


def _peak_mb(pid: int | None) -> float:
    """The peak resident memory of a live process (VmHWM), or of this one."""
    if pid is not None:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def bench(
    rate: float = 20_000, seconds: float = 30.0, max_blocks: int = 100_000, ui: bool = True, reader: str = "process"
) -> dict:
    from kvtui import viewers
    from kvtui.engine.server.attach import AttachOptions, AttachSession
    from kvtui.engine.server.reader_process import ReaderProcess
    from kvtui.engine.server.server_http import EventEndpoint, ServerInfo
    from kvtui.engine.server.subscriber import YIELD_S
    from kvtui.engine.server.view import stats_view

    reader = reader if ui else "alone"
    context = multiprocessing.get_context("spawn")
    ready, done = context.Event(), context.Event()
    boxes = [(context.Value("i", 0), context.Value("q", 0), context.Value("q", 0)) for _ in range(ORIGINS)]
    cpus = [context.Value("d", 0.0) for _ in range(ORIGINS)]
    publishers = [
        context.Process(
            target=publish, args=(i, port, rate / ORIGINS, seconds, ready, sent, passes, done, cpu), daemon=True
        )
        for i, ((port, sent, passes), cpu) in enumerate(zip(boxes, cpus, strict=True))
    ]
    for publisher in publishers:
        publisher.start()
    while not all(port.value for port, _, _ in boxes):
        time.sleep(0.05)
    origins = [f"bench{i}" for i in range(ORIGINS)]
    servers = [
        ServerInfo(
            "", f"bench publisher {i}", endpoints=[EventEndpoint(f"tcp://127.0.0.1:{port.value}", None, "", 0, o)]
        )
        for i, ((port, _, _), o) in enumerate(zip(boxes, origins, strict=True))
    ]
    options = AttachOptions(max_blocks=max_blocks, metrics=False)
    session: AttachSession | ReaderProcess
    if reader == "process":
        session = ReaderProcess(options, servers)
    else:
        session = AttachSession(options, servers)
        session.subscriber.yield_s = YIELD_S if reader == "thread" else 0.0

    def numbers():
        if isinstance(session, ReaderProcess):
            while (found := session.stats()) is None:
                time.sleep(0.05)
            return found
        with session.cache.lock:
            return stats_view(session.cache)

    session.start()
    time.sleep(0.5)
    child = session._process.pid if isinstance(session, ReaderProcess) else None
    cpu_at = (_cpu_s(child), _cpu_s()) if child is not None else (_cpu_s(), 0.0)
    ready.set()
    lags: list[float] = []
    started = time.perf_counter()

    def accounted(stats) -> bool:
        counts = dict(stats.origins)
        return all(
            o in counts and counts[o].batches + counts[o].lost >= sent.value
            for o, (_, sent, _) in zip(origins, boxes, strict=True)
        )

    def after() -> dict:
        """What was applied while the publishers ran; then wait until every batch is applied or counted lost."""
        during = numbers().events
        # CPU seconds while publishing: the reader's (the child's; in one process, the reader's and the screen's) and
        # the screen's process (where the reader is a child): how much of a core each had
        cpu = (_cpu_s(child) - cpu_at[0], _cpu_s() - cpu_at[1]) if child is not None else (_cpu_s() - cpu_at[0], 0.0)
        deadline = time.monotonic() + 120
        while True:
            # the publishers send a heartbeat a second until done: the counts sent are read on both sides of the
            # numbers, which must fall between them (read once after, a heartbeat in between failed the check)
            sent_before = [sent.value for _, sent, _ in boxes]
            stats = numbers()
            sent_after = [sent.value for _, sent, _ in boxes]
            if accounted(stats) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        drained = time.perf_counter() - started
        peak = _peak_mb(session._process.pid if isinstance(session, ReaderProcess) else None)
        return {
            "during": during,
            "stats": stats,
            "drained": drained,
            "peak": peak,
            "sent": (sent_before, sent_after),
            "cpu": cpu,
        }

    if reader != "alone":
        run = asyncio.run(drive_app(viewers.server(session=session), seconds + 1.0, lags, after))
    else:
        time.sleep(seconds + 1.0)
        run = after()
    stats, during, drained, peak = run["stats"], run["during"], run["drained"], run["peak"]
    sent_payloads, sent_after = run["sent"]
    passes = sum(p.value for _, _, p in boxes)
    done.set()
    for publisher in publishers:
        publisher.join(30)
    session.stop()
    elapsed = time.perf_counter() - started
    counts = dict(stats.origins)
    lost = sum(c.lost for c in counts.values())
    codes = dict(stats.codes)
    expected = {code: n * passes for code, n in notes_per_pass().items()}
    refreshes = run.get("refreshes")
    return {
        "reader": reader,
        "target_events_s": rate,
        "origins": ORIGINS,
        "seconds": seconds,
        "payloads_sent": sum(sent_payloads),
        "batches_applied": sum(c.batches for c in counts.values()),
        "batches_lost": lost,
        "per_origin": "; ".join(
            f"{o}: sent {s}, applied {counts[o].batches}, lost {counts[o].lost}"
            for o, s in zip(origins, sent_payloads, strict=True)
        ),
        "events_applied": stats.events,
        "events_shown": run["shown"][0] if run.get("shown") else None,  # in the screen's last frame
        "lost_shown": run["shown"][1] if run.get("shown") else None,
        "accounted": all(
            low <= counts[o].batches + counts[o].lost <= high
            for o, low, high in zip(origins, sent_payloads, sent_after, strict=True)
        ),
        "events_s_applied_while_publishing": during / (seconds + 1.0),
        "events_s_applied": stats.events / drained,  # over the whole run, until the last was applied or dropped
        "passes": passes,
        "notes": ", ".join(f"{c} {n}" for c, n in sorted(codes.items())) or "none",
        "notes_expected": ", ".join(f"{c} {n}" for c, n in sorted(expected.items())),
        "false_notes": sum(codes.get(c, 0) for c in FALSE_CAUSES),
        "notes_as_expected": codes == expected if lost == 0 else None,  # a lost batch takes its notes with it
        "ui": reader != "alone",
        "elapsed_s": elapsed,
        "refreshes_per_s": refreshes / (seconds + 1.0) if refreshes is not None else None,
        "loop_lag_ms_median": 1000 * statistics.median(lags) if lags else None,
        "loop_lag_ms_p99": 1000 * sorted(lags)[int(0.99 * (len(lags) - 1))] if lags else None,
        "loop_lag_ms_max": 1000 * max(lags) if lags else None,
        "blocks_kept": stats.held,
        "blocks_let_go": stats.let_go,
        "max_blocks": max_blocks,
        "peak_rss_mb": peak,
        # cores used while publishing (CPU seconds / wall seconds): 1.0 is a whole core
        "reader_cores": run["cpu"][0] / (seconds + 1.0),
        "screen_cores": run["cpu"][1] / (seconds + 1.0) if reader == "process" else None,
        "publisher_cores": sum(c.value for c in cpus) / seconds,
        "reader_us_per_event": 1e6 * run["cpu"][0] / max(during, 1),
        "loadavg": Path("/proc/loadavg").read_text().split()[:3],
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--rate", type=float, default=20_000)
    parser.add_argument("--seconds", type=float, default=30)
    parser.add_argument("--max-blocks", type=int, default=100_000)
    parser.add_argument("--reader", choices=("process", "thread", "alone"), default="process")
    args = parser.parse_args()
    result = bench(args.rate, args.seconds, args.max_blocks, reader=args.reader)
    for key, value in result.items():
        print(f"{key:34} {value:.1f}" if isinstance(value, float) else f"{key:34} {value}")
    assert result["false_notes"] == 0, f"notes this traffic does not have: {result['notes']}"
    assert result["accounted"], "a batch neither applied nor counted lost"
    if result["notes_as_expected"] is False:
        raise AssertionError(f"notes {result['notes']}; one pass alone times the passes: {result['notes_expected']}")
