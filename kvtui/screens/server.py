"""The server view (`kvtui attach`, and `kvtui replay` of a server trace): a server's prefix cache as its KV
events tell it. Left the chains and their blocks, under them the newest requests (their hits and misses) and,
for a fleet, each replica's routing waste and tokens held twice over time; right the selected block, the
server's numbers and its hit rate over time; below the notes; a status line.

The reader (AttachSession; under `kvtui attach` in a process of its own, engine/server/reader_process.py, which
answers the same reads over a pipe) applies events under `cache.lock`; this screen never follows events one by
one: a 4 Hz timer reads a frame (engine/server/view.py's read_frame takes the lock, waiting at most LOCK_WAIT_S;
if the reader has it, that refresh is skipped, so keys are answered at any event rate): frozen copies of a bounded
view (the newest chains, at most MAX_NODES tree nodes), which the panes draw holding no lock and no live block.
"""

from __future__ import annotations

import time
from pathlib import Path

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import Footer, Static, Tree

from ..engine.server.view import Frames, NodeRef, frames_of
from ..keys import SERVER_KEYS
from ..widgets.server.block_detail import BlockDetail
from ..widgets.server.cache_notes import MAX_SHOWN, CacheNotes
from ..widgets.server.fleet_plot import FleetPlot
from ..widgets.server.prefix_tree_pane import PrefixTreePane
from ..widgets.server.request_rows import RequestRows
from ..widgets.server.server_stats import ServerStats
from ..widgets.shared.palette import theme_palette
from ..widgets.shared.status_bar import StatusBar
from .base import SourceScreen

REFRESH_HZ = 4
LOCK_WAIT_S = 0.02  # the longest a refresh waits for the reader to let the cache go
BEHIND_AFTER = 8  # refreshes skipped in a row before the status line says the view is behind

TREE_HELP = """
The tree lists the cache's chains, newest first (at most 200, and at most 2000 nodes: the rest are counted).
Enter or space expands a chain (right/left too); a run of blocks lists flat, a block with several children
holds each branch under it. The selected block's hash, parent, token range and text show on the right, with
the notes that name it or its chain. Enter on a note, or n, selects the block it names.
"""
LIVE_HELP = """
A server's prefix cache as its KV events tell it (kvtui only listens: the server runs as it would without it).
p pauses the view (the reader keeps applying events; p again shows where they are); q stops listening and
quits (the server goes on).
"""
REPLAY_HELP = """
A server trace replayed: the prefix cache its recorded events rebuild (it does not change: nothing to pause).
"""


def model_name(model: str | None) -> str:
    """A model as the title names it: a local directory by its name (the trace header keeps the whole path),
    a hub id as it is."""
    if not model:
        return "?"
    return Path(model).name if model.startswith(("/", "~", "./")) else model


class ServerScreen(SourceScreen):
    CSS_PATH = "server.tcss"
    BINDINGS = SERVER_KEYS
    HELP_TITLE = "kvtui keys · server view"

    def __init__(self, session=None, run=None):
        """`session`: an AttachSession (live; started by the caller, stopped by quit: only its event reader,
        never the server); `run`: a ServerRun (a server trace replayed). Exactly one."""
        if (session is None) == (run is None):
            raise ValueError("the server view takes a live session or a replayed server run (one of them)")
        super().__init__()
        self.session = session
        self.server_run = run
        # the session's reads: over a pipe where its reader runs in a process of its own (reader_process.py)
        frames = getattr(session, "frames", None)
        self.frames: Frames = (
            frames if frames is not None else frames_of(session.cache if session is not None else run.cache)
        )
        self.paused = False
        self.tree_pane: PrefixTreePane | None = None  # set at mount
        self.selected: NodeRef | None = None
        self.skipped = 0  # refreshes skipped in a row (the reader held the lock)
        self.refreshes = 0  # views built
        self._signature: tuple | None = None
        self._want: NodeRef | None = None  # to select once the tree has it (a note's block)
        self._notes_seen = 0
        self._note_index = -1
        self._events_before: tuple[float, int] | None = None
        self._rate = 0.0
        self._stats = None

    # ---- layout --------------------------------------------------------------------------------------

    @property
    def title_text(self) -> str:
        if self.session is not None:
            return f"kvtui attach · {self.session.title}"
        servers = self.server_run.servers
        names = ", ".join(
            f"{model_name(s.get('model'))}" + (f" at {s['url']}" if s.get("url") else "") for s in servers
        )
        return f"kvtui replay · {Path(self.server_run.path).name}" + (f" · {names}" if names else "")

    def compose(self) -> ComposeResult:
        yield Static(self.title_text, id="title", markup=False)
        with Horizontal(id="main"):
            with Vertical(id="left"):
                yield PrefixTreePane(id="tree")
                yield RequestRows(id="requests")
                yield FleetPlot(id="fleet")
            with Vertical(id="right"):
                yield BlockDetail(id="detail")
                yield ServerStats(id="stats")
        yield CacheNotes(id="notes")
        yield StatusBar(id="status", sparklines=False)
        yield Footer()

    def on_mount(self) -> None:
        # kept: the help screen may be on top (query_one looks in the active screen only)
        self.tree_pane = self.query_one(PrefixTreePane)
        self.detail_pane = self.query_one(BlockDetail)
        self.stats_pane = self.query_one(ServerStats)
        self.requests_pane = self.query_one(RequestRows)
        self.fleet_pane = self.query_one(FleetPlot)
        self.notes_pane = self.query_one(CacheNotes)
        self.status_line = self.query_one(StatusBar)
        self.tree_pane.focus()
        self.refresh_view(force=True)
        self.set_interval(1 / REFRESH_HZ, self.refresh_view)

    def on_resize(self, event) -> None:
        self.set_class(event.size.height < 32, "short")

    # ---- refreshing ----------------------------------------------------------------------------------

    def refresh_view(self, force: bool = False) -> bool:
        """Copy a bounded view of the cache under its lock and show it; whether it was shown (False: paused,
        or the reader held the lock past LOCK_WAIT_S: the next tick tries again)."""
        if self.paused and not force:
            self._show_status()
            return False
        tree = self.tree_pane
        pins = {ref.chain for ref in (self.selected, self._want) if ref is not None}
        frame = self.frames.read_frame(
            tree.expanded_chains,
            pins,
            self.selected,
            self._notes_seen,
            self._signature,
            LOCK_WAIT_S,
            force,
            notes_max=MAX_SHOWN,
        )
        if frame is None:  # the reader held the lock: the next tick tries again
            self.skipped += 1
            self._show_status()
            return False
        self.skipped = 0
        self._stats = frame.stats
        if frame.view is not None:
            self._notes_seen = frame.total_notes
            self._signature = frame.signature
            self.refreshes += 1
            palette = theme_palette(self.app)
            tree.show(frame.view, frame.texts, palette)
            if self._want is not None and tree.select_ref(self._want):
                self._want = None
            gone = ""
            if self.selected is not None:
                what = f"chain #{self.selected.chain}" if self.selected.ident is None else self.selected.ident[2]
                gone = f"{what} is no longer held"
            self.detail_pane.show(frame.info, frame.texts, palette, gone)
            self.stats_pane.show(frame.stats, palette)
            self.requests_pane.show(frame.stats, palette)
            self.fleet_pane.show(frame.stats)
            self.notes_pane.add_notes(list(frame.notes), frame.total_notes, palette)
        self._show_status()
        return True

    def _show_status(self) -> None:
        stats = self._stats
        # the state first, in the status line's badge: at any width (the parts after it may be cut)
        state = "live" if self.session is not None else "replay"
        if self.paused:
            state += " · paused"
        if self.session is not None and getattr(self.session, "error", None) is not None:
            state += " · reader stopped"
        self.status_line.set_state(state)
        parts: list[str] = []
        unreachable = getattr(self.session, "unreachable", None)  # a server away: said until it answers
        for outage in unreachable() if unreachable is not None else ():
            parts.append(f"UNREACHABLE since {outage.since_text}: {outage.name}")
        if stats is not None:
            now = time.monotonic()
            if self.session is not None and not self.paused:
                if self._events_before is not None and now > self._events_before[0]:
                    then, events = self._events_before
                    instant = (stats.events - events) / (now - then)
                    self._rate = instant if self._rate == 0 else 0.5 * self._rate + 0.5 * instant
                self._events_before = (now, stats.events)
            lost = sum(s.lost for _, s in stats.origins)
            parts.append(f"batches {stats.batches}")
            if self.session is not None:
                parts.append(f"events/s {self._rate:,.0f}")
            else:
                parts.append(f"events {stats.events}")
            parts.append(f"lost {lost}")
            parts.append(f"let go {stats.let_go}")
        problems = self._problems()
        parts.append(f"problems {len(problems)}")
        if problems:
            parts.append(f"last: {problems[-1]}")
        if self.paused:
            parts.append("p resumes; the reader goes on")
        elif self.skipped >= BEHIND_AFTER:
            parts.append(f"view behind: the reader held the cache for {self.skipped} refreshes")
        if self.session is not None and getattr(self.session, "error", None) is not None:
            parts.append("the event reader stopped")
        self.status_line.set_text(" · ".join(parts))

    def _problems(self) -> list[str]:
        if self.session is not None:
            return [p.message for p in list(self.session.problems)]
        return [str(p.get("message", "")) for p in self.server_run.problems]

    # ---- selecting -------------------------------------------------------------------------------------

    def on_tree_node_highlighted(self, event: Tree.NodeHighlighted) -> None:
        ref = event.node.data
        if ref is None or ref == self.selected:
            return
        self.selected = ref
        self._show_detail()

    def on_tree_node_expanded(self, event: Tree.NodeExpanded) -> None:
        ref = event.node.data
        if ref is not None and ref.ident is None:
            self.refresh_view(force=True)  # a chain's blocks are read once it is expanded

    def _show_detail(self) -> None:
        try:
            info, texts = self.frames.read_block_info(self.selected, LOCK_WAIT_S)
        except TimeoutError:
            self._signature = None  # the next tick shows it
            return
        self.detail_pane.show(info, texts, theme_palette(self.app))

    def on_cache_notes_chosen(self, message: CacheNotes.Chosen) -> None:
        notes = self.notes_pane
        if message.note in notes.notes:
            self._note_index = notes.notes.index(message.note)
        self.select_note(message.note)

    def select_note(self, note) -> bool:
        """Select the block (or chain) a note names in the tree: whether it is there."""
        try:
            target = self.frames.read_note_target(note, LOCK_WAIT_S * 5)
        except TimeoutError:
            self.notify("the reader is busy: try again", severity="warning")
            return False
        if target is None:
            self.notify(f"{note.code}: its block and chain are no longer held", severity="warning")
            return False
        tree = self.tree_pane
        if target.ident is not None:
            tree.expanded_chains.add(target.chain)
        self._want = target
        self.refresh_view(force=True)
        tree.focus()
        return self._want is None

    # ---- keys ----------------------------------------------------------------------------------------

    def action_next_note(self) -> None:
        notes = self.notes_pane
        if not notes.notes:
            self.notify("no notes yet")
            return
        self._note_index = (self._note_index + 1) % len(notes.notes)
        notes.highlighted = self._note_index
        self.select_note(notes.notes[self._note_index])

    # ---- what the chrome asks (screens/base.py) ----------------------------------------------------------

    def unavailable(self, action: str) -> str | None:
        if action == "pause" and self.session is None:
            return "a replayed trace does not change: nothing to pause"
        return None

    def pause_source(self) -> None:
        """p: the view stops following the cache (the reader goes on applying events); p again catches up."""
        self.paused = not self.paused
        if not self.paused:
            self.refresh_view(force=True)
        self._show_status()

    def stop_source(self) -> None:
        """Stop listening: the event reader ends (its sockets, its trace file); the server is not kvtui's."""
        if self.session is not None:
            self.session.stop()

    def help_notes(self) -> str:
        return (LIVE_HELP if self.session is not None else REPLAY_HELP).strip() + "\n" + TREE_HELP.strip()
