"""`kvtui diff A.jsonl B.jsonl`: the first step where two traces diverge, as a readable report.

Exit status: 0 when the traces agree (a different cache strategy is a note), 1 when they diverge (the report
names the step and field), 2 when a trace cannot be read (one line on stderr naming the file and line). A trace
whose last line a crash cut short is read as `kvtui replay` reads it, and the report says where it ends.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..engine.records.diff import DiffResult, diff_traces, first_difference, raw_logit, token_pieces
from ..engine.records.trace import Trace, TraceError, read_trace
from ..fmt import positions, printable

TOP_SHOWN = 5


@click.command("diff")
@click.argument("trace_a", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("trace_b", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--tie-tolerance",
    type=click.FloatRange(0),
    default=1e-3,
    show_default=True,
    help="Top-k neighbours whose logits differ by at most this much may swap places (near-ties).",
)
def diff(trace_a: Path, trace_b: Path, tie_tolerance: float) -> None:
    """Compare two traces and report the first step where they diverge.

    Compared in step order: fed input_ids, positions, the chosen token, the raw top-k order (near-ties
    aside), and the cache fill when both ran the same cache strategy. A different cache strategy, kind or
    capacity, versions, dtype and device are notes only. A trace cut short by a crash is read up to its
    last whole line. Exit 0 when they agree, 1 when they diverge, 2 when a trace cannot be read.
    """
    from ..engine.server.server_trace import is_server_trace

    if is_server_trace(trace_a) or is_server_trace(trace_b):
        sys.exit(_diff_servers(trace_a, trace_b))
    try:
        # as replay reads it: a last line cut mid-write by a crash is dropped (the report says where it ends)
        a, b = read_trace(trace_a), read_trace(trace_b)
    except TraceError as exc:
        click.echo(f"kvtui: error: {' '.join(str(exc).split())}", err=True)  # one line, on stderr
        sys.exit(2)
    result = diff_traces(a, b, tie_tolerance=tie_tolerance)
    print_report(Console(), a, b, result, tie_tolerance)
    sys.exit(0 if result.agree else 1)


def _diff_servers(trace_a: Path, trace_b: Path) -> int:
    """Two `kvtui attach --trace` runs: their notes, chains and totals (0 agree, 1 differ, 2 unreadable)."""
    from ..engine.server.server_trace import ServerTraceError, diff_server_runs, is_server_trace, load_server_trace

    if not (is_server_trace(trace_a) and is_server_trace(trace_b)):
        click.echo("kvtui: error: one trace is a server trace (kvtui attach) and the other is not", err=True)
        return 2
    try:
        a, b = load_server_trace(trace_a), load_server_trace(trace_b)
    except ServerTraceError as exc:
        click.echo(f"kvtui: error: {' '.join(str(exc).split())}", err=True)
        return 2
    lines = diff_server_runs(a, b)
    click.echo(f"A {trace_a}: {a.batches} batches; B {trace_b}: {b.batches} batches")
    for line in lines:
        click.echo(line)
    click.echo("differ" if lines else "agree: the same notes, chains and totals")
    return 1 if lines else 0


def print_report(console: Console, a: Trace, b: Trace, result: DiffResult, tie_tolerance: float) -> None:
    console.print(_summary(a, b))
    for note in result.notes:
        console.print(f"[dim]note[/]  {_literal(note)}", soft_wrap=True, highlight=False)
    if result.agree:
        console.print(
            f"[bold green]agree[/]  {_literal(result.detail)}; tie tolerance {tie_tolerance:g}",
            soft_wrap=True,
            highlight=False,
        )
        return
    console.print(
        f"[bold red]diverge at step {result.step}[/] ([bold]{result.field}[/]): {_literal(result.detail)}",
        soft_wrap=True,
        highlight=False,
    )
    facts = [f"{result.steps_compared} step(s) agreed before it"]
    if result.logit_gap is not None:
        facts.append(f"max |logit difference| over the shared top-k there: {result.logit_gap:.3g}")
    ca, cb = result.chosen_logits
    pa, pb = result.chosen_processed
    if ca is not None or cb is not None:
        facts.append(f"chosen token's raw logit: A {_num(ca)}, B {_num(cb)}")
    if (pa, pb) != (ca, cb) and (pa is not None or pb is not None):  # a sampler's processors changed them
        facts.append(f"after the sampler's processors: A {_num(pa)}, B {_num(pb)}")
    console.print("  " + "; ".join(facts), soft_wrap=True, highlight=False)
    table = _step_table(a, b, result.step)
    if table is not None:
        console.print(table)


def _summary(a: Trace, b: Trace) -> Table:
    table = Table(title="kvtui diff", expand=False, title_justify="left")
    table.add_column("", style="bold")
    table.add_column("A", overflow="fold")
    table.add_column("B", overflow="fold")
    rows = [
        ("trace", str(a.path), str(b.path)),
        ("model", _get(a.header, "model"), _get(b.header, "model")),
        ("class", _get(a.header, "model_class"), _get(b.header, "model_class")),
        ("cache", _cache(a.header), _cache(b.header)),
        (
            "dtype · device",
            f"{_get(a.header, 'dtype')} · {_get(a.header, 'device')}",
            f"{_get(b.header, 'dtype')} · {_get(b.header, 'device')}",
        ),
        (
            "transformers · torch",
            f"{_get(a.header, 'transformers')} · {_get(a.header, 'torch')}",
            f"{_get(b.header, 'transformers')} · {_get(b.header, 'torch')}",
        ),
        ("steps", str(len(a.steps)), str(len(b.steps))),
    ]
    for name, va, vb in rows:
        style = "" if va == vb or name == "trace" else "yellow"
        table.add_row(name, _literal(va), _literal(vb), style=style)
    return table


def _step_table(a: Trace, b: Trace, step: int | None) -> Table | None:
    if step is None:
        return None
    sa, sb = _find(a, step), _find(b, step)
    if sa is None and sb is None:
        return None
    pieces = token_pieces(a) | token_pieces(b)
    at = first_difference((sa or {}).get("input_ids") or [], (sb or {}).get("input_ids") or [])
    table = Table(title=f"step {step}", expand=False, title_justify="left")
    table.add_column("", style="bold")
    table.add_column("A", overflow="fold")
    table.add_column("B", overflow="fold")
    rows = [
        ("phase · turn", lambda s: f"{s.get('phase')} · {s.get('turn')}"),
        ("fed", lambda s: _fed(s.get("input_ids") or [], at, pieces)),
        ("positions", lambda s: positions(s.get("positions") or [])),
        ("chosen", _chosen),
        ("top-k (raw)", lambda s: _tops(s.get("topk"))),
        ("cache length", lambda s: str(s.get("cache_seq_length"))),
        ("filled per layer", lambda s: " ".join(str(layer.get("filled")) for layer in s.get("layers") or [])),
    ]
    if any(_processors_changed(s) for s in (sa, sb) if s is not None):  # the list the sampler chose from
        rows.insert(5, ("top-k (processed)", lambda s: _tops(s.get("topk_processed"))))
    for name, show in rows:
        va = show(sa) if sa is not None else "(no such step)"
        vb = show(sb) if sb is not None else "(no such step)"
        table.add_row(name, _literal(va), _literal(vb), style="" if va == vb else "yellow")
    return table


def _literal(text: str) -> str:
    """Trace text shown as it is: no markup, control characters and bidi overrides escaped."""
    return escape(printable(text, newlines=True))


def _find(trace: Trace, step: int) -> dict | None:
    return next((s for s in trace.steps if s.get("step") == step), None)


def _fed(ids: list, at: int | None, pieces: dict) -> str:
    """The fed tokens around the first difference (or the last few when they are the same)."""
    if at is None:
        at = len(ids)
    start, stop = max(0, at - 3), min(len(ids), at + 4)
    if at >= len(ids):
        start, stop = max(0, len(ids) - 6), len(ids)
    shown = [f"{pieces[i]!r}:{i}" if i in pieces else str(i) for i in ids[start:stop]]
    if at < len(ids):
        shown[at - start] = f"[{shown[at - start]}]"  # the first difference
    return f"{len(ids)} token(s): " + ("… " if start else "") + " ".join(shown) + (" …" if stop < len(ids) else "")


def _top(record: dict | None) -> str:
    if not record:
        return "-"
    forced = " forced" if record.get("forced") else ""
    return f"{record.get('text')!r} id {record.get('id')} logit {_num(record.get('logit'))}{forced}"


def _tops(records: list | None) -> str:
    return "\n".join(_top(t) for t in (records or [])[:TOP_SHOWN])


def _chosen(step: dict) -> str:
    """The chosen token with its raw logit, as the raw top-k beside it shows logits; its processed logit
    (what the sampler chose by) after it where the two differ."""
    record = step.get("chosen")
    if not record:
        return "-"
    raw = raw_logit(step, record.get("id"))
    text = f"{record.get('text')!r} id {record.get('id')} "
    text += f"logit {_num(raw)}" if raw is not None else "not in the raw top-k"
    processed = record.get("logit")
    if processed is not None and processed != raw:
        text += f" (processed {_num(processed)})"
    return text + (" forced" if record.get("forced") else "")


def _processors_changed(step: dict) -> bool:
    processed = step.get("topk_processed")
    return processed is not None and [(t.get("id"), t.get("logit")) for t in processed] != [
        (t.get("id"), t.get("logit")) for t in step.get("topk") or []
    ]


def _num(value) -> str:
    return "?" if value is None else f"{value:.6g}"


def _get(header: dict, key: str) -> str:
    value = header.get(key)
    return "-" if value is None else str(value)


def _cache(header: dict) -> str:
    capacity = header.get("capacity")
    return f"{header.get('cache')}" + (f" (capacity {capacity})" if capacity is not None else "")


if __name__ == "__main__":
    diff()
