"""Textual widgets of kvtui: one pane per file, each rendering only the latest StepSnapshot."""
