"""Textual widgets of kvtui, one per file, grouped by the screen that shows them: `step/` (the step viewer),
`server/` (the server view), `compare/` (kvtui compare) and `shared/` (help, status line, palette)."""
