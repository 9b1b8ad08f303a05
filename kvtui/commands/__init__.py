"""kvtui's helper subcommands: one module per command, each exporting its click command object,
which `kvtui.cli` adds to the `main` group.

- `diff_cmd.diff`: `kvtui diff A.jsonl B.jsonl [--tie-tolerance X]` -- the first step where two
  traces diverge (exit 0 agree, 1 diverge, 2 unreadable trace). The comparison itself is
  `kvtui.engine.records.diff.diff_traces` (no UI library).
- `serve_cmd`: `kvtui serve [MODEL] [options]` -- the TUI in a web browser (textual-serve).
"""
