"""The `kvtui attach` screen (and `kvtui replay` of a server trace): a server's prefix cache as its KV events
tell it. Left the chains and their blocks; right the selected block, the server's numbers and its hit rate
over time; below the notes; a status line.

The reader thread (AttachSession) applies events under `cache.lock`; this app never follows events one by
one: a 4 Hz timer takes the lock (waiting at most LOCK_WAIT_S; if the reader has it, that refresh is skipped,
so keys are answered at any event rate), copies a bounded view (attach_view: the newest chains, at most
MAX_NODES tree nodes) and lets the lock go before the panes draw it.
"""

from __future__ import annotations

import time
from pathlib import Path

from rich.table import Table
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Footer, Static, Tree

from .engine.serving.prefix_cache import PrefixCache
from .themes import DEFAULT_THEME, load_themes
from .widgets.attach_view import NodeRef, block_info, build_view, note_target, stats_view
from .widgets.block_detail import BlockDetail
from .widgets.cache_notes import MAX_SHOWN, CacheNotes
from .widgets.palette import theme_palette
from .widgets.prefix_tree_pane import PrefixTreePane
from .widgets.server_stats import ServerStats

REFRESH_HZ = 4
LOCK_WAIT_S = 0.02  # the longest a refresh waits for the reader to let the cache go
BEHIND_AFTER = 8  # refreshes skipped in a row before the status line says the view is behind

HELP = """
The tree lists the prefix cache's chains, newest first (at most 200, and at most 2000 nodes: the rest are
counted). Enter or space expands a chain (right/left too); a run of blocks lists flat, a block with several
children holds each branch under it. The selected block's hash, parent, token range and text show on the
right, with the notes that name it or its chain. Enter on a note, or n, selects the block it names.
p pauses the view (the reader keeps applying events; p again shows where they are).
"""


class AttachHelp(ModalScreen):
    BINDINGS = [Binding("escape,q,question_mark,f1", "app.pop_screen", "close")]
    DEFAULT_CSS = """
    AttachHelp { align: center middle; }
    AttachHelp > VerticalScroll {
        width: 90; max-width: 95%; height: auto; max-height: 80%; border: thick $primary; background: $surface;
        padding: 1 2;
    }
    """

    def __init__(self, bindings: list[Binding]):
        super().__init__()
        self._key_bindings = bindings

    def compose(self) -> ComposeResult:
        table = Table(title="kvtui attach keys", expand=True, show_edge=False)
        table.add_column("key", style="bold", no_wrap=True)
        table.add_column("does")
        for binding in self._key_bindings:
            table.add_row(", ".join(k.strip() for k in binding.key.split(",")), binding.description)
        table.add_row("arrows, enter, space", "move in the tree, expand a chain or a branch")
        with VerticalScroll():
            yield Static(table)
            yield Static(HELP.strip())


class AttachApp(App):
    CSS = """
    #title { height: 1; padding: 0 1; color: $text-accent; text-style: bold; }
    #main { height: 1fr; }
    #tree { width: 55%; height: 1fr; }
    #right { width: 45%; height: 1fr; }
    #detail { height: 1fr; }
    #stats { height: auto; max-height: 60%; }
    #notes { height: 9; }
    #status { height: 1; padding: 0 1; background: $panel; }
    """
    BINDINGS = [
        Binding("q", "quit", "Quit"),
        Binding("n", "next_note", "Next note"),
        Binding("p", "pause", "Pause/resume"),
        Binding("question_mark,f1", "help", "Help"),
    ]

    def __init__(self, session=None, run=None, theme_name: str | None = None):
        """`session`: an AttachSession (live; started and stopped by the caller); `run`: a ServerRun (a
        server trace replayed). Exactly one."""
        if (session is None) == (run is None):
            raise ValueError("AttachApp takes a live session or a replayed server run (one of them)")
        super().__init__()
        for theme in load_themes().values():
            self.register_theme(theme)
        self.theme = theme_name or DEFAULT_THEME
        self.session = session
        self.server_run = run
        self.cache: PrefixCache = session.cache if session is not None else run.cache
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
            f"{s.get('model') or '?'} at {s['url']}" if s.get("url") else str(s.get("model") or "?") for s in servers
        )
        return f"kvtui replay · {Path(self.server_run.path).name}" + (f" · {names}" if names else "")

    def compose(self) -> ComposeResult:
        yield Static(self.title_text, id="title", markup=False)
        with Horizontal(id="main"):
            yield PrefixTreePane(id="tree")
            with Vertical(id="right"):
                yield BlockDetail(id="detail")
                yield ServerStats(id="stats")
        yield CacheNotes(id="notes")
        yield Static("", id="status", markup=False)
        yield Footer()

    def on_mount(self) -> None:
        # kept: the help screen may be on top (query_one looks in the active screen only)
        self.tree_pane = self.query_one(PrefixTreePane)
        self.detail_pane = self.query_one(BlockDetail)
        self.stats_pane = self.query_one(ServerStats)
        self.notes_pane = self.query_one(CacheNotes)
        self.status_line = self.query_one("#status", Static)
        self.tree_pane.focus()
        self.refresh_view(force=True)
        self.set_interval(1 / REFRESH_HZ, self.refresh_view)

    # ---- refreshing ----------------------------------------------------------------------------------

    def refresh_view(self, force: bool = False) -> bool:
        """Copy a bounded view of the cache under its lock and show it; whether it was shown (False: paused,
        or the reader held the lock past LOCK_WAIT_S: the next tick tries again)."""
        if self.paused and not force:
            self._show_status()
            return False
        cache = self.cache
        tree = self.tree_pane
        if not cache.lock.acquire(timeout=LOCK_WAIT_S):
            self.skipped += 1
            self._show_status()
            return False
        try:
            pins = {ref.chain for ref in (self.selected, self._want) if ref is not None}
            signature = (
                cache.batches,
                cache.held,
                len(cache.notes),
                sum(len(m) for m in cache.metrics.values()),
                next((m[-1].ts for m in cache.metrics.values() if m), None),
                frozenset(tree.expanded_chains),
                frozenset(pins),
                self.selected,
            )
            changed = force or signature != self._signature
            if changed:
                view = build_view(cache, tree.expanded_chains, pins)
                info = block_info(cache, self.selected)
                stats = stats_view(cache)
                total = len(cache.notes)
                new_notes = cache.notes[max(self._notes_seen, total - MAX_SHOWN) : total]
                self._notes_seen = total
                self._signature = signature
            else:
                stats = stats_view(cache) if self._stats is None else self._stats
        finally:
            cache.lock.release()
        self.skipped = 0
        self._stats = stats
        if changed:
            self.refreshes += 1
            palette = theme_palette(self)
            texts = cache.texts
            tree.show(view, texts, palette)
            if self._want is not None and tree.select_ref(self._want):
                self._want = None
            gone = ""
            if self.selected is not None:
                what = f"chain #{self.selected.chain}" if self.selected.ident is None else self.selected.ident[2]
                gone = f"{what} is no longer held"
            self.detail_pane.show(info, texts, palette, gone)
            self.stats_pane.show(stats, palette)
            self.notes_pane.add_notes(new_notes, total, palette)
        self._show_status()
        return True

    def _show_status(self) -> None:
        stats = self._stats
        parts = ["live" if self.session is not None else "replay"]
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
            parts.append("PAUSED (p resumes; the reader goes on)")
        elif self.skipped >= BEHIND_AFTER:
            parts.append(f"view behind: the reader held the cache for {self.skipped} refreshes")
        if self.session is not None and getattr(self.session, "error", None) is not None:
            parts.append("the event reader stopped")
        self.status_line.update(" · ".join(parts))

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
        cache = self.cache
        if not cache.lock.acquire(timeout=LOCK_WAIT_S):
            self._signature = None  # the next tick shows it
            return
        try:
            info = block_info(cache, self.selected)
        finally:
            cache.lock.release()
        self.detail_pane.show(info, cache.texts, theme_palette(self))

    def on_cache_notes_chosen(self, message: CacheNotes.Chosen) -> None:
        notes = self.notes_pane
        if message.note in notes.notes:
            self._note_index = notes.notes.index(message.note)
        self.select_note(message.note)

    def select_note(self, note) -> bool:
        """Select the block (or chain) a note names in the tree: whether it is there."""
        cache = self.cache
        if not cache.lock.acquire(timeout=LOCK_WAIT_S * 5):
            self.notify("the reader is busy: try again", severity="warning")
            return False
        try:
            target = note_target(cache, note)
        finally:
            cache.lock.release()
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

    def action_pause(self) -> None:
        if self.session is None:
            self.notify("a replayed trace does not change: nothing to pause")
            return
        self.paused = not self.paused
        if not self.paused:
            self.refresh_view(force=True)
        self._show_status()

    def action_help(self) -> None:
        self.push_screen(AttachHelp(self.BINDINGS))
