"""kvtui's helper subcommands, one module each (wired into `kvtui.cli.main`).

- `diff_cmd.diff`: `kvtui diff A.jsonl B.jsonl [--tie-tolerance X]` -- the first step where two
  traces diverge (exit 0 agree, 1 diverge, 2 unreadable trace).
"""
