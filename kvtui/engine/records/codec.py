"""The codec between the step records' values (snapshot.py) and the dicts a trace, a stream or a pipe carries.

`to_record(value)` turns a Diagnostic, BufferToken, TopToken, LayerInfo, VerifyResult, RowView or
StepSnapshot into its dict; `from_record(Type, record)` turns one back, older traces' records included
(fields added after trace schema 1 came out take their defaults). The trace's own lines are built here
too: `step_record`, `buffer_record`, `diagnostic_record`, `verify_record`. Nothing else in kvtui converts
a record value field by field, so a field added to a value type is written and read in this file only.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Iterable, Sequence
from dataclasses import fields
from itertools import chain, repeat
from typing import Any, TypeVar

from .codes import current_code
from .snapshot import (
    AttentionDetail,
    BufferToken,
    Diagnostic,
    LayerInfo,
    PagedGroupView,
    RequestView,
    RowView,
    StepSnapshot,
    TokenBuffer,
    TopToken,
    VerifyResult,
    Where,
)
from .token_bytes import TokenBytes, bytes_record, learn_bytes

_T = TypeVar("_T")
_ID = operator.attrgetter("id")


def to_record(value) -> dict:
    """A record value as the dict a trace or a pipe carries (tuples become lists)."""
    return _ENCODERS[type(value)](value)


def from_record(kind: type[_T], record: dict, **context: Any) -> _T:
    """The value of type `kind` a record holds. A step or a row also takes the `buffer` (TokenBuffer) the
    reader rebuilt from the fed tokens, a step its `rows`; a diagnostic of a step line takes its `step`."""
    return _DECODERS[kind](record, **context)


# ---- the trace's lines ------------------------------------------------------------------------------


def buffer_record(buffer: Sequence[BufferToken], token_bytes: TokenBytes | None = None) -> dict:
    """The trace's `buffer` line, written after each turn (`bytes`: its pieces that are not their bytes)."""
    found = bytes_record((t.id for t in buffer), token_bytes) if token_bytes else {}
    return {"type": "buffer", "tokens": [_token_record(t) for t in buffer], **({"bytes": found} if found else {})}


def diagnostic_record(d: Diagnostic, step: int | None = None) -> dict:
    """The trace's `diagnostic` line: an alarm raised outside a forward (`step`: numbered in another stream)."""
    return {"type": "diagnostic", "step": d.step if step is None else step, **_alarm_record(d)}


def verify_record(result: VerifyResult, step: int) -> dict:
    """The trace's `verify` line: a full recompute's verdict after step `step`."""
    return {"type": "verify", "step": step, **_verify_record(result)}


def step_record(s: StepSnapshot, objects: bool = False) -> dict:
    """The trace's `step` line (see README, trace schema 1). Top tokens and fed tokens become dicts of their
    fields (C-level maps: no Python line per token). `objects`: for orjson, which writes a tuple as the list it
    is in the record: layers become dicts of their fields as they are, the bytes orjson writes for the dataclass
    itself, at half its cost (orjson reads a slotted dataclass field by field), and the raw and processed top-k
    share one list when they are one tuple."""
    topk = _top_records(s.topk)
    # the same tuple (a watched step's, a greedy session's): its dicts once, when the record is only serialised
    same = objects and s.topk_processed is s.topk
    record = {
        "type": "step",
        "step": s.step,
        "phase": s.phase,
        "turn": s.turn,
        "input_ids": list(s.input_ids),
        "positions": list(s.positions),
        "fed": _token_records(s.buffer.tail(len(s.input_ids))),
        "cursor": s.cursor,
        "cache_seq_length": s.cache_seq_length,
        "capacity": s.capacity,
        "layers": _layers_as_is(s.layers) if objects else list(map(_layer_record, s.layers)),
        "topk": topk,
        "topk_processed": topk if same else _top_records(s.topk_processed),
        "watched": _top_records(s.watched),
        "chosen": None if s.chosen is None else {**_top_record(s.chosen), "forced": s.chosen_forced},
    }
    # set one by one: CPython builds a display of more than 15 entries an entry at a time (twice the bytecode)
    record["turn_done"] = s.turn_done
    record["diagnostics"] = list(map(_alarm_record, s.diagnostics))  # the step's number is the line's
    record["ms"] = {"forward": round(s.forward_ms, 3), "snapshot": round(s.snapshot_ms, 3)}
    record["buffer_length"] = len(s.buffer)
    # the fields of the less usual steps, in this order, only when they apply (no empty dict made for the others)
    if s.attention is not None or s.attention_off:
        if s.attention is not None:
            record["attention"] = attention_record(s)
        if s.attention_off:
            record["attention_off"] = s.attention_off
    if s.source != "session":
        _add_watch_fields(record, s)
    if s.compiled or s.uncached or s.tensor_parallel:  # a session's compiled or uncached step, a sharded one
        if s.compiled:
            record["compile"] = {"compile_ms": s.compile_ms, "recompiles": s.recompiles}
        if s.uncached:
            record["uncached"] = True
        if s.tensor_parallel:
            record["tensor_parallel"] = s.tensor_parallel
    if s.token_bytes:  # none for a text all of whose pieces are whole characters
        _add_step_bytes(record, s)
    return record


def _add_step_bytes(record: dict, s: StepSnapshot) -> None:
    """The step line's `"bytes"`: the bytes of the tokens it names (fed, top-k, watched, chosen, rows) whose
    piece is not their bytes, so that a reader rebuilds any text exactly from the lines it has read."""
    ids = [*s.input_ids, *map(_ID, chain(s.topk, s.topk_processed, s.watched))]  # ids read in C: no line each
    if s.chosen is not None:
        ids.append(s.chosen.id)
    for row in s.rows or ():
        ids += [*row.input_ids, *map(_ID, row.topk)]
    found = bytes_record(ids, s.token_bytes)
    if found:
        record["bytes"] = found


def _pairs(entries) -> list:
    return list(map(list, entries))  # [[position, weight], ...] from its (position, weight) pairs, in C


def attention_record(s: StepSnapshot) -> dict:
    """The step's attention (README, trace schema 1): per layer [[position, weight], ...] or null, and the detail."""
    record: dict[str, Any] = {"layers": [None if e is None else _pairs(e) for e in s.attention or ()]}
    d = s.attention_detail
    if d is not None:
        record.update(
            layer=d.layer,
            heads=[_pairs(h) for h in d.heads],
            groups=[_pairs(g) for g in d.groups],
            all=_pairs(d.all_layers),
            regions=list(d.regions),
            shares=[None if row is None else list(row) for row in d.shares],
        )
    return record


def _entries(pairs) -> tuple[tuple[int, float], ...]:
    return tuple((int(p), float(w)) for p, w in pairs)


def _attention_fields(record: dict | None, layers: int) -> dict:
    """StepSnapshot's attention fields from a step line; a trace from before every layer was captured held one
    layer's head-mean weights per buffer position (`{"layer", "weights"}`): read as that layer's entry."""
    if not record:
        return {}
    if "weights" in record:  # the old form
        layer, weights = record.get("layer"), record["weights"]
        if layer is None or not weights:
            return {}
        ranked = sorted(enumerate(weights), key=lambda pair: -pair[1])
        kept = tuple((i, float(w)) for rank, (i, w) in enumerate(ranked) if rank < 8 or w >= 0.01)
        out: list = [None] * max(layers, layer + 1)
        out[layer] = kept
        return {"attention": tuple(out), "attention_layer": layer}
    detail = None
    if "layer" in record:
        detail = AttentionDetail(
            layer=record["layer"],
            heads=tuple(_entries(h) for h in record.get("heads", [])),
            groups=tuple(_entries(g) for g in record.get("groups", [])),
            all_layers=_entries(record.get("all", [])),
            regions=tuple(record.get("regions", [])),
            shares=tuple(None if row is None else tuple(row) for row in record.get("shares", [])),
        )
    return {
        "attention": tuple(None if e is None else _entries(e) for e in record.get("layers", [])),
        "attention_layer": record.get("layer"),
        "attention_detail": detail,
    }


def sharded_step_record(record: dict, ranks: int) -> dict:
    """A rank's `step` line as the viewer merged it: its layers are one shard of `ranks` ranks' KV heads
    (read back as StepSnapshot.tensor_parallel)."""
    return {**record, "tensor_parallel": ranks}


# a watched step's fields that stay the same from one step to the next of a loop (its caller, cache, lineage...)
_WATCH_KEY = operator.attrgetter(
    "source",
    "caller",
    "cache_id",
    "positions_source",
    "batch",
    "row",
    "cache_parent",
    "cache_copied_at",
    "cache_unknown",
    "model",
    "thread",
    "recomputed",
)


@functools.lru_cache(maxsize=256)  # those values -> their fields, in the record's order (shared: only copied from)
def _watch_template(
    source, caller, cache_id, positions_source, batch, row, parent, copied_at, unknown, model, thread, recomputed
) -> dict:
    return {
        "source": source,
        "caller": caller,
        "cache_id": cache_id,
        "cache_length_before": None,  # set per step
        "requested": None,  # set per step
        "positions_source": positions_source,
        "batch": batch,
        "row": row,
        "lineage": {"parent": parent, "copied_at": copied_at, "unknown_prefix": unknown},
        "model": model,
        "thread": thread,
        "recomputed": recomputed,
    }


def _add_watch_fields(record: dict, s: StepSnapshot) -> None:
    """A watched program's step: what the caller asked for, which cache, its lineage, every batch row. The fields
    that stay the same over a loop's steps are made once (their dict kept per set of values) and copied in."""
    template = _watch_template(*_WATCH_KEY(s))
    record.update(template)  # in the template's order; the values that change per step replaced in place below
    record["cache_length_before"] = s.cache_length_before
    positions, cache_position = s.requested_positions, s.requested_cache_position
    record["requested"] = {
        "position_ids": None if positions is None else list(positions),
        "cache_position": None if cache_position is None else list(cache_position),
    }
    record["lineage"] = dict(template["lineage"])  # each record its own (a reader may keep and change it)
    if s.rows or s.requests is not None or s.paged is not None:  # a batch's rows, a continuous-batching forward's
        if s.rows:
            record["rows"] = [_row_record(r) for r in s.rows]
        if s.requests is not None:  # its requests and the paged cache's groups
            record["requests"] = [_request_record(r) for r in s.requests]
        if s.paged is not None:
            record["paged"] = [_paged_record(g) for g in s.paged]


# ---- values to dicts ----------------------------------------------------------------------------------


def _fields_as_is(cls: type, when_set: tuple[str, ...] = ()):
    """A function: instance -> {field: value} in field order, values as they are (tuples stay tuples); the fields
    in `when_set` only when the first of them is not None (absent from the records of the usual case)."""
    names = [f.name for f in fields(cls) if f.name not in when_set]
    source = "lambda o: {" + ", ".join(f"{name!r}: o.{name}" for name in names)
    if when_set:
        extra = ", ".join(f"{name!r}: o.{name}" for name in when_set)
        source += f", **({{{extra}}} if o.{when_set[0]} is not None else {{}})"
    return eval(source + "}")  # noqa: S307  (generated from the class's own field names, as dataclasses does)


# a compressed cache's held runs: written only for a layer that has them (traces of the usual case unchanged)
_HELD_FIELDS = ("held", "held_heads")
_LAYER_FIELDS_AS_IS = _fields_as_is(LayerInfo, _HELD_FIELDS)

_LAYER_FIELDS = tuple(f.name for f in fields(LayerInfo) if f.name not in _HELD_FIELDS)
_LAYER_VALUES = operator.attrgetter(*_LAYER_FIELDS)
_TUPLE_FIELDS = ("k_shape", "v_shape", "states")  # the fields that hold tuples (lists in a record)


_HELD = operator.attrgetter("held")


def _layers_as_is(layers: tuple[LayerInfo, ...]) -> list[dict]:
    """Every layer's record, values as they are (for orjson): built by C-level maps, no Python line per layer,
    when no layer holds compressed runs (the usual case), else one generated dict display each."""
    if list(map(_HELD, layers)).count(None) == len(layers):  # the same dicts as _LAYER_FIELDS_AS_IS makes
        return list(map(dict, map(zip, repeat(_LAYER_FIELDS), map(_LAYER_VALUES, layers))))
    return list(map(_LAYER_FIELDS_AS_IS, layers))


def _plain(value):
    return [_plain(v) for v in value] if isinstance(value, tuple) else value


def _layer_record(layer: LayerInfo) -> dict:
    # field by field, not dataclasses.asdict: asdict deep-copies and cost ~3 ms a step on 30 layers
    record = dict(zip(_LAYER_FIELDS, _LAYER_VALUES(layer)))  # every field, read in one call
    for name in _TUPLE_FIELDS:
        record[name] = _plain(record[name])
    if layer.held is not None:
        record["held"], record["held_heads"] = _plain(layer.held), _plain(layer.held_heads)
    return record


def _records_of(cls: type) -> Callable[[Iterable], list[dict]]:
    """A function: instances of a record class whose fields are all plain values -> their dicts (its fields in
    order, as `_top_record` / `_token_record` make one), built by C-level maps: no Python line per instance."""
    names = tuple(f.name for f in fields(cls))
    values = operator.attrgetter(*names)
    return lambda items: list(map(dict, map(zip, repeat(names), map(values, items))))


def _top_record(t: TopToken) -> dict:
    return {"id": t.id, "text": t.text, "logit": t.logit, "prob": t.prob, "rank": t.rank}


def _token_record(t: BufferToken) -> dict:
    return {
        "position": t.position,
        "id": t.id,
        "piece": t.piece,
        "special": t.special,
        "origin": t.origin,
        "turn": t.turn,
    }


_top_records = _records_of(TopToken)  # [_top_record(t) for t in tops], in C
_token_records = _records_of(BufferToken)  # [_token_record(t) for t in tokens], in C


def _alarm_record(d: Diagnostic) -> dict:
    """An alarm without its step: in a step line (the step's own) or before the step of a diagnostic line."""
    record: dict[str, Any] = {"code": d.code, "severity": d.severity, "message": d.message}
    if d.where is not None:  # a server's note: where it points
        w = d.where
        record["where"] = {"origin": w.origin, "chain": w.chain, "position": w.position, "block": w.block}
    return record


def _diagnostic_record(d: Diagnostic) -> dict:
    return {**_alarm_record(d), "step": d.step}


def _verify_record(v: VerifyResult) -> dict:
    return {
        "max_abs_diff": v.max_abs_diff,
        "tolerance": v.tolerance,
        "topk_agree": v.topk_agree,
        "cached_top": list(v.cached_top),
        "recomputed_top": list(v.recomputed_top),
        "tokens": v.tokens,
        "ok": v.ok,
        "ms": v.ms,
        **(
            {"compressed_kl": v.compressed_kl, "compressed_top1": v.compressed_top1}
            if v.compressed_kl is not None
            else {}
        ),
        **({"layer_errors": [list(pair) for pair in v.layer_errors]} if v.layer_errors is not None else {}),
        **({"evicted_attention": list(v.evicted_attention)} if v.evicted_attention is not None else {}),
    }


def _row_record(r: RowView) -> dict:
    record = {
        "row": r.row,
        "input_ids": list(r.input_ids),
        "positions": list(r.positions),
        "fed": _token_records(r.buffer[len(r.buffer) - len(r.input_ids) :]),
        "buffer_length": len(r.buffer),
        "topk": _top_records(r.topk),
    }
    if r.request_id is not None:  # a request of a packed forward (absent otherwise: older traces unchanged)
        record["request_id"] = r.request_id
    if r.shared_prefix:
        record["shared_prefix"] = _token_records(r.buffer[: r.shared_prefix])
    return record


def _request_record(r: RequestView) -> dict:
    return {
        "request_id": r.request_id,
        "status": r.status,
        "phase": r.phase,
        "fed": r.fed,
        "held": r.held,
        "prompt_length": r.prompt_length,
        "generated": r.generated,
        "prefix_hit": r.prefix_hit,
        "recomputed": r.recomputed,
        "blocks": [[group, list(blocks)] for group, blocks in r.blocks],
        "shared": r.shared,
        **({"requeued": r.requeued, "reprefilled": r.reprefilled} if r.requeued else {}),
    }


def _paged_record(g: PagedGroupView) -> dict:
    return {
        "name": g.name,
        "layers": g.layers,
        "block_tokens": g.block_tokens,
        "total": g.total,
        "used": g.used,
        "free": g.free,
        "shared": g.shared,
        "cached": g.cached,
    }


_ENCODERS: dict[type, Callable[[Any], dict]] = {
    BufferToken: _token_record,
    TopToken: _top_record,
    LayerInfo: _layer_record,
    Diagnostic: _diagnostic_record,
    VerifyResult: _verify_record,
    RowView: _row_record,
    RequestView: _request_record,
    PagedGroupView: _paged_record,
    StepSnapshot: step_record,
}


# ---- dicts to values ----------------------------------------------------------------------------------


def _token(record: dict) -> BufferToken:
    return BufferToken(
        position=record["position"],
        id=record["id"],
        piece=record["piece"],
        special=record["special"],
        origin=record["origin"],
        turn=record.get("turn", 0),
    )


def _top(record: dict) -> TopToken:
    return TopToken(
        id=record["id"], text=record["text"], logit=record["logit"], prob=record["prob"], rank=record.get("rank", 0)
    )


def _maybe_top(record: dict | None) -> TopToken | None:
    return None if record is None else _top(record)


def _diagnostic(record: dict, step: int | None = None) -> Diagnostic:
    """An alarm read back; a code renamed since the trace was written reads as the code that says it now."""
    where = record.get("where")
    return Diagnostic(
        current_code(record["code"]),
        record["severity"],
        record["message"],
        record["step"] if step is None else step,
        Where(**where) if where is not None else None,
    )


def _verify(record: dict) -> VerifyResult:
    return VerifyResult(
        max_abs_diff=record["max_abs_diff"],
        tolerance=record["tolerance"],
        topk_agree=record["topk_agree"],
        cached_top=tuple(record["cached_top"]),
        recomputed_top=tuple(record["recomputed_top"]),
        tokens=record["tokens"],
        ok=record["ok"],
        ms=record["ms"],
        compressed_kl=record.get("compressed_kl"),
        compressed_top1=record.get("compressed_top1"),
        layer_errors=tuple(map(tuple, record["layer_errors"])) if record.get("layer_errors") is not None else None,
        evicted_attention=tuple(record["evicted_attention"]) if record.get("evicted_attention") is not None else None,
    )


def _row(record: dict, buffer: TokenBuffer) -> RowView:
    return RowView(
        row=record["row"],
        input_ids=tuple(record["input_ids"]),
        positions=tuple(record["positions"]),
        topk=tuple(_top(t) for t in record["topk"]),
        buffer=buffer,
        request_id=record.get("request_id"),
        shared_prefix=len(record.get("shared_prefix") or ()),
    )


def _request(record: dict) -> RequestView:
    return RequestView(
        request_id=record["request_id"],
        status=record["status"],
        phase=record.get("phase", ""),
        fed=record.get("fed", 0),
        held=record.get("held", 0),
        prompt_length=record.get("prompt_length", 0),
        generated=record.get("generated", 0),
        prefix_hit=record.get("prefix_hit", 0),
        recomputed=record.get("recomputed", 0),
        blocks=tuple((str(group), tuple(blocks)) for group, blocks in record.get("blocks", ())),
        shared=record.get("shared", 0),
        requeued=record.get("requeued", 0),
        reprefilled=record.get("reprefilled", 0),
    )


def _paged(record: dict) -> PagedGroupView:
    return PagedGroupView(**{name: record[name] for name in _PAGED_FIELDS})


_PAGED_FIELDS = tuple(f.name for f in fields(PagedGroupView))


def _extra_layer_fields(record: dict) -> dict:
    """The LayerInfo fields added after trace schema 1 came out; absent in older traces (defaults then)."""
    out: dict = {}
    if record.get("states"):
        out["states"] = tuple((str(name), tuple(shape)) for name, shape in record["states"])
    for key in (
        "state_bytes",
        "quant_bits",
        "quant_group",
        "quant_bytes",
        "residual",
        "residual_capacity",
        "offloaded",
    ):
        if key in record:
            out[key] = record[key]
    if record.get("held") is not None:  # a compressed cache's held runs (older traces: absent)
        out["held"] = tuple(tuple(run) for run in record["held"])
    if record.get("held_heads") is not None:
        out["held_heads"] = tuple(tuple(tuple(run) for run in head) for head in record["held_heads"])
    return out


def _layer(layer: dict) -> LayerInfo:
    return LayerInfo(
        index=layer["index"],
        kind=layer["kind"],
        k_shape=tuple(layer["k_shape"]),
        v_shape=tuple(layer["v_shape"]),
        dtype=layer["dtype"],
        device=layer["device"],
        bytes=layer["bytes"],
        filled=layer["filled"],
        capacity=layer.get("capacity"),
        window=layer.get("window"),
        seen=layer.get("seen", layer["filled"]),
        held_from=layer.get("held_from", 0),
        **_extra_layer_fields(layer),
    )


def _step(
    record: dict,
    buffer: TokenBuffer,
    rows: tuple[RowView, ...] | None = None,
    token_bytes: dict[int, bytes] | None = None,
) -> StepSnapshot:
    """A step line's snapshot; `buffer` holds the tokens its cache held after it (the reader rebuilds it
    from each step's fed tokens), `rows` a watched batch's rows (rebuilt the same way); `token_bytes`: the
    reader's table of token bytes, which learns the line's `"bytes"` and is shared by its snapshots."""
    step = record["step"]
    if token_bytes is None:
        token_bytes = {}
    learn_bytes(record.get("bytes"), token_bytes)
    attention = record.get("attention")
    ms = record.get("ms") or {}
    return StepSnapshot(
        step=step,
        phase=record.get("phase", "decode"),
        turn=record.get("turn", 0),
        input_ids=tuple(record["input_ids"]),
        positions=tuple(record["positions"]),
        cursor=record["cursor"],
        cache_seq_length=record["cache_seq_length"],
        capacity=record.get("capacity"),
        layers=tuple(_layer(layer) for layer in record["layers"]),
        topk=tuple(_top(t) for t in record["topk"]),
        topk_processed=tuple(_top(t) for t in record.get("topk_processed", [])),
        watched=tuple(_top(t) for t in record.get("watched", [])),
        chosen=_maybe_top(record.get("chosen")),
        chosen_forced=bool((record.get("chosen") or {}).get("forced")),
        diagnostics=tuple(_diagnostic(d, step) for d in record.get("diagnostics", [])),
        forward_ms=ms.get("forward", 0.0),
        snapshot_ms=ms.get("snapshot", 0.0),
        buffer=buffer,
        turn_done=record.get("turn_done", False),
        **_attention_fields(attention, len(record["layers"])),
        attention_off=record.get("attention_off"),
        compiled="compile" in record,
        compile_ms=(record.get("compile") or {}).get("compile_ms"),
        recompiles=(record.get("compile") or {}).get("recompiles", 0),
        uncached=bool(record.get("uncached")),
        tensor_parallel=record.get("tensor_parallel"),
        token_bytes=token_bytes,
        **_watch_fields(record, rows),
    )


def _watch_fields(record: dict, rows: tuple[RowView, ...] | None) -> dict:
    if record.get("source", "session") == "session":
        return {}
    requested = record.get("requested") or {}
    lineage = record.get("lineage") or {}
    maybe = lambda values: None if values is None else tuple(values)  # noqa: E731
    return {
        "source": record["source"],
        "caller": record.get("caller"),
        "cache_id": record.get("cache_id"),
        "cache_length_before": record.get("cache_length_before"),
        "requested_positions": maybe(requested.get("position_ids")),
        "requested_cache_position": maybe(requested.get("cache_position")),
        "positions_source": record.get("positions_source"),
        "batch": record.get("batch", 1),
        "row": record.get("row", 0),
        "rows": rows,
        "cache_parent": lineage.get("parent"),
        "cache_copied_at": lineage.get("copied_at"),
        "cache_unknown": lineage.get("unknown_prefix") or 0,
        "model": record.get("model"),
        "thread": record.get("thread"),
        "recomputed": record.get("recomputed", 0),
        "requests": None if record.get("requests") is None else tuple(_request(r) for r in record["requests"]),
        "paged": None if record.get("paged") is None else tuple(_paged(g) for g in record["paged"]),
    }


_DECODERS: dict[type, Callable[..., Any]] = {
    BufferToken: _token,
    TopToken: _top,
    LayerInfo: _layer,
    Diagnostic: _diagnostic,
    VerifyResult: _verify,
    RowView: _row,
    RequestView: _request,
    PagedGroupView: _paged,
    StepSnapshot: _step,
}
