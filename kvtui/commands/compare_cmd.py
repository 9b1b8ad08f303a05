"""`kvtui compare [MODEL] --caches none,dynamic,static --script S`: one greedy chat, several cache strategies
side by side (kvtui/compare.py runs them; this prints the table, or opens the compare TUI)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from ..fmt import size as format_bytes
from ..options import DEFAULT_THEME, STATIC_DEFAULT_CAPACITY


def _fail(message: str) -> None:
    from ..fmt import printable

    click.echo(f"kvtui: error: {printable(' '.join(str(message).split()))}", err=True)
    sys.exit(2)


@click.command("compare")
@click.argument("model", required=False)
@click.option(
    "--caches",
    default="none,dynamic,static",
    show_default=True,
    help="Comma-separated strategies: none, dynamic, static, static+compile, press:SPEC (a kvpress press on a "
    "dynamic cache, as --press SPEC: e.g. dynamic,press:knorm:0.5; needs kvpress).",
)
@click.option(
    "--script",
    "script_path",
    type=click.Path(dir_okay=False, path_type=Path),
    required=True,
    help="The chat to run (JSON/YAML/.txt, as for --script): its turns, system prompt and mode.",
)
@click.option(
    "--max-new-tokens", type=click.IntRange(1), default=24, show_default=True, help="Tokens per turn at most."
)
@click.option(
    "--max-cache-len",
    type=click.IntRange(1),
    default=STATIC_DEFAULT_CAPACITY,
    show_default=True,
    help="Static caches' capacity in tokens.",
)
@click.option(
    "--threads",
    type=click.IntRange(1),
    default=None,
    help="CPU threads of every forward in every engine (default: one per CPU; the engines take turns).",
)
@click.option(
    "--memory",
    "memory_gib",
    type=click.FloatRange(0, min_open=True),
    default=None,
    help="GiB the engines may use together (default: the memory available now).",
)
@click.option(
    "--trace-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("."),
    show_default=True,
    help="Where the traces go: one compare-STRATEGY.jsonl per strategy.",
)
@click.option("--headless", is_flag=True, help="No TUI: print the table and `tokens identical: yes|no`.")
@click.option("--theme", default=DEFAULT_THEME, show_default=True, help="TUI theme (kvtui-projector for a classroom).")
def compare(model, caches, script_path, max_new_tokens, max_cache_len, threads, memory_gib, trace_dir, headless, theme):
    """The same greedy chat under several cache strategies, each in its own engine process, in lockstep."""
    from ..compare import CompareError, check_memory, compile_problem, parse_strategies
    from ..engine.chat.script import ScriptError, load_script

    try:
        strategies = parse_strategies(caches)
        script = load_script(script_path)
    except (CompareError, ScriptError) as exc:
        _fail(str(exc))
    if any(s.startswith("press:") for s in strategies):
        from ..engine.chat.press_spec import INSTALL, kvpress_installed

        if not kvpress_installed():
            _fail(f"--caches {caches}: a press:SPEC lane needs kvpress, which is not installed here: {INSTALL}")
    if not headless:  # a screen opens: its theme is checked first (one check, options.py)
        from . import check_theme

        check_theme(theme)
    model = model or (script.options.get("model") if isinstance(script.options.get("model"), str) else None)
    if "static+compile" in strategies:
        problem = compile_problem()
        if problem:
            _fail(f"static+compile cannot run here: {problem}")
    try:
        check_memory(model, len(strategies), int(memory_gib * 2**30) if memory_gib else None)
    except CompareError as exc:
        _fail(str(exc))
    threads = threads or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()) or 1
    options = {
        "max_new_tokens": max_new_tokens,
        "max_cache_len": max_cache_len,
        "temperature": 0.0,
        "mode": script.mode,
        "system": script.system,
        "threads": threads,
        "decode_threads": threads,
        "dtype": "float32",
        "device": "cpu",
    }
    if headless:
        sys.exit(_headless(model, strategies, options, trace_dir, script))
    from .. import viewers

    app = viewers.compare(model, strategies, options, trace_dir, script, theme_name=theme)
    app.run()
    sys.exit(app.view.outcome)


def _headless(model, strategies, options, trace_dir, script) -> int:
    from ..compare import CompareError, Comparison

    def progress(comparison, lane):
        if lane is not None and lane.description and not lane.points:
            click.echo(f"{lane.strategy}: {lane.description}", err=True)

    comparison = Comparison(model, strategies, options, trace_dir, on_update=progress)
    try:
        comparison.start()
        comparison.run(script.turns)
    except CompareError as exc:
        comparison.stop()
        _fail(str(exc))
    except KeyboardInterrupt:
        comparison.stop()
        return 130
    comparison.stop()
    for line in table_lines(comparison):
        click.echo(line)
    for lane in comparison.lanes:
        cost = lane.cost_line()
        if cost:
            click.echo(cost)
        if lane.error:
            click.echo(f"{lane.strategy}: error: {lane.error}")
    difference = comparison.first_difference()
    if difference is not None:
        click.echo(f"first difference at step {difference}")
    click.echo(f"traces: {', '.join(str(trace_dir / name) for name in _trace_names(strategies))}")
    click.echo(f"tokens identical: {'yes' if comparison.identical else 'no'}")
    return 0 if comparison.identical else 1


def _trace_names(strategies):
    from ..compare import trace_name

    return [trace_name(s) for s in strategies]


def table_lines(comparison) -> list[str]:
    """One row per strategy: decode tok/s, ms per token at the start and end of the context, cache bytes."""
    header = ("strategy", "decode tok/s", "ms/token start", "ms/token end", "cache bytes", "compile s", "steps")
    rows = [header]
    for lane in comparison.lanes:
        start, end = lane.edge_ms(False), lane.edge_ms(True)
        rate = lane.tokens_per_s
        rows.append(
            (
                lane.strategy,
                f"{rate:.1f}" if rate else "-",
                f"{start[0]:.1f} @{start[1]}" if start else "-",
                f"{end[0]:.1f} @{end[1]}" if end else "-",
                format_bytes(lane.cache_bytes) if lane.strategy != "none" else "0 (no cache)",
                f"{lane.compile_ms / 1000:.1f}" if lane.compile_ms else "-",
                str(len(lane.points)),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return [
        "  ".join(
            cell.ljust(width) if i == 0 else cell.rjust(width) for i, (cell, width) in enumerate(zip(row, widths))
        )
        for row in rows
    ]
