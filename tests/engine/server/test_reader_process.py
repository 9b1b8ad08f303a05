"""`kvtui attach`'s TUI reader in a process of its own (ReaderProcess): it applies what two publishers send, the
screen reads frames of it over a pipe, it writes the same trace as the reader `--headless` runs in-process, it
forwards its problem lines, and it ends with quit, or when the screen's process is gone."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import msgpack
import pytest

from kvtui import viewers
from kvtui.engine.server.attach import AttachOptions, AttachSession
from kvtui.engine.server.reader_process import ReaderProcess
from kvtui.engine.server.server_http import EventEndpoint, ServerInfo
from kvtui.engine.server.server_trace import load_server_trace, read_records
from local_publisher import LocalPublisher

pytestmark = pytest.mark.version_free("a server's events, HTTP and traces, read by kvtui alone: no transformers code")

RECORDED = Path(__file__).resolve().parents[2] / "data" / "kv_events" / "vllm-0.32-maps.msgpack"


def recorded(shift: int) -> list[bytes]:
    """The recorded payloads; `shift` > 0: the same traffic with other tokens under other hashes (another
    server's own prompts, so no note ties one origin to the other)."""
    out = []
    for frame in msgpack.unpackb(RECORDED.read_bytes()):
        ts, events, *rest = msgpack.unpackb(frame[2])
        for event in events:
            if shift:
                if "block_hashes" in event:
                    event["block_hashes"] = [h ^ shift for h in event["block_hashes"]]
                if event.get("parent_block_hash") is not None:
                    event["parent_block_hash"] ^= shift
                if "token_ids" in event:
                    event["token_ids"] = [t + shift for t in event["token_ids"]]
        out.append(msgpack.packb([ts, events, *rest]))
    return out


def servers_of(publishers: list[LocalPublisher]) -> list[ServerInfo]:
    return [
        ServerInfo("", f"publisher {i}", endpoints=[EventEndpoint(p.endpoint, p.replay_endpoint, "", 0, f"local{i}")])
        for i, p in enumerate(publishers)
    ]


def wait_for(condition, timeout=30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


def batches_of(reader: ReaderProcess) -> dict[str, int]:
    stats = reader.stats()
    return {} if stats is None else {origin: counts.batches for origin, counts in stats.origins}


def kept(trace: Path) -> dict[str, list]:
    """A trace's records by origin, in order, without the header's wall-clock start."""
    out: dict[str, list] = {}
    for record in read_records(trace):
        if record["type"] in ("batch", "note", "problem"):
            origin = record.get("origin") or (record.get("where") or {}).get("origin", "")
            out.setdefault(origin, []).append(record)
    return out


def test_the_reader_process_applies_both_origins_and_writes_the_headless_trace(tmp_path):
    with LocalPublisher() as one, LocalPublisher() as two:
        servers = servers_of([one, two])
        reader = ReaderProcess(AttachOptions(trace=tmp_path / "tui.jsonl", metrics=False), servers)
        headless = AttachSession(AttachOptions(trace=tmp_path / "headless.jsonl", metrics=False), servers)
        reader.start()
        headless.start()
        try:
            assert one.wait_subscribed(2) and two.wait_subscribed(2)
            payloads = {"local0": recorded(0), "local1": recorded(1 << 20)}
            want: dict[str, int] = {}
            # one origin after the other: chains and batches are numbered in arrival order, the same for both
            for publisher, origin in ((one, "local0"), (two, "local1")):
                for payload in payloads[origin]:
                    publisher.publish(payload)
                want[origin] = len(payloads[origin])
                assert wait_for(lambda: batches_of(reader) == want), batches_of(reader)
                assert wait_for(lambda: {o: s.batches for o, s in headless.cache.origins.items()} == want)
            frame = reader.read_frame(set(), set(), None, 0, None, 0.02, force=True)
            assert frame is not None and frame.view is not None
            with headless.cache.lock:
                assert frame.stats.held == headless.cache.held > 0
                assert dict(frame.stats.codes) == headless.cache.note_counts and frame.stats.codes
                assert len(frame.notes) == len(headless.cache.notes)
            assert [c.chain for c in frame.view.chains][:5] == sorted(headless.cache.tops, reverse=True)[:5]
        finally:
            reader.stop()
            headless.stop()
    assert not reader.running and reader.error is None
    tui, alone = kept(tmp_path / "tui.jsonl"), kept(tmp_path / "headless.jsonl")
    assert tui == alone and set(tui) == {"local0", "local1"}
    assert sum(r["type"] == "note" for rs in tui.values() for r in rs) > 0
    replayed = load_server_trace(tmp_path / "tui.jsonl")
    assert replayed.cache.held == headless.cache.held and replayed.cache.note_counts == headless.cache.note_counts


def test_problems_come_over_the_pipe():
    with LocalPublisher() as publisher:
        reader = ReaderProcess(AttachOptions(metrics=False), servers_of([publisher]))
        reader.start()
        try:
            assert publisher.wait_subscribed()
            publisher.publish(b"\x00not msgpack")
            publisher.publish(recorded(0)[0])
            assert wait_for(lambda: batches_of(reader).get("local0") == 1)
            assert wait_for(lambda: any("did not decode" in p.message for p in reader.problems))
            assert dict(reader.stats().origins)["local0"].skipped == 1
        finally:
            reader.stop()


async def test_quit_ends_the_reader_process():
    with LocalPublisher() as publisher:
        reader = ReaderProcess(AttachOptions(metrics=False), servers_of([publisher]))
        reader.start()
        child = reader._process
        try:
            app = viewers.server(session=reader)
            async with app.run_test(size=(140, 40)) as pilot:
                assert publisher.wait_subscribed()
                for payload in recorded(0):
                    publisher.publish(payload)
                screen = app.screen
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline and (screen._stats is None or screen._stats.batches < 15):
                    await pilot.pause(0.1)
                assert screen._stats.batches == 15 and screen.tree_pane.root.children  # shown through frames
                await pilot.press("q")
                await pilot.pause(0.2)
        finally:
            reader.stop()
    assert child.exitcode == 0 and not child.is_alive()
    assert child not in multiprocessing.active_children()


def test_the_child_ends_when_the_screens_process_is_gone():
    with LocalPublisher() as publisher:
        reader = ReaderProcess(AttachOptions(metrics=False), servers_of([publisher]))
        reader.start()
        child = reader._process
        reader._conn.close()  # what the child sees when the screen's process dies: its end of the pipe closes
        reader._conn = None
        child.join(15)
        assert child.exitcode == 0
        reader.stop()


def test_a_session_that_cannot_start_says_why(tmp_path):
    options = AttachOptions(trace=tmp_path / "no such dir" / "t.jsonl", metrics=False)
    reader = ReaderProcess(options, [ServerInfo("", "x", endpoints=[EventEndpoint("tcp://127.0.0.1:9", None, "")])])
    with pytest.raises(OSError, match="no such dir"):
        reader.start()
    assert not reader.running


def test_the_reader_process_holds_what_an_in_process_reader_holds_on_the_same_stream():
    """Many passes of new traffic from two origins, past the block cap (blocks let go), read by the TUI's reader
    process, by an AttachSession on a thread, and folded into a PrefixCache in a plain loop here (no sockets): the
    three give the same frame, numbers, tree, notes and request rows alike."""
    from kvtui.engine.server.kv_events import decode_message
    from kvtui.engine.server.prefix_cache import PrefixCache
    from kvtui.engine.server.view import read_frame

    passes = 12
    streams = {
        "local0": [p for k in range(passes) for p in recorded((2 * k + 1) << 20)],
        "local1": [p for k in range(passes) for p in recorded((2 * k + 2) << 20)],
    }
    options = AttachOptions(max_blocks=50, metrics=False)  # below what a pass stores: blocks are let go
    with LocalPublisher(replay=False) as one, LocalPublisher(replay=False) as two:
        servers = servers_of([one, two])
        reader = ReaderProcess(options, servers)
        in_process = AttachSession(options, servers)
        reader.start()
        in_process.start()
        reference = PrefixCache(max_blocks=50)
        try:
            assert one.wait_subscribed(2) and two.wait_subscribed(2)
            want: dict[str, int] = {}
            for publisher, origin in ((one, "local0"), (two, "local1")):  # one origin after the other: same order
                for seq, payload in enumerate(streams[origin]):
                    publisher.publish(payload)
                    reference.apply(decode_message([b"", seq.to_bytes(8, "big"), payload]), origin)
                want[origin] = len(streams[origin])
                assert wait_for(lambda: batches_of(reader) == want), batches_of(reader)
                assert wait_for(lambda: {o: s.batches for o, s in in_process.cache.origins.items()} == want)
            expanded = {max(reference.tops)}
            args = (expanded, set(), None, 0, None)
            frame = reader.read_frame(*args, 0.02, force=True)
            beside = read_frame(in_process.cache, *args, 1.0, force=True)  # (takes the cache's lock)
            alone = read_frame(reference, *args, 1.0, force=True)
        finally:
            reader.stop()
            in_process.stop()
    assert frame is not None and beside is not None and alone is not None
    assert sum(c.lost for _, c in frame.stats.origins) == 0
    assert frame.stats.let_go > 0 and 0 < frame.stats.held <= 50 and frame.stats.codes
    assert frame.view is not None and frame.view.chains[0].expanded and frame.view.chains[0].rows
    assert frame == beside == alone
