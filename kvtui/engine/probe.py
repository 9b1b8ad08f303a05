"""Watch someone else's generation loop: hooks on a causal LM's top-level forward turn every call
into the same `StepSnapshot` and trace step line that kvtui's own session emits.

What a watched forward records, without changing it:
- the fed ids per batch row, pads (attention mask 0) marked;
- the positions the model *applied*: the input of its rotary / position-embedding module (exact,
  whatever this transformers version does with position_ids, cache_position or the cache length),
  next to what the caller *asked for* (position_ids, cache_position);
- the cache object's identity, its length before and after, per-layer infos via `introspect`
  (shapes and counters: O(layers), no K/V copies);
- top-k from the logits the forward already returned (no extra forward).

Between two forwards the cache is checked against a per-layer fingerprint (shapes, counters, storage
and two sampled slots, reduced on the device to scalars), and the cache's own edit methods (crop,
reset, reorder...) are wrapped on the instance, so an edit outside a forward is named (`cache-edited`).
Every alarm names the line of the user's code that made the call. Detaching removes every hook and
wrapper: a model that is not watched runs exactly as before.

Shapes: input_ids / position_ids [batch, n]; attention_mask [batch, cached + n] (2-D; other forms
are not read); logits [batch, n or 1, vocab].
"""

from __future__ import annotations

import inspect
import os
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable

import torch

from . import introspect
from .diagnostics import Alarms
from .sampling import top_tokens, watched_tokens
from .session import VERIFY_TOLERANCE, find_sub
from .snapshot import BufferToken, Diagnostic, RowView, StepSnapshot, TokenBuffer

TOP_K = 10
_EDIT_METHODS = ("crop", "reset", "reorder_cache", "batch_select_indices", "batch_repeat_interleave")
_LIBRARY_DIRS = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (torch,)) + (
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,)  # torch/, kvtui/


def _library_dirs() -> tuple[str, ...]:
    import transformers

    extra = [os.path.dirname(os.path.abspath(transformers.__file__)) + os.sep, os.path.dirname(inspect.__file__) + os.sep]
    return _LIBRARY_DIRS + tuple(extra)


def caller_line(skip: tuple[str, ...] | None = None) -> str:
    """"file.py:42": the innermost frame that belongs to the user's code, not to torch/transformers/kvtui."""
    skip = skip or _library_dirs()
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(skip) and not name.startswith("<frozen"):
            return f"{_short_path(name)}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


def _short_path(path: str) -> str:
    try:
        relative = os.path.relpath(path)
    except ValueError:
        return path
    return relative if not relative.startswith("..") else path


def _inside_transformers(skip_kvtui: str) -> bool:
    """Whether the code that called a wrapped cache method is transformers itself (generate's beam search)."""
    import transformers

    root = os.path.dirname(os.path.abspath(transformers.__file__)) + os.sep
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(skip_kvtui):
        frame = frame.f_back
    return frame is not None and frame.f_code.co_filename.startswith(root)


class Gate:
    """Where a front end may hold the program: before each watched forward, after each step."""

    def before_forward(self, watcher: "Watcher") -> None:
        pass

    def after_step(self, watcher: "Watcher", snapshot: StepSnapshot) -> None:
        pass


@dataclass
class _Call:
    """One top-level forward in flight (between the pre- and the post-hook)."""

    probe: "_Probe"
    caller: str
    input_ids: list[list[int]] | None  # [batch][n]; None when only inputs_embeds were passed
    n: int
    batch: int
    mask_new: list[list[int]] | None  # [batch][n] attention mask of the fed tokens
    real_before: list[int] | None  # [batch] attended tokens already cached (None: no 2-D mask)
    requested_positions: list[list[int]] | None
    requested_cache_position: list[int] | None
    cache: object | None
    cache_length_before: int
    found: list[Diagnostic] = field(default_factory=list)
    applied: torch.Tensor | None = None  # position ids read at the rotary / position embedding
    positions_source: str = "derived"
    started: float = 0.0  # perf_counter when the forward began (after any pause)


@dataclass
class _CacheTrack:
    """What kvtui knows about one cache object: its name and the tokens of each row, in order."""

    name: str
    ref: weakref.ref
    rows: list[list[BufferToken]]
    fingerprint: tuple = ()
    wrapped: bool = False


class _State(threading.local):
    def __init__(self):
        self.stack: list[_Call | None] = []

    @property
    def current(self) -> _Call | None:
        return self.stack[-1] if self.stack else None


_STATE = _State()


class _Probe:
    """The hooks on one model."""

    def __init__(self, watcher: "Watcher", model, index: int):
        self.watcher, self.model, self.index = watcher, model, index
        self.name = getattr(model, "name_or_path", None) or type(model).__name__
        self.window = introspect.config_window(model.config)
        self.accepts_cache_position = introspect.forward_accepts(model, "cache_position")
        self.signature = inspect.signature(type(model).forward)
        self.handles = [
            model.register_forward_pre_hook(self._pre, with_kwargs=True),
            model.register_forward_hook(self._post, with_kwargs=True, always_call=True),
        ]
        for module, source in _position_modules(model):
            self.handles.append(module.register_forward_pre_hook(self._position_hook(source), with_kwargs=True))

    def detach(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def _pre(self, module, args, kwargs):
        if _STATE.stack:  # a nested call (a model inside a watched forward): the outer one is the step
            _STATE.stack.append(None)
            return None
        try:
            call = self.watcher._begin(self, args, kwargs)
        except Exception as exc:  # never break the user's program
            self.watcher._internal_error("before a forward", exc)
            call = None
        _STATE.stack.append(call)
        if call is not None:
            self.watcher.gate.before_forward(self.watcher)
            call.started = time.perf_counter()
        return None

    def _post(self, module, args, kwargs, output):
        call = _STATE.stack.pop() if _STATE.stack else None
        if call is None:
            return None
        try:
            self.watcher._finish(call, output)
        except Exception as exc:
            self.watcher._internal_error("after a forward", exc)
        return None

    def _position_hook(self, source: str):
        def hook(module, args, kwargs):
            call = _STATE.current
            if call is None or call.probe is not self or call.applied is not None:
                return None
            if source == "rotary":
                positions = kwargs.get("position_ids", args[1] if len(args) > 1 else None)
            else:
                positions = args[0] if args else kwargs.get("input")
            if isinstance(positions, torch.Tensor) and positions.dtype in (torch.long, torch.int, torch.int32):
                call.applied, call.positions_source = positions, source
            return None

        return hook


def _position_modules(model) -> list[tuple[torch.nn.Module, str]]:
    """The modules whose input is the position ids the model applies: rotary embeddings, else a learned
    position table (GPT-2's `wpe`). Only the first call per forward is read."""
    found = [(m, "rotary") for m in model.modules() if "RotaryEmbedding" in type(m).__name__]
    if found:
        return found
    for name, module in model.named_modules():
        if type(module) is torch.nn.Embedding and name.rsplit(".", 1)[-1] in ("wpe", "embed_positions", "position_embeddings"):
            return [(module, "embedding")]
    return []


class Watcher:
    """Watches models, keeps per-cache token buffers, raises alarms and emits snapshots.

    `on_snapshot(snapshot)` and `on_event(record)` receive everything; `trace` (a path) writes the
    same records as kvtui's own session (schema 1, with the watch fields)."""

    def __init__(self, tokenizer=None, trace=None, top_k: int = TOP_K, gate: Gate | None = None,
                 on_snapshot: Callable[[StepSnapshot], None] | None = None,
                 on_event: Callable[[dict], None] | None = None, program: list[str] | None = None):
        self.tokenizer = tokenizer
        self.top_k = top_k
        self.gate = gate or Gate()
        self.on_snapshot, self.on_event = on_snapshot, on_event
        self.program = program
        self.trace_path = trace
        self._writer = None
        self.probes: list[_Probe] = []
        self.steps = 0
        self.turn = 0
        self.diagnostics: list[Diagnostic] = []
        self.last: StepSnapshot | None = None
        self.watch_ids: tuple[int, ...] = ()
        self._tracks: dict[int, _CacheTrack] = {}
        self._cache_counter = 0
        self._alarms: dict[str, Alarms] = {}
        self._pieces: dict[int, str] = {}
        self._encodings: list[tuple[tuple[int, ...], frozenset[int]]] = []  # recent tokenizer outputs
        self._skip = None
        self._lock = threading.RLock()
        self._started = False  # the header is out (first forward)
        self._specials_key: tuple | None = None
        self._capacities: dict[int, tuple[weakref.ref, int | None]] = {}
        self._specials_value: tuple = ()
        self._waiting: list[dict] = []  # records raised before it
        self.errors: list[str] = []

    # ---- attaching -------------------------------------------------------------------------------

    def attach(self, model) -> "Watcher":
        if any(p.model is model for p in self.probes):
            return self
        probe = _Probe(self, model, len(self.probes))
        self.probes.append(probe)
        if self.tokenizer is None:
            self.tokenizer = _TOKENIZERS.find(model)
        if self.tokenizer is not None:
            _TOKENIZERS.watch(self.tokenizer, self)
        self._event({"type": "model", "index": probe.index, "name": probe.name, "class": type(model).__name__,
                     "layers": getattr(model.config, "num_hidden_layers", None)})
        return self

    def detach(self) -> None:
        for probe in self.probes:
            probe.detach()
        for track in self._tracks.values():
            cache = track.ref()
            if cache is not None and track.wrapped:
                for name in _EDIT_METHODS:
                    cache.__dict__.pop(name, None)
        _TOKENIZERS.unwatch(self)
        self.probes = []
        if self._writer is not None:
            self._writer.close()

    def __enter__(self) -> "Watcher":
        return self

    def __exit__(self, *exc) -> None:
        self.detach()

    def set_tokenizer(self, tokenizer) -> None:
        if self.tokenizer is None and tokenizer is not None:
            self.tokenizer = tokenizer
            _TOKENIZERS.watch(tokenizer, self)

    # ---- records ---------------------------------------------------------------------------------

    def _event(self, record: dict) -> None:
        """Every non-step record, to the trace and to on_event. The header goes first, at the first
        forward (when the model's weights, device and dtype are final): what comes before it waits."""
        if not self._started and record["type"] != "header":
            self._waiting.append(record)
            return
        if self._writer is not None:
            self._writer.write(record)
        if self.on_event is not None:
            self.on_event(record)

    def _start(self, probe: _Probe) -> None:
        from .trace import TraceWriter

        header = self.header(probe)
        if self.trace_path is not None:
            self._writer = TraceWriter(self.trace_path, header)
        self._started = True
        if self.on_event is not None:
            self.on_event(header)
        waiting, self._waiting = self._waiting, []
        for record in waiting:
            self._event(record)

    def header(self, probe: _Probe | None = None) -> dict:
        from .trace import header_start

        probe = probe or (self.probes[0] if self.probes else None)
        model = probe.model if probe else None
        return {
            **header_start(),
            "model": probe.name if probe else "?", "model_path": probe.name if probe else "?",
            "model_class": type(model).__name__ if model is not None else "?",
            "layers": getattr(model.config, "num_hidden_layers", None) if model is not None else None,
            "dtype": str(model.dtype).removeprefix("torch.") if model is not None else "?",
            "device": str(model.device) if model is not None else "?",
            "cache": "program", "capacity": None, "mode": "watch", "source": "watch", "program": self.program,
        }

    def _internal_error(self, where: str, exc: BaseException) -> None:
        text = f"kvtui's probe failed {where}: {type(exc).__name__}: {exc}"
        self.errors.append(text)
        self._diagnose([Diagnostic("worker-error", "error", text, self.steps)])

    def _diagnose(self, found: list[Diagnostic]) -> None:
        """Alarms raised outside a step (cache edits, refusals): a record of their own."""
        for d in found:
            self.diagnostics.append(d)
            self._event({"type": "diagnostic", "step": d.step, "code": d.code, "severity": d.severity, "message": d.message})

    # ---- pieces ------------------------------------------------------------------------------------

    def piece(self, token_id: int) -> str:
        text = self._pieces.get(token_id)
        if text is None:
            if token_id < 0:
                return "<embeds>"
            try:
                text = self.tokenizer.decode([token_id], skip_special_tokens=False) if self.tokenizer else f"#{token_id}"
            except Exception:
                text = f"#{token_id}"
            self._pieces[token_id] = text
        return text

    def _specials(self):
        key = (id(self.tokenizer), len(self.probes))
        if self._specials_key != key:  # read once per tokenizer: the sets cost more than a forward's bookkeeping
            self._specials_key, self._specials_value = key, self._read_specials()
        return self._specials_value

    def _read_specials(self):
        tok = self.tokenizer
        if tok is None:
            return None, frozenset(), None, frozenset()
        eos = {tok.eos_token_id} if isinstance(tok.eos_token_id, int) else set()
        for probe in self.probes:
            gen = getattr(probe.model, "generation_config", None)
            value = getattr(gen, "eos_token_id", None)
            eos.update([value] if isinstance(value, int) else (value or []))
        special = set(getattr(tok, "all_special_ids", []) or [])
        for token_id, added in (getattr(tok, "added_tokens_decoder", None) or {}).items():
            if getattr(added, "special", False):
                special.add(int(token_id))
        return tok.bos_token_id, frozenset(eos), tok.pad_token_id, frozenset(special)

    # ---- the forward -----------------------------------------------------------------------------

    def _begin(self, probe: _Probe, args, kwargs) -> _Call:
        with self._lock:
            if self._skip is None:
                self._skip = _library_dirs()
            bound = probe.signature.bind_partial(probe.model, *args, **kwargs).arguments
            extra = bound.pop(next((n for n, p in probe.signature.parameters.items() if p.kind == p.VAR_KEYWORD), ""), {})
            values = {**bound, **extra}
            caller = caller_line(self._skip)
            input_ids = values.get("input_ids")
            embeds = values.get("inputs_embeds")
            if isinstance(input_ids, torch.Tensor):
                ids = input_ids if input_ids.dim() == 2 else input_ids.reshape(1, -1)  # [batch, n]
                batch, n = ids.shape
                id_rows = ids.tolist()
            elif isinstance(embeds, torch.Tensor):
                batch, n = embeds.shape[0], embeds.shape[1]
                id_rows = None
            else:
                batch, n, id_rows = 1, 0, None
            cache = introspect.cache_in(values)
            cache_len = introspect.seq_length(cache) if cache is not None else 0
            mask = values.get("attention_mask")
            mask_new = real_before = None
            if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[-1] >= n:
                mask_new = mask[:, mask.shape[-1] - n:].tolist()  # [batch, n]
                if mask.shape[-1] > n:
                    real_before = mask[:, : mask.shape[-1] - n].sum(-1).tolist()  # [batch]: one reduction
                else:
                    real_before = [cache_len] * batch
            requested = _rows(values.get("position_ids"), batch)
            cache_position = values.get("cache_position")
            cache_position = cache_position.reshape(-1).tolist() if isinstance(cache_position, torch.Tensor) else None
            call = _Call(probe=probe, caller=caller, input_ids=id_rows, n=n, batch=batch, mask_new=mask_new,
                         real_before=real_before, requested_positions=requested,
                         requested_cache_position=cache_position, cache=cache, cache_length_before=cache_len)
            if cache is not None:
                self._check_edits(call, cache)
            self._check_request(call, probe)
            return call

    def _check_request(self, call: _Call, probe: _Probe) -> None:
        """Alarms about what the caller asked for; each fires when it starts or changes, not every step."""
        step = self.steps + 1
        at = f" [{call.caller}]"
        alarms = self._alarms.setdefault("request", Alarms())
        ignored = call.requested_cache_position is not None and not probe.accepts_cache_position
        call.found += alarms.transition("ignored-argument", call.caller if ignored else None, lambda: Diagnostic(
            "ignored-argument", "warning",
                    f"cache_position={_span(call.requested_cache_position)} was passed but this transformers version "
                    f"ignores it (models take no cache_position since 5.4): the model wrote at the cache's own length "
                    f"{call.cache_length_before} and took positions from position_ids or that length" + at, step))
        first = call.requested_cache_position[0] if call.requested_cache_position else call.cache_length_before
        offset = first - call.cache_length_before
        call.found += alarms.transition("cursor-mismatch", str(offset) if offset else None, lambda: Diagnostic(
            "cursor-mismatch", "error",
            f"the caller's cache_position starts at {first} but the cache holds {call.cache_length_before} "
            f"tokens (off by {offset:+d}): its own cursor disagrees with the cache" + at, step))
        capacity = self._capacity(call.cache) if call.cache is not None else None
        if capacity is not None and call.cache_length_before + call.n > capacity:
            call.found.append(Diagnostic(
                "static-capacity", "error",
                f"this forward writes {call.n} tokens into a static cache holding {call.cache_length_before} of "
                f"{capacity}: {call.cache_length_before + call.n - capacity} too many (index_copy_ IndexError follows)"
                + at, step))

    def _finish(self, call: _Call, output) -> None:
        with self._lock:
            if output is None:  # the forward raised: what it would have been is still worth an alarm
                self._diagnose([d for d in call.found] or [Diagnostic(
                    "worker-error", "error", f"the forward raised (see the program's traceback) [{call.caller}]",
                    self.steps + 1)])
                return
            forward_ms = (time.perf_counter() - call.started) * 1000
            snap_started = time.perf_counter()
            cache = introspect.output_cache(output)
            cache = call.cache if cache is None else cache
            logits = getattr(output, "logits", None)
            if logits is None and isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
                logits = output[0]
            if not self._started:
                self._start(call.probe)
            self.steps += 1
            step = self.steps
            if call.n > 1:
                self.turn += 1
            track = self._track(cache) if cache is not None else None
            snapshot = self._snapshot(call, step, cache, track, logits, forward_ms, snap_started)
            self.last = snapshot
            self._last_call = call
            if logits is not None and logits.dim() == 3:
                self._last_logits = logits[0, -1].detach().float().clone()  # [vocab], for verify
            self.diagnostics.extend(snapshot.diagnostics)
            if self._writer is not None:
                self._writer.write(snapshot.to_record())
            if self.on_snapshot is not None:
                self.on_snapshot(snapshot)
        self.gate.after_step(self, snapshot)

    def _snapshot(self, call: _Call, step: int, cache, track: _CacheTrack | None, logits, forward_ms: float,
                  snap_started: float) -> StepSnapshot:
        probe = call.probe
        bos, eos, pad, special = self._specials()
        applied = self._applied(call)  # [batch][n]
        cache_len = introspect.seq_length(cache) if cache is not None else 0
        found = list(call.found)
        rows = track.rows if track is not None else [[] for _ in range(call.batch)]
        if len(rows) != call.batch:  # a cache now used with another batch size: buffers cannot line up
            rows[:] = [list(r) for r in (rows + [[]] * call.batch)[:call.batch]]
        added = self._tokenizer_added(call)
        views = []
        for row in range(call.batch):
            ids = call.input_ids[row] if call.input_ids is not None else [-1] * call.n
            mask = call.mask_new[row] if call.mask_new is not None else [1] * call.n
            before = rows[row][-1] if rows[row] else None
            fed = [BufferToken(position=applied[row][i], id=ids[i], piece=self.piece(ids[i]),
                               special=ids[i] in special, turn=self.turn,
                               origin="pad" if not mask[i] else "tokenizer-added" if (row == 0 and i in added) else "fed")
                   for i in range(call.n)]
            right_pads = call.n - 1 - max((i for i, m in enumerate(mask) if m), default=call.n - 1)
            if call.n > 1 and right_pads and not any(d.code == "padding-side" for d in found):
                found.append(Diagnostic(
                    "padding-side", "warning",
                    f"row {row} ends with {right_pads} pad(s): its next token is predicted from padding "
                    f"(decoder-only models need padding_side='left') [{call.caller}]", step))
            if row == 0:  # alarms read row 0; a program's rows share its code path
                found += self._check_feed(call, step, fed, before, bos, eos, pad)
                found += self._check_drift(call, step, rows[0], ids)
            rows[row].extend(fed)
            views.append((ids, fed))
        found += self._check_positions(call, step, applied)
        layers = introspect.layer_infos(cache, probe.window) if cache is not None and hasattr(cache, "layers") else ()
        capacity = self._capacity(cache) if cache is not None and hasattr(cache, "layers") else None
        alarms = self._alarms.setdefault(track.name if track else "-", Alarms())
        found += [_at(d, call.caller) for d in alarms.check_layers(step, layers, capacity, cache_len, reserve=1)]
        if track is not None:
            track.fingerprint = introspect.fingerprint(cache)
        top_rows = self._top(logits, call.batch)
        buffers = [TokenBuffer(r) for r in rows]
        row_views = tuple(RowView(row=r, input_ids=tuple(views[r][0]), positions=tuple(applied[r]),
                                  topk=top_rows[r], buffer=buffers[r]) for r in range(call.batch)) if call.batch > 1 else None
        requested = call.requested_positions[0] if call.requested_positions else None
        cursor = (call.requested_cache_position[-1] + 1 if call.requested_cache_position
                  else requested[-1] + 1 if requested and call.mask_new is None else cache_len)
        watched = ()
        if self.watch_ids and logits is not None:
            watched = watched_tokens(logits[0, -1].float(), self.watch_ids, self.piece)
        return StepSnapshot(
            step=step, phase="prefill" if call.n > 1 else "decode", turn=self.turn,
            input_ids=tuple(views[0][0]) if views else (), positions=tuple(applied[0]) if applied else (),
            cursor=cursor, cache_seq_length=cache_len, capacity=capacity, layers=layers,
            topk=top_rows[0] if top_rows else (), topk_processed=top_rows[0] if top_rows else (), watched=watched,
            chosen=None, chosen_forced=False, diagnostics=tuple(found), forward_ms=forward_ms,
            snapshot_ms=(time.perf_counter() - snap_started) * 1000,
            buffer=buffers[0] if buffers else TokenBuffer([]), source="watch", caller=call.caller,
            cache_id=track.name if track else None, cache_length_before=call.cache_length_before,
            requested_positions=tuple(requested) if requested is not None else None,
            requested_cache_position=tuple(call.requested_cache_position) if call.requested_cache_position else None,
            positions_source=call.positions_source, batch=call.batch, rows=row_views)

    def _applied(self, call: _Call) -> list[list[int]]:
        """The positions the model used, [batch][n]: read at its position module, else what it derives."""
        if call.applied is not None:
            positions = call.applied
            if positions.dim() == 3:  # multimodal RoPE: [3, batch, n], the text axis first
                positions = positions[0]
            positions = positions.reshape(-1, positions.shape[-1])[:, -call.n:] if call.n else positions
            rows = positions.tolist()
            return rows if len(rows) == call.batch else [rows[0]] * call.batch
        if call.requested_positions is not None:
            return call.requested_positions
        start = call.cache_length_before  # 5.4+: no position_ids -> arange from the cache length
        return [list(range(start, start + call.n))] * call.batch

    def _top(self, logits, batch: int) -> list[tuple]:
        if logits is None or logits.dim() != 3:
            return [()] * batch
        last = logits[:, -1].float()  # [batch, vocab]
        return [top_tokens(last[row], self.top_k, self.piece) for row in range(min(batch, last.shape[0]))] + \
            [()] * max(0, batch - last.shape[0])

    # ---- verify ----------------------------------------------------------------------------------

    def verify(self) -> dict:
        """Compare the last forward's logits (row 0) with one no-cache forward over what its cache row
        holds (attended tokens, positions 0..n-1). Runs in the program's thread, between two forwards."""
        snapshot, logits = self.last, getattr(self, "_last_logits", None)
        if snapshot is None or logits is None:
            raise ValueError("nothing to verify yet: the program has not run a forward")
        tokens = [t.id for t in snapshot.buffer if t.origin != "pad" and t.id >= 0]
        model = self._last_call.probe.model
        device = model.get_input_embeddings().weight.device
        ids = torch.tensor([tokens], device=device)  # [1, n]
        with torch.inference_mode():
            fresh = model(input_ids=ids, use_cache=False,
                          position_ids=torch.arange(len(tokens), device=device).unsqueeze(0)).logits[0, -1].float()
        diff = float((fresh - logits.to(fresh.device)).abs().max())
        tolerance = VERIFY_TOLERANCE.get(str(model.dtype).removeprefix("torch."), 1e-3)
        k = self.top_k
        cached_top, fresh_top = torch.topk(logits, k).indices.tolist(), torch.topk(fresh, k).indices.tolist()
        ok = diff <= tolerance and cached_top[:3] == fresh_top[:3]
        if not ok:
            self._diagnose([Diagnostic(
                "cache-mismatch", "error",
                f"the program's cached logits differ from a full recompute of {len(tokens)} tokens: max |diff| "
                f"{diff:.3g} > {tolerance:g}", self.steps)])
        return {"max_abs_diff": diff, "tolerance": tolerance, "topk_agree": cached_top[:3] == fresh_top[:3],
                "cached_top": cached_top, "recomputed_top": fresh_top, "tokens": len(tokens), "ok": ok}

    # ---- checks ----------------------------------------------------------------------------------

    def _check_feed(self, call, step, fed, before, bos, eos, pad) -> list[Diagnostic]:
        found, at = [], f" [{call.caller}]"
        attended = [t for t in fed if t.origin != "pad"]
        # a BOS the tokenizer adds is what the model expects: only other insertions are news (double BOS has its own alarm)
        added = [t for t in attended if t.origin == "tokenizer-added" and t.id != bos]
        if added:
            names = ", ".join(f"{t.piece!r} (id {t.id}) at position {t.position}" for t in added)
            found.append(Diagnostic("tokenizer-added-special", "warning",
                                    f"the tokenizer inserted {names} that the text did not contain" + at, step))
        previous = before if before is None or before.origin != "pad" else None
        pads = [t for t in attended if pad is not None and t.id == pad]
        # a pad id that doubles as EOS/BOS is a pad only in a run: chats hold single <|im_end|>s
        pad_run = bool(pads) and (pad not in eos and pad != bos or _longest_run(attended, pad) >= 2)
        for token in attended:
            if bos is not None and token.id == bos and previous is not None and previous.id == bos:
                found.append(Diagnostic("double-bos", "warning",
                                        f"BOS {token.piece!r} at position {token.position} follows another BOS" + at, step))
            previous = token
        if pads and pad_run:
            found.append(Diagnostic(
                "pad-in-cache", "warning",
                f"{len(pads)} pad token(s) {pads[0].piece!r} (id {pad}) written to the cache with attention from position "
                f"{pads[0].position}: later tokens attend to them (mask them or do not feed them)" + at, step))
        eos_fed = [t for t in attended if t.id in eos and (t.origin == "tokenizer-added" or (call.n > 1 and t is attended[-1]))]
        if eos_fed and not (pads and pad in eos):
            t = eos_fed[0]
            found.append(Diagnostic(
                "eos-in-context", "warning",
                f"end token {t.piece!r} (id {t.id}, {'added by the tokenizer' if t.origin == 'tokenizer-added' else 'last of the prompt'}) "
                f"enters the context at position {t.position}: the model reads it as 'the text ended'" + at, step))
        return found

    def _check_positions(self, call: _Call, step: int, applied: list[list[int]]) -> list[Diagnostic]:
        """Applied positions must continue what each row has attended to so far (left pads excluded)."""
        alarms = self._alarms.setdefault("positions", Alarms())
        key, message = None, ""
        for row in range(call.batch):
            mask = call.mask_new[row] if call.mask_new is not None else [1] * call.n
            real = call.real_before[row] if call.real_before is not None else call.cache_length_before
            for i in range(call.n):
                if not mask[i]:
                    continue
                if applied[row][i] != real:
                    key = f"{applied[row][i] - real:+d}"
                    message = (f"row {row} token {i} was applied at position {applied[row][i]} but {real} attended "
                               f"tokens precede it (offset {applied[row][i] - real:+d}): RoPE sees the wrong distances")
                    break
                real += 1
            if key:
                break
        return alarms.transition("position-gap", key, lambda: Diagnostic(
            "position-gap", "error", f"{message} [{call.caller}]", step))

    def _check_drift(self, call: _Call, step: int, row: list[BufferToken], ids: list[int]) -> list[Diagnostic]:
        """The program fed the tail of a chat rendering: its head must equal what the cache holds."""
        if call.n < 2 or not row:
            return []
        for encoding, _ in reversed(self._encodings):
            start = len(encoding) - call.n
            if start <= 0 or list(encoding[start:]) != ids:
                continue
            cached = [t.id for t in row[-start:]] if len(row) >= start else [t.id for t in row]
            if cached == list(encoding[:start]):
                return []
            index = next((i for i, (a, b) in enumerate(zip(cached, encoding[:start])) if a != b), min(len(cached), start))
            have = self.piece(cached[index]) if index < len(cached) else "nothing"
            want = self.piece(encoding[index]) if index < start else "nothing"
            return [Diagnostic(
                "template-drift", "warning",
                f"the program fed tokens {start}.. of a rendering whose first {start} tokens differ from the cache at "
                f"index {index} (cache has {have!r}, the rendering {want!r}): the cached prefix is stale [{call.caller}]",
                step)]
        return []

    def _tokenizer_added(self, call: _Call) -> set[int]:
        """Indices of fed tokens (row 0) that a seen tokenizer call added (BOS/EOS the text did not contain)."""
        if call.input_ids is None or not self._encodings:
            return set()
        ids = tuple(call.input_ids[0])
        for encoding, added in reversed(self._encodings):
            if added and len(encoding) >= len(ids) and encoding[len(encoding) - len(ids):] == ids:
                offset = len(encoding) - len(ids)
                return {i - offset for i in added if i >= offset}
        return set()

    # ---- caches ----------------------------------------------------------------------------------

    def _capacity(self, cache) -> int | None:
        """A static cache's capacity, read once per cache object (it never changes)."""
        key = id(cache)
        if key not in self._capacities or self._capacities[key][0]() is not cache:
            if len(self._capacities) > 64:  # forget caches that are gone
                self._capacities = {k: v for k, v in self._capacities.items() if v[0]() is not None}
            self._capacities[key] = (weakref.ref(cache), introspect.static_capacity(cache))
        return self._capacities[key][1]

    def _track(self, cache) -> _CacheTrack:
        track = self._tracks.get(id(cache))
        if track is None or track.ref() is not cache:
            self._cache_counter += 1
            track = _CacheTrack(name=f"{type(cache).__name__}#{self._cache_counter}", ref=weakref.ref(cache), rows=[[]])
            self._tracks = {k: t for k, t in self._tracks.items() if t.ref() is not None}
            self._tracks[id(cache)] = track
            self._wrap_edits(cache, track)
        return track

    def _check_edits(self, call: _Call, cache) -> None:
        """Compare the cache with its fingerprint after the last forward: a change means an edit outside one."""
        track = self._tracks.get(id(cache))
        if track is None or track.ref() is not cache or not track.fingerprint:
            return
        now = introspect.fingerprint(cache)
        change = introspect.describe_change(track.fingerprint, now)
        if change is None:
            return
        track.fingerprint = now
        self._sync_rows(track, call.cache_length_before)
        call.found.append(Diagnostic(
            "cache-edited", "warning",
            f"{track.name} changed since the last forward without a forward: {change} (noticed at [{call.caller}])",
            self.steps + 1))

    def _sync_rows(self, track: _CacheTrack, length: int) -> None:
        for i, row in enumerate(track.rows):
            if len(row) > length:
                track.rows[i] = row[:length]  # a new list: views handed out earlier stay valid

    def _wrap_edits(self, cache, track: _CacheTrack) -> None:
        """Wrap the cache's own edit methods on this instance, to name the call that changed it."""
        watcher = self
        kvtui_dir = _LIBRARY_DIRS[-1]
        for name in _EDIT_METHODS:
            original = getattr(cache, name, None)
            if original is None or not callable(original):
                continue

            def wrapper(*args, _name=name, _original=original, **kwargs):
                internal = _inside_transformers(kvtui_dir)
                before = introspect.seq_length(cache)
                result = _original(*args, **kwargs)
                watcher._after_edit(cache, track, _name, args, before, internal)
                return result

            try:
                setattr(cache, name, wrapper)
            except (AttributeError, TypeError):
                continue
            track.wrapped = True

    def _after_edit(self, cache, track: _CacheTrack, name: str, args, before: int, internal: bool) -> None:
        with self._lock:
            after = introspect.seq_length(cache)
            if name == "reorder_cache" and args:
                order = args[0].tolist() if isinstance(args[0], torch.Tensor) else list(args[0])
                track.rows = [list(track.rows[i]) if i < len(track.rows) else [] for i in order]
            elif name == "batch_select_indices" and args:
                order = args[0].tolist() if isinstance(args[0], torch.Tensor) else list(args[0])
                track.rows = [list(track.rows[i]) for i in order if i < len(track.rows)]
            elif name == "batch_repeat_interleave" and args:
                track.rows = [list(r) for r in track.rows for _ in range(int(args[0]))]
            elif name == "reset":
                track.rows = [[] for _ in track.rows]
            self._sync_rows(track, after)
            track.fingerprint = introspect.fingerprint(cache)
            if internal:  # generate's own bookkeeping (beam reordering): followed, not an alarm
                return
            shown = ", ".join(_short_arg(a) for a in args)
            self._diagnose([Diagnostic(
                "cache-edited", "info",  # the program called the cache's own method: said, not blamed
                f"{track.name}.{name}({shown}) at [{caller_line(self._skip or _library_dirs())}]: "
                f"{before} -> {after} tokens outside a forward", self.steps)])

    # ---- tokenizers --------------------------------------------------------------------------------

    def saw_encoding(self, ids: list[int], added: set[int]) -> None:
        with self._lock:
            self._encodings.append((tuple(ids), frozenset(added)))
            del self._encodings[:-16]


def _longest_run(tokens: list[BufferToken], token_id: int) -> int:
    best = run = 0
    for t in tokens:
        run = run + 1 if t.id == token_id else 0
        best = max(best, run)
    return best


def _rows(values, batch: int) -> list[list[int]] | None:
    if not isinstance(values, torch.Tensor):
        return None
    if values.dim() == 3:  # multimodal RoPE [3, batch, n]
        values = values[0]
    rows = values.reshape(-1, values.shape[-1]).tolist()
    return rows if len(rows) == batch else [rows[0]] * batch


def _span(values: list[int]) -> str:
    if not values:
        return "[]"
    if values == list(range(values[0], values[0] + len(values))):
        return f"[{values[0]}..{values[-1]}]" if len(values) > 1 else f"[{values[0]}]"
    return str(values[:8])[:-1] + (", ...]" if len(values) > 8 else "]")


def _short_arg(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor{list(value.shape)}" if value.numel() > 8 else str(value.tolist())
    return repr(value)


def _at(d: Diagnostic, caller: str) -> Diagnostic:
    return Diagnostic(d.code, d.severity, f"{d.message} [{caller}]", d.step)


# ---- tokenizer calls ---------------------------------------------------------------------------------


class _TokenizerRegistry:
    """Tokenizers the program loaded (to find pieces), and the calls of watched ones (to find what the
    tokenizer added and which rendering a fed slice came from). Patches are class-level and removed
    when nothing is watched."""

    def __init__(self):
        self.loaded: list = []  # weak refs, newest last
        self._watchers: dict[int, tuple[weakref.ref, list]] = {}
        self._patched: list[tuple[type, str, object]] = []

    def remember(self, tokenizer) -> None:
        try:
            self.loaded.append(weakref.ref(tokenizer))
        except TypeError:
            return
        del self.loaded[:-8]

    def find(self, model):
        """The tokenizer loaded from the same place as the model, else the newest one loaded."""
        candidates = [ref() for ref in reversed(self.loaded) if ref() is not None]
        name = getattr(model, "name_or_path", None)
        for tok in candidates:
            if name and getattr(tok, "name_or_path", None) == name:
                return tok
        if candidates:
            return candidates[0]
        if name and os.path.isdir(name):
            try:
                from transformers import AutoTokenizer

                return AutoTokenizer.from_pretrained(name)
            except Exception:
                return None
        return None

    def watch(self, tokenizer, watcher: Watcher) -> None:
        ref, watchers = self._watchers.get(id(tokenizer), (weakref.ref(tokenizer), []))
        if watcher not in watchers:
            watchers.append(watcher)
        self._watchers[id(tokenizer)] = (ref, watchers)
        self._patch()

    def unwatch(self, watcher: Watcher) -> None:
        for key, (ref, watchers) in list(self._watchers.items()):
            if watcher in watchers:
                watchers.remove(watcher)
            if not watchers or ref() is None:
                del self._watchers[key]
        if not self._watchers:
            self._unpatch()

    def watchers_of(self, tokenizer) -> list[Watcher]:
        entry = self._watchers.get(id(tokenizer))
        return entry[1] if entry and entry[0]() is tokenizer else []

    def _patch(self) -> None:
        if self._patched:
            return
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase

        original = PreTrainedTokenizerBase.__call__
        registry = self

        def call(tok, *args, **kwargs):
            result = original(tok, *args, **kwargs)
            watchers = registry.watchers_of(tok)
            if watchers:
                try:
                    _saw_call(watchers, original, tok, args, kwargs, result)
                except Exception:  # never break the user's program
                    pass
            return result

        PreTrainedTokenizerBase.__call__ = call
        self._patched.append((PreTrainedTokenizerBase, "__call__", original))

    def _unpatch(self) -> None:
        for owner, name, original in self._patched:
            setattr(owner, name, original)
        self._patched = []


def _saw_call(watchers, original, tok, args, kwargs, result) -> None:
    text = args[0] if args else kwargs.get("text")
    ids = result.get("input_ids") if hasattr(result, "get") else None
    if not isinstance(text, str) or ids is None:
        return
    if isinstance(ids, torch.Tensor):
        ids = ids.tolist()
    if ids and isinstance(ids[0], list):
        if len(ids) != 1:
            return
        ids = ids[0]
    added: set[int] = set()
    if kwargs.get("add_special_tokens", True):
        bare = original(tok, text, add_special_tokens=False)["input_ids"]
        front = find_sub(ids, bare)
        if front >= 0:
            added = set(range(front)) | set(range(front + len(bare), len(ids)))
    for watcher in watchers:
        watcher.saw_encoding(ids, added)


_TOKENIZERS = _TokenizerRegistry()


# ---- entry points -----------------------------------------------------------------------------------


def watch(model, tokenizer=None, trace=None, *, top_k: int = TOP_K, gate: Gate | None = None,
          on_snapshot=None, on_event=None) -> Watcher:
    """Watch `model`'s forwards: `with kvtui.watch(model, tokenizer, trace="run.jsonl"): ...`.

    Usable without `with` in a notebook (`w = kvtui.watch(model)`, later `w.detach()`); `w.last` is the
    newest StepSnapshot and `w.diagnostics` every alarm so far."""
    watcher = Watcher(tokenizer=tokenizer, trace=trace, top_k=top_k, gate=gate, on_snapshot=on_snapshot,
                      on_event=on_event)
    return watcher.attach(model)


class AutoAttach:
    """Watch every causal LM the program builds (`kvtui watch SCRIPT`): hooks model construction and
    tokenizer loading, for as long as it is installed."""

    def __init__(self, watcher: Watcher):
        self.watcher = watcher
        self._undo: list[Callable[[], None]] = []

    def install(self) -> "AutoAttach":
        from transformers import PreTrainedModel
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase

        watcher = self.watcher
        post_init = PreTrainedModel.post_init

        def watched_post_init(model, *args, **kwargs):
            result = post_init(model, *args, **kwargs)
            if _is_causal_lm(model):
                watcher.attach(model)
            return result

        PreTrainedModel.post_init = watched_post_init
        self._undo.append(lambda: setattr(PreTrainedModel, "post_init", post_init))

        loader = PreTrainedTokenizerBase.__dict__["from_pretrained"]  # a classmethod object

        def from_pretrained(cls, *args, **kwargs):
            tokenizer = loader.__func__(cls, *args, **kwargs)
            _TOKENIZERS.remember(tokenizer)
            for probe in watcher.probes:
                if getattr(tokenizer, "name_or_path", None) == probe.name or watcher.tokenizer is None:
                    watcher.tokenizer = tokenizer
                    watcher._pieces.clear()
                    _TOKENIZERS.watch(tokenizer, watcher)
            return tokenizer

        PreTrainedTokenizerBase.from_pretrained = classmethod(from_pretrained)
        self._undo.append(lambda: setattr(PreTrainedTokenizerBase, "from_pretrained", loader))
        return self

    def uninstall(self) -> None:
        while self._undo:
            self._undo.pop()()


def run_watched(watcher: Watcher, target: str, args: list[str], module: bool = False) -> tuple[int, list[str]]:
    """Run a program (script or module) with every causal LM it builds watched by `watcher`; the hooks are
    gone afterwards. Returns (the program's exit code, "name (Class)" of each model it watched)."""
    from .program import run_program

    attach = AutoAttach(watcher).install()
    try:
        code = run_program(target, args, module=module)
    finally:
        attach.uninstall()
        models = [f"{p.name} ({type(p.model).__name__})" for p in watcher.probes]
        watcher.detach()
    return code, models


def _is_causal_lm(model) -> bool:
    """A model that generates text: a GenerationMixin whose forward returns logits (not the inner base model)."""
    from transformers import GenerationMixin

    if not isinstance(model, GenerationMixin):
        return False
    if getattr(model.config, "is_encoder_decoder", False):
        return False
    try:
        return bool(model.can_generate())
    except Exception:
        return True
