"""The attach screen's prefix tree: one node per chain (newest first), its blocks under it once expanded.

A chain's label: `#N  <its first tokens>  (k blocks, medium, origin)`; a block's: its depth, the position of
its first token, its hash (8 hex) and its text. A run of blocks (each the only child of the one before) lists
flat under the chain; the children of a block with several are nested under it (branches).

show(view) updates the tree in place, per chain: chains that left are removed, new ones inserted in order, a
chain's blocks re-added only where its shape changed; the cursor stays on the same chain or block (by key),
and which chains are expanded is kept by chain number, which branches are collapsed by block key.
"""

from __future__ import annotations

from typing import ClassVar

from rich.text import Text
from textual.binding import Binding, BindingType
from textual.widgets import Tree
from textual.widgets.tree import TreeNode

from ...engine.server.view import BlockFacts, BlockRow, CacheView, ChainRow, Ident, NodeRef, TextsView, ident_of
from ..shared.palette import Palette, role_style
from .server_tokens import tokens_text

CHAIN_PREVIEW = 40  # characters of a chain's first tokens in its label
BLOCK_PREVIEW = 48  # characters of a block's text in its label
LABELS_KEPT = 20_000  # block labels remembered (a block's tokens never change)


class PrefixTreePane(Tree[NodeRef]):
    DEFAULT_CSS = """
    PrefixTreePane {
        border: round $foreground 25%;
        border-title-color: $text-muted;
        border-subtitle-color: $text-accent;
        border-subtitle-align: left;
        &:focus { border: round $accent; }
    }
    """
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("right", "open", "Expand", show=False),
        Binding("left", "close", "Collapse", show=False),
    ]

    def __init__(self, *, id: str | None = None):
        super().__init__("chains", id=id)
        self.show_root = False
        self.guide_depth = 2
        self.expanded_chains: set[int] = set()
        self.collapsed_blocks: set[Ident] = set()
        self._chain_nodes: dict[int, TreeNode[NodeRef]] = {}
        self._chain_shapes: dict[int, tuple] = {}
        self._chain_labels: dict[int, Text] = {}
        self._block_nodes: dict[Ident, TreeNode[NodeRef]] = {}
        self._chain_blocks: dict[int, list[Ident]] = {}  # the blocks with a node, per chain
        self._labels: dict[Ident, Text] = {}
        self._palette: Palette | None = None
        self._info: TreeNode[NodeRef] | None = None
        self.view: CacheView | None = None
        self.border_title = "prefix cache"

    # ---- reading ---------------------------------------------------------------------------------------

    @property
    def cursor_ref(self) -> NodeRef | None:
        node = self.cursor_node
        return node.data if node is not None else None

    def node_for(self, ref: NodeRef) -> TreeNode[NodeRef] | None:
        if ref.ident is not None:
            return self._block_nodes.get(ref.ident)
        return self._chain_nodes.get(ref.chain)

    @property
    def node_count(self) -> int:
        """Chain and block nodes in the tree now."""
        return len(self._chain_nodes) + len(self._block_nodes)

    # ---- updating ------------------------------------------------------------------------------------

    def show(self, view: CacheView, texts: TextsView, palette: Palette | None = None) -> None:
        if palette != self._palette:
            self._palette = palette
            self._labels.clear()
            self._chain_labels.clear()
        if len(self._labels) > LABELS_KEPT:
            self._labels.clear()
        self.view = view
        before = self.cursor_ref
        wanted = {row.chain for row in view.chains}
        for chain in [c for c in self._chain_nodes if c not in wanted]:
            self._drop_chain(chain)
        previous: TreeNode[NodeRef] | None = None
        for row in view.chains:
            node = self._chain_nodes.get(row.chain)
            label = self._chain_label(row, texts)
            if node is None:
                if previous is not None:
                    node = self.root.add(label, NodeRef(row.chain), after=previous, expand=row.expanded)
                elif self.root.children:
                    node = self.root.add(label, NodeRef(row.chain), before=0, expand=row.expanded)
                else:
                    node = self.root.add(label, NodeRef(row.chain), expand=row.expanded)
                self._chain_nodes[row.chain] = node
            elif self._chain_labels.get(row.chain) != label:
                node.set_label(label)
            self._chain_labels[row.chain] = label
            self._show_blocks(node, row, texts)
            previous = node
        self._show_info(view)
        self.border_title = f"prefix cache · {view.total_chains} chains · {view.held} blocks held"
        if before is not None and self.node_for(before) is not self.cursor_node:
            self.select_ref(before)  # its node was re-added, or it went (then its chain's node)

    def _drop_chain(self, chain: int) -> None:
        node = self._chain_nodes.pop(chain)
        self._forget_blocks(chain)
        self._chain_shapes.pop(chain, None)
        self._chain_labels.pop(chain, None)
        node.remove()

    def _forget_blocks(self, chain: int) -> None:
        for ident in self._chain_blocks.pop(chain, ()):
            self._block_nodes.pop(ident, None)

    def _show_blocks(self, node: TreeNode[NodeRef], row: ChainRow, texts: TextsView) -> None:
        shape = (tuple((ident_of(r.block), r.container) for r in row.rows), row.hidden)
        if self._chain_shapes.get(row.chain) == shape:
            return
        self._chain_shapes[row.chain] = shape
        self._forget_blocks(row.chain)
        if node.children:
            node.remove_children()
        containers = {r.container for r in row.rows if r.container is not None}
        for block_row in row.rows:
            self._add_block(node, row.chain, block_row, ident_of(block_row.block) in containers, texts)
        if row.hidden:
            node.add_leaf(
                Text(f"… {row.hidden}{'' if row.exact else '+'} more blocks not shown", style="italic dim"), None
            )

    def _add_block(self, chain_node, chain: int, row: BlockRow, holds: bool, texts: TextsView) -> None:
        ident = ident_of(row.block)
        parent = chain_node if row.container is None else self._block_nodes.get(row.container, chain_node)
        label = self._block_label(row.block, texts)
        ref = NodeRef(chain, ident)
        if holds:
            node = parent.add(label, ref, expand=ident not in self.collapsed_blocks)
        else:
            node = parent.add_leaf(label, ref)
        self._block_nodes[ident] = node
        self._chain_blocks.setdefault(chain, []).append(ident)

    def _show_info(self, view: CacheView) -> None:
        words = []
        if view.chains_hidden:
            words.append(f"{view.chains_hidden} older chains")
        if view.blocks_hidden:
            words.append(f"{view.blocks_hidden} blocks")
        self.border_subtitle = f"not shown: {', '.join(words)}" if words else ""
        label = Text(f"… not shown: {', '.join(words)} (expand a chain to see its blocks)", style="italic dim")
        if not view.chains_hidden:
            if self._info is not None:
                self._info.remove()
                self._info = None
            return
        if self._info is None:
            self._info = self.root.add_leaf(label, None)
        else:
            self._info.set_label(label)

    def _chain_label(self, row: ChainRow, texts: TextsView) -> Text:
        top = row.top
        palette = self._palette
        label = Text()
        label.append(f"#{row.chain}", style=role_style(palette, "primary", "bold"))
        label.append("  ")
        label.append_text(tokens_text(texts, top.tokens, palette, CHAIN_PREVIEW))
        blocks = f"{row.blocks}{'' if row.exact else '+'} block{'' if row.blocks == 1 else 's'}"
        medium = f"{top.medium} (as the server says)" if top.medium else ""
        also = f"also held on {', '.join(row.replicas)}" if row.replicas else ""
        where = ", ".join(part for part in (blocks, medium, top.origin, also) if part)
        label.append(f"  ({where})", style=role_style(palette, "muted"))
        return label

    def _block_label(self, block: BlockFacts, texts: TextsView) -> Text:
        ident = ident_of(block)
        label = self._labels.get(ident)
        if label is None:
            palette = self._palette
            label = Text()
            label.append(f"{block.depth:>3} @{block.start:<6}", style=role_style(palette, "muted"))
            label.append(f"{block.key[:8]}  ", style=role_style(palette, "info"))
            label.append_text(tokens_text(texts, block.tokens, palette, BLOCK_PREVIEW))
            self._labels[ident] = label
        return label

    # ---- selecting ---------------------------------------------------------------------------------------

    def select_ref(self, ref: NodeRef) -> bool:
        """Move the cursor to this chain or block (its chain node where the block has no node): whether the
        node was found. Expands what holds it."""
        node = self.node_for(ref)
        if node is None and ref.ident is not None:
            node = self._chain_nodes.get(ref.chain)
        if node is None:
            return False
        parent = node.parent
        while parent is not None and parent is not self.root:
            if not parent.is_expanded:
                parent.expand()
            parent = parent.parent
        _ = self.last_line  # the tree's lines are rebuilt lazily: build them so the node has its line
        self.move_cursor(node, animate=False)
        return self.cursor_node is node

    # ---- expanding -------------------------------------------------------------------------------------

    def on_tree_node_expanded(self, event: Tree.NodeExpanded[NodeRef]) -> None:
        ref = event.node.data
        if ref is None:
            return
        if ref.ident is None:
            self.expanded_chains.add(ref.chain)
        else:
            self.collapsed_blocks.discard(ref.ident)

    def on_tree_node_collapsed(self, event: Tree.NodeCollapsed[NodeRef]) -> None:
        ref = event.node.data
        if ref is None:
            return
        if ref.ident is None:
            self.expanded_chains.discard(ref.chain)
        else:
            self.collapsed_blocks.add(ref.ident)

    def action_open(self) -> None:
        node = self.cursor_node
        if node is None:
            return
        if node.allow_expand and not node.is_expanded:
            node.expand()
        elif node.children:
            self.move_cursor(node.children[0])

    def action_close(self) -> None:
        node = self.cursor_node
        if node is None:
            return
        if node.allow_expand and node.is_expanded:
            node.collapse()
        elif node.parent is not None and node.parent is not self.root:
            self.move_cursor(node.parent)
