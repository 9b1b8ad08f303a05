"""The attach screen (kvtui attach, kvtui replay of a server trace): the prefix tree, the selected block's
detail, the server's numbers, the notes; a view bounded whatever the cache holds; refreshes that never wait on
the reader. Driven by hand-built KV events and by a server trace recorded from a real vLLM server (SmolLM2)."""

from __future__ import annotations

import threading
import time
from collections import deque
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner
from rich.console import Console

from kvtui import viewers
from kvtui.app import KvtuiApp
from kvtui.cli import main
from kvtui.engine.reading.token_texts import TokenTexts
from kvtui.engine.server.kv_events import BlocksRemoved, BlocksStored, EventBatch
from kvtui.engine.server.prefix_cache import PrefixCache
from kvtui.engine.server.server_http import CacheMetrics
from kvtui.engine.server.server_trace import ServerRun, load_server_trace
from kvtui.engine.server.view import MAX_CHAINS, NodeRef, build_view
from kvtui.screens.server import BEHIND_AFTER
from kvtui.widgets.server.block_detail import BlockDetail
from kvtui.widgets.server.cache_notes import CacheNotes
from kvtui.widgets.server.prefix_tree_pane import PrefixTreePane
from kvtui.widgets.server.server_stats import ServerStats
from kvtui.widgets.server.server_tokens import tokens_text
from pilot_helpers import wait_for
from test_layout import screen_text

SAMPLE = Path(__file__).resolve().parent.parent / "data" / "server_trace_sample.jsonl"
ORIGIN = "srv:8000"
WORDS = ["<|im_start|>", "system", "\n", "You", " are", " a", " baker", ".", "Time", ":", " 12", " helper"]
A1, A2, A3, A4, B1, B2, B3, B4 = (f"{n:02x}" * 8 for n in (0xA1, 0xA2, 0xA3, 0xA4, 0xB1, 0xB2, 0xB3, 0xB4))


def plain(renderable) -> str:
    console = Console(width=200, record=True, color_system=None, file=open("/dev/null", "w"))
    console.print(renderable)
    return console.export_text()


def shown(static) -> str:
    """What a Static shows, as plain text."""
    return plain(static.content)


def stored(hashes, tokens, parent=None) -> BlocksStored:
    return BlocksStored(hashes=tuple(hashes), parent=parent, token_ids=tuple(tokens), block_size=4, medium="GPU")


def batch(seq: int, *events) -> EventBatch:
    return EventBatch(seq=seq, ts=1000.0 + seq, events=tuple(events))


def synthetic_cache() -> PrefixCache:
    """Chain #1: A1 A2, then A2 branches (A3, A4: another ending, no miss); chain #2: B1..B4, which leaves
    chain #1 at token 3 ('Time' instead of 'You': 'Time: 12' put before the cached text)."""
    texts = TokenTexts()
    texts.learn(dict(enumerate(WORDS)), special=[0])
    cache = PrefixCache(texts)
    cache.apply(batch(0, stored([A1, A2], [0, 1, 2, 3, 4, 5, 6, 7])), ORIGIN)
    cache.apply(batch(1, stored([A3], [3, 4, 5, 11], parent=A2)), ORIGIN)
    cache.apply(batch(2, stored([A4], [3, 4, 5, 6], parent=A2)), ORIGIN)
    cache.apply(batch(3, stored([B1, B2, B3, B4], [0, 1, 2, 8, 9, 10, 3, 4, 5, 6, 7, 3, 4, 5, 6, 7])), ORIGIN)
    cache.record_metrics(ORIGIN, 1.0, CacheMetrics(queries=100, hits=10, capacity=100, block_size=4, usage=0.05))
    cache.record_metrics(ORIGIN, 2.0, CacheMetrics(queries=200, hits=60, capacity=100, block_size=4, usage=0.05))
    return cache


def replay_app(cache: PrefixCache) -> KvtuiApp:
    header = {"servers": [{"url": "http://srv:8000", "model": "tiny-model"}]}
    return viewers.server(run=ServerRun(Path("synthetic.jsonl"), header, cache))


def live_app(cache: PrefixCache) -> KvtuiApp:
    session = SimpleNamespace(
        cache=cache, title="tiny-model at http://srv:8000", problems=deque(), error=None, stop=lambda: None
    )
    return viewers.server(session=session)


def labels(tree: PrefixTreePane) -> list[str]:
    out = []
    stack = list(reversed(tree.root.children))
    while stack:
        node = stack.pop()
        out.append(node.label.plain)
        stack.extend(reversed(node.children))
    return out


async def select(pilot, app: KvtuiApp, ref: NodeRef) -> None:
    tree = app.query_one(PrefixTreePane)
    assert tree.select_ref(ref), ref
    await pilot.pause(0.05)
    assert app.view.selected == ref


def test_the_app_takes_a_session_or_a_run():
    with pytest.raises(ValueError):
        viewers.server()
    with pytest.raises(ValueError):
        viewers.server(session=SimpleNamespace(cache=PrefixCache()), run=ServerRun(Path("x"), {}, PrefixCache()))


def test_special_tokens_are_drawn_apart_and_long_text_is_cut():
    texts = TokenTexts()
    texts.learn(dict(enumerate(WORDS)), special=[0])
    text = tokens_text(texts, [0, 1, 2, 3], None)
    assert text.plain == "<|im_start|>system↵You"
    styles = {text.plain[span.start : span.end]: str(span.style) for span in text.spans}
    assert "reverse" in styles["<|im_start|>"] and "system" not in styles
    cut = tokens_text(texts, [3, 4, 5, 6, 7], None, chars=8)
    assert cut.plain == "You are …"


async def test_the_tree_shows_the_chains_with_their_text_and_a_block_its_detail():
    app = replay_app(synthetic_cache())
    async with app.run_test(size=(120, 36)) as pilot:
        await pilot.pause(0.1)
        tree = app.query_one(PrefixTreePane)
        chains = [node.label.plain for node in tree.root.children]
        held = "(4 blocks, GPU (as the server says), srv:8000)"  # the medium is the server's word, not kvtui's
        assert chains[0].startswith("#2  <|im_start|>system↵Time") and held in chains[0]
        assert chains[1].startswith("#1  <|im_start|>system↵You") and held in chains[1]
        assert "tiny-model at http://srv:8000" in screen_text(app)
        # chain #1 collapsed: no block nodes until it is expanded (enter)
        assert not tree.root.children[1].children
        await select(pilot, app, NodeRef(1))
        await pilot.press("enter")
        await pilot.pause(0.1)
        chain = tree.root.children[1]
        run = [node.data.ident[2] for node in chain.children]
        assert run == [A1, A2]  # a run of single children lists flat
        branches = [node.data.ident[2] for node in chain.children[1].children]
        assert branches == [A3, A4]  # A2's two children nest under it
        assert "  1 @4     a2a2a2a2  " in chain.children[1].label.plain and " are a baker." in labels(tree)[3]
        await pilot.press("down", "down")  # A1, then A2
        await pilot.pause(0.1)
        assert app.view.selected == NodeRef(1, (ORIGIN, 0, A2))
        detail = shown(app.query_one(BlockDetail).query_one("#block-detail-body"))
        assert A2 in detail and f"parent {A1}" in detail
        assert "tokens 4..8 (4) · #1 · depth 1" in detail and "2 children" in detail
        assert " are a baker." in detail and "stored at batch 1" in detail
        assert "recomputed-prefix" in detail  # the note that left chain #1 points at its chain


async def test_notes_show_and_select_their_block():
    cache = synthetic_cache()
    app = replay_app(cache)
    async with app.run_test(size=(120, 36)) as pilot:
        await pilot.pause(0.1)
        notes = app.query_one(CacheNotes)
        assert [n.code for n in notes.notes] == ["recomputed-prefix"]  # A4 after A3: another ending, no waste
        assert "'Time' (id 8) instead of 'You' (id 3)" in screen_text(app)
        tree = app.query_one(PrefixTreePane)
        await pilot.press("n")  # the note: B1 left chain #1 at token 3
        await pilot.pause(0.1)
        assert tree.cursor_ref == NodeRef(2, (ORIGIN, 0, B1)) and app.view.selected == tree.cursor_ref
        assert 2 in tree.expanded_chains
        detail = shown(app.query_one(BlockDetail).query_one("#block-detail-body"))
        assert B1 in detail and "'Time' (id 8) instead of 'You' (id 3)" in detail
        # enter on a note in the list selects its block too
        await select(pilot, app, NodeRef(1))
        notes.focus()
        notes.highlighted = 0
        await pilot.press("enter")
        await pilot.pause(0.1)
        assert tree.cursor_ref == NodeRef(2, (ORIGIN, 0, B1)) and tree.has_focus


async def test_removed_blocks_leave_the_tree_at_the_next_refresh_and_stats_count_them():
    cache = synthetic_cache()
    app = live_app(cache)
    async with app.run_test(size=(120, 36)) as pilot:
        await pilot.pause(0.1)
        tree = app.query_one(PrefixTreePane)
        tree.expanded_chains.add(1)
        app.view.refresh_view(force=True)
        await select(pilot, app, NodeRef(1, (ORIGIN, 0, A4)))
        stats = app.query_one(ServerStats)
        assert stats.border_title == "srv:8000 · blocks held 8 of 100 (8%) · 2 chains"
        assert stats.query_one("#stats-spark").data == [0.5]  # (60 - 10) / (200 - 100)
        table = shown(stats.query_one("#stats-table"))
        assert "held 8 of 100" in table  # the capacity (at 120x36 the table's columns wrap as lines)
        with cache.lock:  # as the reader applies
            cache.apply(batch(4, BlocksRemoved(hashes=(A4, B1, B2, B3, B4))), ORIGIN)
        assert tree.node_for(NodeRef(1, (ORIGIN, 0, A4))) is not None  # nothing moves before the timer
        await wait_for(pilot, lambda: tree.node_for(NodeRef(1, (ORIGIN, 0, A4))) is None, 5, "the next 4 Hz refresh")
        assert [node.data.chain for node in tree.root.children] == [1]  # chain #2 went with B1
        assert not any(A4[:8] in label for label in labels(tree))
        assert tree.cursor_ref == NodeRef(1)  # the selection fell back to its chain
        assert stats.border_title.startswith("srv:8000 · blocks held 3 of 100")
        assert "removed" in shown(stats.query_one("#stats-table"))


async def test_the_view_stays_bounded_with_5000_chains(tmp_path):
    texts = TokenTexts()
    texts.learn(dict(enumerate(WORDS)), special=[0])
    cache = PrefixCache(texts)
    events = [stored([f"{0x10000 + n:016x}"], [0, 1, 2, n % 12]) for n in range(5000)]
    cache.apply(batch(0, *events), ORIGIN)
    app = replay_app(cache)
    async with app.run_test(size=(120, 36)) as pilot:
        await pilot.pause(0.1)
        tree = app.query_one(PrefixTreePane)
        chains = [node.data.chain for node in tree.root.children if node.data is not None]
        assert len(chains) == MAX_CHAINS and chains[0] == 5000 and chains[-1] == 5000 - MAX_CHAINS + 1
        assert tree.node_count <= 2000
        info = tree.root.children[-1]
        assert info.data is None and "4800 older chains" in info.label.plain
        assert "4800 older chains" in str(tree.border_subtitle)
        path = app.save_screenshot(filename="attach.svg", path=str(tmp_path))
        svg = Path(path).read_text()
        assert "#5000" in svg and "system" in svg


def test_the_view_counts_what_the_node_budget_leaves_out():
    cache = PrefixCache(TokenTexts())
    for chain in range(300):
        hashes = [f"{chain:08x}{n:08x}" for n in range(20)]
        cache.apply(batch(chain, stored(hashes, list(range(80)))), ORIGIN)
    view = build_view(cache, expanded=set(range(1, 301)))
    assert view.nodes <= 2000 and len(view.chains) == MAX_CHAINS
    assert view.chains_hidden == 100
    assert view.blocks_hidden == 300 * 20 - sum(len(c.rows) for c in view.chains)
    cut = [c for c in view.chains if c.hidden]
    assert cut and all(len(c.rows) + c.hidden == 20 for c in cut)
    pinned = build_view(cache, expanded={3}, pinned={3})  # an old chain the user selected stays
    assert pinned.chains[-1].chain == 3 and len(pinned.chains[-1].rows) == 20


async def test_refreshes_skip_while_the_reader_holds_the_cache_and_keys_still_answer():
    cache = synthetic_cache()
    app = live_app(cache)
    async with app.run_test(size=(120, 36)) as pilot:
        await pilot.pause(0.1)
        tree = app.query_one(PrefixTreePane)
        first = tree.cursor_line
        held, release = threading.Event(), threading.Event()

        def reader():
            with cache.lock:
                cache.apply(batch(4, stored([f"{0xC1:016x}"], [0, 1, 2, 9])), ORIGIN)
                held.set()
                release.wait(10)

        thread = threading.Thread(target=reader)
        thread.start()
        try:
            held.wait(5)
            started = time.monotonic()
            assert app.view.refresh_view(force=True) is False
            assert time.monotonic() - started < 0.1
            await pilot.press("down")
            await pilot.pause(0.05)
            assert tree.cursor_line == first + 1  # the key was answered with the reader holding the lock
            app.view.skipped = BEHIND_AFTER
            app.view.refresh_view(force=True)
            assert "view behind" in shown(app.query_one("#status #status-text"))
            assert [n.data.chain for n in tree.root.children] == [2, 1]  # not shown yet
        finally:
            release.set()
            thread.join(5)
        await wait_for(pilot, lambda: [n.data.chain for n in tree.root.children] == [3, 2, 1], 5, "the next refresh")


async def test_pause_holds_the_view_and_resume_catches_up():
    cache = synthetic_cache()
    app = live_app(cache)
    async with app.run_test(size=(120, 36)) as pilot:
        await pilot.pause(0.1)
        tree = app.query_one(PrefixTreePane)
        await pilot.press("p")
        assert app.view.paused and "live · paused" in shown(app.query_one("#status #status-state"))
        with cache.lock:
            cache.apply(batch(4, stored([f"{0xC1:016x}"], [0, 1, 2, 9])), ORIGIN)
        await pilot.pause(0.4)
        assert [n.data.chain for n in tree.root.children] == [2, 1]
        await pilot.press("p")
        await pilot.pause(0.1)
        assert not app.view.paused and [n.data.chain for n in tree.root.children] == [3, 2, 1]
        assert "batches 5" in shown(app.query_one("#status #status-text"))
        assert shown(app.query_one("#status #status-state")).strip() == "live"


async def test_the_recorded_server_trace_replays():
    app = viewers.server(run=load_server_trace(SAMPLE))
    async with app.run_test(size=(120, 36)) as pilot:
        await pilot.pause(0.1)
        tree = app.query_one(PrefixTreePane)
        assert [n.data.chain for n in tree.root.children] == [4, 3, 2, 1]
        assert "Time:·12:01." in tree.root.children[2].label.plain
        text = screen_text(app)
        assert "SmolLM2-135M-Instruct" in text and "blocks held 4 of 364" in text
        await pilot.press("n")  # the first note: the prompt with a time before the system text
        await pilot.pause(0.1)
        assert tree.cursor_ref is not None and tree.cursor_ref.ident[2] == "e19e62f864f75c65"
        detail = shown(app.query_one(BlockDetail).query_one("#block-detail-body"))
        assert "'Time' (id 7487) instead of 'You' (id 2683)" in detail
        assert "tokens 0..128 (128)" in detail
        assert "<|im_start|>system↵Time:·12:01. You are a careful" in detail  # its tokens, drawn printable
        assert "instead of '1' (id 33)" in detail  # the notes of prompts that left its chain, #2
        await pilot.press("p")  # nothing to pause in a replay: says so, changes nothing
        assert not app.view.paused


async def test_at_80x24_the_server_view_keeps_every_number():
    """The stats table's seven columns do not fit beside the tree at 80 columns: the same facts wrap as lines,
    and the hit-rate line stays on screen."""
    app = viewers.server(run=load_server_trace(SAMPLE))
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause(0.2)
        right = app.screen.query_one("#right").region.x  # the right column (the requests pane is beside it, left)
        text = " ".join(" ".join(line[right:] for line in screen_text(app).splitlines()).replace("│", " ").split())
        for fact in ("stored 4", "removed 0", "held 4 of", "364", "lost 0", "undecodable 0", "restored 0"):
            assert fact in text, (fact, text)
        assert "hit rate 0.0% lately" in text and "17.3% over the server's life" in text
    app = viewers.server(run=load_server_trace(SAMPLE))
    async with app.run_test(size=(200, 50)) as pilot:  # room enough: the table
        await pilot.pause(0.2)
        table = shown(app.query_one(ServerStats).query_one("#stats-table"))
        assert "undecodable" in table and "stored 4 ·" not in table


def test_replay_print_says_the_summary_and_the_notes(tmp_path):
    result = CliRunner().invoke(main, ["replay", "--print", str(SAMPLE)])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].startswith("kvtui: localhost:8811: 4 batches, 4 events")
    assert "kvtui: chains 4, blocks held 4, let go past --max-blocks 0" in lines
    assert any(
        line.startswith(
            "kvtui: warning recomputed-prefix: the prompt left cached chain #1 at token 3: 'Time' (id 7487)"
        )
        for line in lines
    )
    assert sum(line.startswith("kvtui: warning ") for line in lines) == 4
    step_trace = tmp_path / "steps.jsonl"
    step_trace.write_text('{"type": "header"}\n')
    refused = CliRunner().invoke(main, ["replay", "--print", str(step_trace)])
    assert refused.exit_code == 2 and "--print is for server traces" in refused.output
    broken = tmp_path / "broken.jsonl"
    broken.write_text(SAMPLE.read_text().splitlines()[0] + "\nnot json\n{}\n")
    failed = CliRunner().invoke(main, ["replay", "--print", str(broken)])
    assert failed.exit_code == 2 and "broken.jsonl:2: not a JSON line" in failed.output


async def test_help_lists_the_keys_and_refreshes_go_on_under_it():
    from kvtui.widgets.shared.help_screen import HelpScreen

    cache = synthetic_cache()
    app = live_app(cache)
    async with app.run_test(size=(120, 36)) as pilot:
        await pilot.pause(0.1)
        await pilot.press("question_mark")
        await pilot.pause(0.05)
        assert isinstance(app.screen, HelpScreen)
        assert "next note" in screen_text(app)
        with cache.lock:
            cache.apply(batch(4, stored([f"{0xC1:016x}"], [0, 1, 2, 9])), ORIGIN)
        assert app.view.refresh_view(force=True) is True  # the panes are on the screen below: still updated
        assert [n.data.chain for n in app.view.tree_pane.root.children] == [3, 2, 1]
        await pilot.press("escape")
        await pilot.pause(0.05)
        assert not isinstance(app.screen, HelpScreen)


def test_attach_refuses_an_events_endpoint_zeromq_cannot_use_in_one_line():
    # it subscribed to 'notaurl' and waited for ever, saying nothing; a well-formed endpoint with no publisher
    # behind it is not refused (it may start later: ZeroMQ connects when it does)
    for args, name in (
        (["--events", "notaurl"], "--events 'notaurl'"),
        (["--events", "tcp://127.0.0.1"], "--events 'tcp://127.0.0.1'"),  # no port
        (["--events", "tcp://127.0.0.1:5557", "--replay-events", "http://x:1"], "--replay-events 'http://x:1'"),
    ):
        result = CliRunner().invoke(main, ["attach", *args, "--headless", "--duration", "5"])
        assert result.exit_code == 2, result.output
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"kvtui: error: {name} is not a ZeroMQ endpoint"), lines
