"""Compare two traces step by step and report the first step where they diverge.

Two runs of the same chat should feed the same tokens at the same positions, choose the same next
token and rank the same top-k, whatever cache strategy or library version produced them: that is what a
run decided. `diff_traces` walks both traces in step order and stops at the first step where one of
these differs, checked in this order:

1. `input_ids`   the tokens the forward fed
2. `positions`   the position ids they were fed with
3. `chosen`      the next token (sampled or forced)
4. `topk`        the raw top-k order; adjacent swaps of near-tied tokens (logits within
                 `tie_tolerance` in either trace) are not a divergence
5. `cache_seq_length`, then `layers` (each layer's `filled`; `seen` when the two layers are of
                 different kinds, e.g. dynamic `sliding` vs `static-sliding`, which hold a different
                 number of slots by design) -- only when both traces ran the same cache strategy (the
                 header's `cache`). Strategies differ in their caches by design (`none` keeps no cache at
                 all): the first such difference is a note, and the decisions above are what is compared.

Differences that do not change what the model computes -- the cache strategy, kind and capacity, the
slots a static layer preallocates, library versions, dtype, device, model path -- are reported as notes.
A trace with fewer steps diverges at its first missing step ("trace B ends at step N"); a trace whose
last line a crash cut short is read as `kvtui replay` reads it (that line dropped) and a note says so.
Logits are shown raw (before the sampler's processors), the chosen token's as well; the processed
logit is named as such where it differs.

Pure Python over the records of `kvtui.engine.records.trace.read_trace`: no torch, no UI library.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .replay import describe_event
from .token_bytes import hex_bytes, learn_bytes, valid_utf8
from .trace import Trace

# Header fields whose difference is worth a note (never a divergence), in report order.
HEADER_NOTES = (
    "model",
    "model_path",
    "model_class",
    "layers",
    "dtype",
    "device",
    "cache",
    "capacity",
    "mode",
    "sampler",
    "seed",
    "transformers",
    "torch",
    "python",
    "kvtui",
)

FIELDS = ("input_ids", "positions", "chosen", "topk", "cache_seq_length", "layers", "steps", "verify", "events")
# Event records compared after the steps (timings and file paths are not compared)
EVENT_KINDS = ("verify", "diagnostic", "rewind", "force", "sampler", "watch", "reset", "export")
EVENT_IGNORED = ("ms", "path")


@dataclass
class DiffResult:
    agree: bool
    step: int | None  # the step number (as the traces number it) of the first divergence
    field: str | None  # one of FIELDS, None when they agree
    detail: str  # one readable sentence (or a few) saying what differs, or what agreed
    # At the divergence: max |logit difference| over the tokens in both top-k lists (None when they
    # share none). When they agree: the largest such gap over every compared step.
    logit_gap: float | None
    # dataclasses.field: the class's own `field` (the name of what differs) hides the bare name here
    notes: list[str] = dataclasses.field(default_factory=list)  # differences that are not a divergence
    steps_compared: int = 0  # steps found equal before the divergence (all of them when they agree)
    # The chosen token's raw logit (from the raw top-k) in each trace at the divergence step (None when the
    # raw top-k does not hold it), and its logit after the sampler's processors (the step's `chosen`).
    chosen_logits: tuple[float | None, float | None] = (None, None)
    chosen_processed: tuple[float | None, float | None] = (None, None)


def diff_traces(a: Trace, b: Trace, tie_tolerance: float = 1e-3) -> DiffResult:
    """The first step where traces `a` and `b` diverge (see the module docstring for the order)."""
    if tie_tolerance < 0:
        raise ValueError(f"tie_tolerance must be >= 0, got {tie_tolerance}")
    notes = _header_notes(a.header, b.header) + _cut_short_notes(a, "A") + _cut_short_notes(b, "B")
    pieces = token_pieces(a) | token_pieces(b)
    layer_notes = _LayerNotes()
    same_strategy = a.header.get("cache") == b.header.get("cache")
    cache_note: str | None = None  # strategies differ: the first step whose cache differs, said once
    max_gap: float | None = None
    compared = 0
    renumbered = False
    attention_note: str | None = None  # the first step whose attention (--attention) looks elsewhere
    first_event = _compare_events(a, b)
    for sa, sb in zip(a.steps, b.steps):
        step = sa.get("step", compared + 1)
        if sb.get("step", step) != step and not renumbered:
            renumbered = True
            notes.append(
                f"step numbers differ from the {compared + 1}th step record on: A {step}, B {sb.get('step')} "
                f"(reported by A's numbering)"
            )
        gap = _logit_gap(sa, sb)
        if attention_note is None:
            attention_note = _attention_note(step, sa, sb)
        found = _compare_decisions(sa, sb, tie_tolerance, pieces)
        if found is None:
            cache = _compare_cache(sa, sb, layer_notes)
            if same_strategy:
                found = cache
            elif cache is not None and cache_note is None:
                cache_note = _strategy_note(a.header.get("cache"), b.header.get("cache"), step, cache[1])
        if first_event is not None and first_event[0] < step:  # what happened before this step comes first
            event_step, field_name, detail = first_event
            return DiffResult(False, event_step, field_name, detail, None, notes + layer_notes.render(), compared)
        if found is not None:
            field_name, detail = found
            notes += [cache_note] if cache_note else []
            notes += [attention_note] if attention_note else []
            notes += layer_notes.render()
            notes += _verify_notes(a, "A") + _verify_notes(b, "B")
            return DiffResult(
                False, step, field_name, detail, gap, notes, compared, _chosen_logits(sa, sb), _chosen_processed(sa, sb)
            )
        if gap is not None:
            max_gap = gap if max_gap is None else max(max_gap, gap)
        compared += 1
    notes += [cache_note] if cache_note else []
    notes += [attention_note] if attention_note else []
    notes += layer_notes.render()
    notes += _verify_notes(a, "A") + _verify_notes(b, "B")
    if len(a.steps) != len(b.steps):
        shorter, longer, name = (b, a, "B") if len(b.steps) < len(a.steps) else (a, b, "A")
        last = shorter.steps[-1].get("step", len(shorter.steps)) if shorter.steps else 0
        missing = longer.steps[len(shorter.steps)]
        other = "A" if name == "B" else "B"
        ends = f"trace {name} ends at step {last}" if shorter.steps else f"trace {name} has no steps"
        if shorter.truncated:
            ends += " (a crash cut its next line short)"
        detail = (
            f"{ends}; trace {other} goes on to step {longer.steps[-1].get('step', len(longer.steps))} "
            f"({len(longer.steps) - len(shorter.steps)} more)"
        )
        if shorter.steps:
            detail += "; the steps both traces hold agree"
        return DiffResult(False, missing.get("step", len(shorter.steps) + 1), "steps", detail, None, notes, compared)
    if first_event is not None:
        step, field_name, detail = first_event
        return DiffResult(False, step, field_name, detail, None, notes, compared)
    detail = f"the traces agree over all {compared} steps"
    if max_gap is not None:
        detail += f" (largest top-k logit difference {max_gap:.3g})"
    return DiffResult(True, None, None, detail, max_gap, notes, compared)


def _strategy_note(strategy_a, strategy_b, step: int, detail: str) -> str:
    return (
        f"cache strategy differs: {strategy_a} in A, {strategy_b} in B; their caches differ by design "
        f"(from step {step}: {detail}), so diff compares what each run decided: tokens, positions, logits"
    )


def _cut_short_notes(trace: Trace, name: str) -> list[str]:
    """A trace a crash cut mid-line, read as replay reads it: where it ends."""
    if not trace.truncated:
        return []
    last = trace.steps[-1].get("step", len(trace.steps)) if trace.steps else None
    ends = f"it ends at step {last}" if last is not None else "it holds no step"
    where = f"line {trace.truncated_line}" if trace.truncated_line is not None else "its last line"
    return [f"trace {name} was cut short by a crash ({where} unfinished, dropped as replay drops it): {ends}"]


# ---- one step ----------------------------------------------------------------------------------


def _compare_decisions(sa: dict, sb: dict, tol: float, pieces: dict[int, str]) -> tuple[str, str] | None:
    """What the run decided: the tokens fed, their positions, the chosen token, the raw top-k."""
    ids_a, ids_b = list(sa.get("input_ids") or []), list(sb.get("input_ids") or [])
    if ids_a != ids_b:
        return "input_ids", _sequence_detail("fed tokens", ids_a, ids_b, pieces)
    pos_a, pos_b = list(sa.get("positions") or []), list(sb.get("positions") or [])
    if pos_a != pos_b:
        return "positions", _sequence_detail("position ids", pos_a, pos_b, None)
    ca, cb = sa.get("chosen"), sb.get("chosen")
    id_a, id_b = (ca or {}).get("id"), (cb or {}).get("id")
    if id_a != id_b:
        return "chosen", (
            f"the next token differs: A chose {_token(id_a, sa, pieces)}"
            f"{_forced(ca)}, B chose {_token(id_b, sb, pieces)}{_forced(cb)}"
        )
    topk = _compare_topk(sa.get("topk") or [], sb.get("topk") or [], tol, pieces)
    if topk is not None:
        return "topk", topk
    return None


def _compare_cache(sa: dict, sb: dict, layer_notes: _LayerNotes) -> tuple[str, str] | None:
    """What the cache holds after the step: a divergence only between traces of one cache strategy."""
    la, lb = sa.get("cache_seq_length"), sb.get("cache_seq_length")
    if la != lb:
        return "cache_seq_length", f"the cache holds {la} tokens in A, {lb} in B"
    return _compare_layers(sa.get("layers") or [], sb.get("layers") or [], layer_notes)


ATTENTION_GAP = 0.01  # a largest weight that moved this much is said (a note: the rows are not a divergence)


def _attention_note(step: int, sa: dict, sb: dict) -> str | None:
    """Where the newest token looked, when both traces captured attention (--attention): the first layer whose
    largest weight sits elsewhere or moved by ATTENTION_GAP or more."""
    aa, ab = (sa.get("attention") or {}).get("layers"), (sb.get("attention") or {}).get("layers")
    if not aa or not ab:
        return None
    for layer, (ea, eb) in enumerate(zip(aa, ab)):
        if not ea or not eb:
            continue
        (pa, wa), (pb, wb) = ea[0], eb[0]
        if pa != pb or abs(wa - wb) >= ATTENTION_GAP:
            return (
                f"attention: from step {step}, layer {layer} looks most at #{pa} ({wa:.0%}) in A, #{pb} ({wb:.0%}) in B"
            )
    return None


def _compare_layers(layers_a: list[dict], layers_b: list[dict], notes: _LayerNotes) -> tuple[str, str] | None:
    if len(layers_a) != len(layers_b):
        return "layers", f"A has {len(layers_a)} cache layers, B has {len(layers_b)}"
    for la, lb in zip(layers_a, layers_b):
        index = la.get("index")
        kind_a, kind_b = la.get("kind"), lb.get("kind")
        notes.see(index, la, lb)
        if kind_a == kind_b:
            if la.get("filled") != lb.get("filled"):
                return "layers", (
                    f"layer {index} ({kind_a}) holds {la.get('filled')} filled slots in A, {lb.get('filled')} in B"
                )
        else:
            # Different kinds hold a different number of slots by design (a dynamic sliding layer keeps
            # window-1, a static one the window): what must agree is how many tokens each was fed.
            seen_a, seen_b = la.get("seen", la.get("filled")), lb.get("seen", lb.get("filled"))
            if seen_a != seen_b:
                return "layers", (f"layer {index} was fed {seen_a} tokens in A ({kind_a}), {seen_b} in B ({kind_b})")
    return None


def _compare_topk(top_a: list[dict], top_b: list[dict], tol: float, pieces: dict[int, str]) -> str | None:
    """None when the id orders agree up to adjacent swaps of near-ties, else what differs."""
    n = min(len(top_a), len(top_b))
    ids_a = [t.get("id") for t in top_a]
    ids_b = [t.get("id") for t in top_b]
    if ids_a[:n] == ids_b[:n]:
        return None
    logits_a = {t.get("id"): t["logit"] for t in top_a if t.get("logit") is not None}
    logits_b = {t.get("id"): t["logit"] for t in top_b if t.get("logit") is not None}

    def tied(x: int | None, y: int | None) -> bool:  # an id (None: a record without one)
        for logits in (logits_a, logits_b):
            if x in logits and y in logits and abs(logits[x] - logits[y]) <= tol:
                return True
        # the two sides of the list's cut-off: each token is known in one trace only
        if x in logits_a and y in logits_b and x not in logits_b and y not in logits_a:
            return abs(logits_a[x] - logits_b[y]) <= tol
        return False

    work = list(ids_a)  # A's order, rewritten into B's by swaps of tied neighbours
    for rank in range(n):
        want = ids_b[rank]
        if work[rank] == want:
            continue
        if want in work[rank + 1 :]:
            at = work.index(want, rank + 1)
            while at > rank:  # bubble `want` up, one adjacent swap at a time
                if not tied(work[at - 1], want):
                    return _topk_detail(rank, ids_a, ids_b, logits_a, logits_b, pieces, tol, blocker=work[at - 1])
                work[at - 1], work[at] = work[at], work[at - 1]
                at -= 1
        elif tied(work[rank], want):  # B ranks a token A's list cut off, tied with A's own
            work[rank] = want
        else:
            return _topk_detail(rank, ids_a, ids_b, logits_a, logits_b, pieces, tol)
    return None


def _topk_detail(rank, ids_a, ids_b, logits_a, logits_b, pieces, tol, blocker=None) -> str:
    a, b = ids_a[rank], ids_b[rank]
    text = (
        f"top-k order differs at rank {rank + 1}: A has {_piece(a, pieces)} (logit {_fmt(logits_a.get(a))}), "
        f"B has {_piece(b, pieces)} (logit {_fmt(logits_b.get(b))})"
    )
    x, y = (blocker, b) if blocker is not None else (a, b)
    gaps = [abs(lg[x] - lg[y]) for lg in (logits_a, logits_b) if x in lg and y in lg]
    if gaps:
        text += (
            f"; {_piece(x, pieces)} and {_piece(y, pieces)} are "
            f"{min(gaps):.3g} apart, more than the tie tolerance {tol:g}"
        )
    else:
        text += f"; no trace ranks both, so it is not a near-tie (tolerance {tol:g})"
    return text


# ---- details -----------------------------------------------------------------------------------


def _sequence_detail(what: str, a: list, b: list, pieces: dict[int, str] | None) -> str:
    at = first_difference(a, b)
    assert at is not None  # callers compare lists that differ
    show = (lambda v: _piece(v, pieces)) if pieces is not None else str
    text = f"{what}: {len(a)} in A, {len(b)} in B; first difference at index {at}: "
    text += f"A {show(a[at]) if at < len(a) else '(ends)'}, B {show(b[at]) if at < len(b) else '(ends)'}"
    return text


def _token(token_id, step: dict, pieces) -> str:
    """The chosen token with its raw logit, the kind the top-k lists show."""
    if token_id is None:
        return "nothing"
    logit = raw_logit(step, token_id)
    return _piece(token_id, pieces) + (f" (raw logit {_fmt(logit)})" if logit is not None else "")


def _forced(record) -> str:
    return " (forced)" if (record or {}).get("forced") else ""


def _piece(token_id, pieces: dict[int, str]) -> str:
    text = pieces.get(token_id)
    return f"{text!r} (id {token_id})" if text is not None else f"id {token_id}"


def _fmt(value) -> str:
    return "?" if value is None else f"{value:.6g}"


def first_difference(a: list, b: list) -> int | None:
    """Index of the first differing item (the shorter length when one is a prefix), None if equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def token_pieces(trace: Trace) -> dict[int, str]:
    """id -> text, from the buffers and the top-k lists (step records carry ids only), and their bytes."""
    out: dict[int, str] = {}
    for buffer in trace.buffers:
        for token in buffer.get("tokens", []):
            if "id" in token and "piece" in token:
                out.setdefault(token["id"], token["piece"])
    for step in trace.steps:
        for key in ("topk", "topk_processed"):
            for token in step.get(key) or []:
                out.setdefault(token.get("id"), token.get("text"))
        chosen = step.get("chosen")
        if chosen and "text" in chosen:
            out.setdefault(chosen.get("id"), chosen["text"])
    # a piece of a split character is named by its bytes (`⟨e4 bd⟩`), not by the U+FFFD its piece decodes to
    exact: dict[int, bytes] = {}
    for record in (*trace.buffers, *trace.steps):
        learn_bytes(record.get("bytes"), exact)
    out.update({i: data.decode() if valid_utf8(data) else hex_bytes(data) for i, data in exact.items()})
    return out


def _logit_gap(sa: dict, sb: dict) -> float | None:
    """max |logit_A - logit_B| over the tokens in both raw top-k lists."""
    la = {t["id"]: t["logit"] for t in sa.get("topk") or [] if t.get("logit") is not None}
    lb = {t["id"]: t["logit"] for t in sb.get("topk") or [] if t.get("logit") is not None}
    common = la.keys() & lb.keys()
    return max((abs(la[i] - lb[i]) for i in common), default=None)


def raw_logit(step: dict, token_id) -> float | None:
    """A token's raw logit (before the sampler's processors) at `step`: from its raw top-k, None when the
    list does not hold it. (The step's `chosen` carries the processed logit.)"""
    return next((t.get("logit") for t in step.get("topk") or [] if t.get("id") == token_id), None)


def _chosen_logits(sa: dict, sb: dict) -> tuple[float | None, float | None]:
    return tuple(raw_logit(s, (s.get("chosen") or {}).get("id")) for s in (sa, sb))  # type: ignore[return-value]


def _chosen_processed(sa: dict, sb: dict) -> tuple[float | None, float | None]:
    return (sa.get("chosen") or {}).get("logit"), (sb.get("chosen") or {}).get("logit")


# ---- notes -------------------------------------------------------------------------------------


def _header_notes(ha: dict, hb: dict) -> list[str]:
    notes = []
    for key in HEADER_NOTES:
        if key in ha or key in hb:
            va, vb = ha.get(key), hb.get(key)
            if va != vb:
                notes.append(f"header {key}: A {va!r}, B {vb!r}")
    return notes


class _LayerNotes:
    """Per-layer differences of cache kind, capacity and allocated slots: grouped, reported once."""

    def __init__(self):
        self.kinds: dict[tuple, list[int]] = {}
        self.capacities: dict[tuple, list[int]] = {}
        self.slots: dict[tuple, list[int]] = {}
        self.filled: dict[tuple, list[int]] = {}

    def see(self, index, la: dict, lb: dict) -> None:
        kinds = (la.get("kind"), lb.get("kind"))
        if kinds[0] != kinds[1]:
            _add(self.kinds, kinds, index)
            if la.get("filled") != lb.get("filled"):
                _add(self.filled, kinds, index)
        caps = (la.get("capacity"), lb.get("capacity"))
        if caps[0] != caps[1]:
            _add(self.capacities, caps, index)
        sa, sb = _slots(la), _slots(lb)
        if sa != sb and (kinds[0] != kinds[1] or str(kinds[0]).startswith("static")):
            _add(self.slots, kinds, index)

    def render(self) -> list[str]:
        out = []
        for (ka, kb), layers in self.kinds.items():
            out.append(f"cache layer kind differs: {ka} in A, {kb} in B ({_layers(layers)}); not a divergence")
        for (ca, cb), layers in self.capacities.items():
            out.append(f"layer capacity differs: {_cap(ca)} in A, {_cap(cb)} in B ({_layers(layers)})")
        for (ka, kb), layers in self.slots.items():
            out.append(
                f"allocated K/V slots differ ({ka} in A, {kb} in B; {_layers(layers)}): "
                f"a static cache preallocates its capacity"
            )
        for (ka, kb), layers in self.filled.items():
            out.append(
                f"held slots differ by design ({ka} in A, {kb} in B; {_layers(layers)}): compared by tokens fed instead"
            )
        return out


def _add(groups: dict, key, index) -> None:
    layers = groups.setdefault(key, [])
    if index not in layers:
        layers.append(index)


def _slots(layer: dict):
    shape = layer.get("k_shape") or []
    return shape[-2] if len(shape) >= 2 else None


def _cap(value) -> str:
    return "unbounded" if value is None else str(value)


def _layers(indices: list) -> str:
    indices = sorted(i for i in indices if i is not None)
    if not indices:
        return "layers ?"
    if len(indices) > 1 and indices == list(range(indices[0], indices[-1] + 1)):
        return f"layers {indices[0]}-{indices[-1]}"
    return ("layer " if len(indices) == 1 else "layers ") + ", ".join(map(str, indices))


def _events(trace: Trace) -> list[dict]:
    return [
        {k: v for k, v in e.items() if k not in EVENT_IGNORED} for e in trace.events if e.get("type") in EVENT_KINDS
    ]


def _compare_events(a: Trace, b: Trace) -> tuple[int, str, str] | None:
    """The first recorded event (verify, refusal, rewind, force, ...) that differs: (step, field, detail)."""
    ea, eb = _events(a), _events(b)
    for x, y in zip(ea, eb):
        if x == y or (
            x.get("type") == y.get("type") == "verify" and x.get("ok") == y.get("ok") and x.get("step") == y.get("step")
        ):
            continue
        step = x.get("step") or y.get("step") or 0
        if x.get("type") == y.get("type") == "verify":
            failed, ok = (x, "B") if not x.get("ok") else (y, "A")
            bad = "A" if ok == "B" else "B"
            return (
                step,
                "verify",
                (
                    f"verify at step {step}: ok in {ok}, failed in {bad} (max |diff| "
                    f"{_fmt(failed.get('max_abs_diff'))} > {_fmt(failed.get('tolerance'))})"
                ),
            )
        return step, "events", f"at step {step}: A recorded {describe_event(x)}, B recorded {describe_event(y)}"
    if len(ea) != len(eb):
        extra, name = (ea[len(eb)], "A") if len(ea) > len(eb) else (eb[len(ea)], "B")
        step = extra.get("step") or 0
        if extra.get("type") == "verify" and not extra.get("ok"):
            return step, "verify", f"verify at step {step} failed in {name} only"
        return step, "events", f"only {name} recorded {describe_event(extra)} (at step {step})"
    return None


def _verify_notes(trace: Trace, name: str) -> list[str]:
    failed = [e for e in trace.events if e.get("type") == "verify" and e.get("ok") is False]
    if not failed:
        return []
    steps = ", ".join(str(e.get("step")) for e in failed[:5]) + (" …" if len(failed) > 5 else "")
    return [f"trace {name} recorded {len(failed)} failed verify(s) (steps {steps})"]
