"""A Static for text that changes at every repaint: it asks Textual for a layout pass only when its height does.

`Static.update` lays out the whole screen by default, since new text may change the widget's size. While
the model runs the panes repaint twice a second, and on a 2-core machine those screen-wide passes (a few
ms each, two or three per repaint) are CPU the engine process could use. Most of this text keeps its size
from one step to the next: a one-line header, the cursor block, a chat reply that has not wrapped yet.
"""

from __future__ import annotations

from textual.visual import VisualType
from textual.widgets import Static


class LiveText(Static):
    """`show_text(content)` is `update(content)` with a layout pass only when the height changes."""

    def show_text(self, content: VisualType) -> bool:
        """Replace the content; True when a layout pass follows (its height changed, or it has none yet)."""
        before = self.content_size
        self.update(content, layout=False)
        height, width = self.styles.height, self.styles.width
        if not before.width or (width is not None and width.is_auto):
            self.refresh(layout=True)  # not laid out yet, or its width follows its text
            return True
        if height is not None and not height.is_auto:
            return False  # a fixed height: the text is cropped or padded, the layout stays
        if self.get_content_height(self.container_size, self.app.size, before.width) != before.height:
            self.refresh(layout=True)
            return True
        return False
