"""Watch someone else's generation loop: every top-level forward of a watched causal LM becomes the same
`StepSnapshot` and trace step line that kvtui's own session emits, without changing what it computes.

How it sees without touching: the model's, its position module's and its caches' classes are patched
(`patches.py`: on the class, looked up by identity in kvtui's registries, removed on detach), so nothing
of kvtui is stored on the program's objects and nothing travels with `copy.deepcopy`, pickle or
`torch.save`. A forward records (`watch_step.py` builds the step):
- the fed ids per batch row, pads (attention mask 0) marked;
- the positions the model *applied* (the input of its rotary / position-embedding module), next to what
  the caller *asked for* (position_ids, cache_position);
- the cache's identity and history (`lineage.py`: made, copied, filled before kvtui saw it), its length
  before and after, per-layer infos via `introspect` (O(layers), no K/V copies);
- top-k from the logits the forward already returned (no extra forward).

Between two forwards a cache is checked against a per-layer fingerprint, and its own edit methods
(crop, reset, reorder...) report the line that called them (`cache-edited`). generate() is seen before
its first forward, from its own frame (`stale-cache`: the cache is not a prefix of the prompt). The
alarms on what was fed and cached come from the rulebook kvtui's own session uses too
(`reading/diagnostics.py`, verify's from `reading/verify.py`); `cache-edited` and kvtui's own failures
(`worker-error`) are built here. Every alarm names the line of the user's code.

This module is the `Watcher` (attaching, records, caches, the forward's begin and end, verify); beside it
`hooks.py` (a model's registry entry and forward hooks), `callers.py` (the user's line),
`tokenizers.py` (the program's tokenizers) and `auto_attach.py` (`AutoAttach`, `run_watched`, re-exported
here).
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING

import torch

from ..batching.packed import cache_argument, is_packed_forward
from ..reading import introspect
from ..reading.diagnostics import check_refed
from ..records.codec import diagnostic_record
from ..records.snapshot import Diagnostic, RequestView, StepSnapshot
from . import cache_edits, evictions, masks
from .auto_attach import AutoAttach
from .callers import caller_and_generate, caller_line, library_dirs, thread_caller
from .deferred import Gate, run_watched
from .hooks import MODELS, Probe, WatchRefused
from .lineage import CacheTrack, Lineage
from .packed_step import PackedReader, build_packed
from .patches import PATCHES, acquire_copy_patches, defining_class, edit_wrapper, thread_start_wrapper
from .silent_positions import mask_against_cache
from .silent_sizes import static_size_ignored
from .silent_writes import written_without_use_cache
from .tokenizers import TOKENIZERS
from .verify_watched import verify_watched
from .watch_step import Call, StepBuilder, read_call

if TYPE_CHECKING:
    from ..records.recorder import Recorder  # imported when a trace starts

# AutoAttach lives in auto_attach.py, Gate and run_watched in deferred.py, WatchRefused in hooks.py: re-exported,
# as kvtui, the commands and the process tree import them from here
__all__ = ["AutoAttach", "Gate", "WatchRefused", "Watcher", "run_watched", "watch"]

TOP_K = 10
EDIT_METHODS = ("crop", "reset", "reorder_cache", "batch_select_indices", "batch_repeat_interleave")


_WATCHERS: list[Watcher] = []  # attached watchers (caches are found through them)


def _cache_owner(cache):
    for watcher in _WATCHERS:
        track = watcher.lineage.get(cache)
        if track is not None:
            return watcher, track
    return None


REQUESTS_KEPT = 4096  # continuous batching: requests whose last view the headless summary lists


class Watcher:
    """Watches models, keeps every cache's history and tokens, raises alarms and emits snapshots.

    `on_snapshot(snapshot)` and `on_event(record)` receive everything; `trace` (a path) writes the
    same records as kvtui's own session (schema 1, with the watch fields), through the one Recorder."""

    def __init__(
        self,
        tokenizer=None,
        trace=None,
        top_k: int = TOP_K,
        gate: Gate | None = None,
        on_snapshot: Callable[[StepSnapshot], None] | None = None,
        on_event: Callable[[dict], None] | None = None,
        program: list[str] | None = None,
        attention: bool = False,
    ):
        self.tokenizer = tokenizer
        self.attention = attention  # capture every layer's attention of the newest query (reading/attention.py)
        self.top_k = top_k
        self.gate = gate  # None: nothing holds the program (no front end steps it)
        self.on_snapshot, self.on_event = on_snapshot, on_event
        self.program = program
        # the file opens at the first forward: where the path pointed when the watch began (a program may chdir)
        self.trace_path = os.path.abspath(trace) if isinstance(trace, (str, os.PathLike)) else trace
        self.recorder: Recorder | None = None
        self.probes: list[Probe] = []
        self.steps = 0
        self.diagnostics: list[Diagnostic] = []
        self.last: StepSnapshot | None = None
        self.watch_ids: tuple[int, ...] = ()
        self.lineage = Lineage()
        self.recomputed_tokens = 0  # tokens prefills re-encoded that another cache held (recomputed-prefix)
        self.requeued_tokens = 0  # tokens computed again by requests sent back to waiting (request-requeued)
        self.recomputed_ms = 0.0
        self.compression_costs: list[tuple[float, bool]] = []  # verifies of compressed caches: (KL, top-1 agrees)
        self.builder = StepBuilder(self)
        self.packed = PackedReader()  # continuous-batching runs: every request a lane
        self.requests: dict[tuple[str | None, str], RequestView] = {}  # (cache, request) -> its latest view
        self._skip: tuple[str, ...] | None = None  # library_dirs(), at the first forward
        self.lock = threading.RLock()
        self._started = False  # the header is out (first forward)
        self._waiting: list[dict] = []  # records raised before it
        self._cache_classes: set[type] = set()
        self._last_logits: torch.Tensor | None = None
        self._last_probe: Probe | None = None  # the model of the last forward (not its call: that holds the cache)
        self._last_quantized: weakref.ref | None = None  # the last forward's cache when it is quantized (verify)
        self.errors: list[str] = []
        self.refused: list[str] = []  # why a model the program built is not watched (one line each)

    @property
    def turn(self) -> int:
        return self.last.turn if self.last is not None else 0

    # ---- attaching -------------------------------------------------------------------------------

    def attach(self, model) -> Watcher:
        if any(p.model is model for p in self.probes):
            return self
        refusal = introspect.hybrid_refusal(model.config)  # a feature test of this transformers' DynamicCache
        if refusal:  # its cache would be misread (4.57: a hybrid's own cache class): refused, left unwatched
            raise WatchRefused(refusal)
        if self not in _WATCHERS:
            _WATCHERS.append(self)
            PATCHES.acquire(self, threading.Thread, "start", thread_start_wrapper(lambda: caller_line(self._skip)))
        earlier = MODELS.get(model)
        if earlier is not None and earlier.watcher is not self:  # a notebook cell run again: the newest watch sees it
            earlier.watcher.refused.append(f"{earlier.name}: watched by a newer kvtui.watch() from now on")
        probe = Probe(self, model, len(self.probes))
        self.probes.append(probe)
        own = TOKENIZERS.loaded_from(getattr(model, "name_or_path", None))
        if own is not None:
            probe.tokenizer = own
            TOKENIZERS.watch(own, self)
        if self.tokenizer is None:
            self.tokenizer = TOKENIZERS.find(model)
        if self.tokenizer is not None:
            TOKENIZERS.watch(self.tokenizer, self)
        self.emit(
            {
                "type": "model",
                "index": probe.index,
                "name": probe.name,
                "class": type(model).__name__,
                "layers": getattr(model.config, "num_hidden_layers", None),
                # the model's own KV heads: tells a rank holding a tensor-parallel shard from one holding it all
                "kv_heads": introspect.attention_heads(model.config)[1],
            }
        )
        return self

    def detach(self) -> None:
        """Remove every patch and registry entry: the program's objects, copies included, run unwatched."""
        for probe in self.probes:
            probe.detach()
        TOKENIZERS.unwatch(self)
        if self in _WATCHERS:
            _WATCHERS.remove(self)
        PATCHES.release(self)
        self.lineage.release()
        self.probes = []
        if self.recorder is not None:
            self.recorder.close()

    def __enter__(self) -> Watcher:
        return self

    def __exit__(self, *exc) -> None:
        self.detach()

    def select_attention(self, layer: int) -> None:
        """The layer whose per-head attention the next steps keep (the viewer's selection)."""
        for probe in self.probes:
            if probe.attention is not None:
                probe.attention.head_layer = layer

    def tokenizer_of(self, probe: Probe | None):
        """The tokenizer that reads this model's ids: its own when the program loaded one, else the watcher's."""
        own = probe.tokenizer if probe is not None else None
        return own if own is not None else self.tokenizer

    def set_tokenizer(self, tokenizer) -> None:
        if self.tokenizer is None and tokenizer is not None:
            self.tokenizer = tokenizer
            TOKENIZERS.watch(tokenizer, self)

    # ---- records ---------------------------------------------------------------------------------

    def emit(self, record: dict) -> None:
        """Every non-step record, to the trace and to on_event. The header goes first, at the first
        forward (when the model's weights, device and dtype are final): what comes before it waits."""
        if not self._started and record["type"] != "header":
            self._waiting.append(record)
            return
        if self.recorder is not None:
            self.recorder.record(record)
        if self.on_event is not None:
            self.on_event(record)

    def _start(self, probe: Probe) -> None:
        from ..records.recorder import Recorder
        from ..records.trace import TraceError

        header = self.header(probe)
        if self.trace_path is not None:
            try:
                self.recorder = Recorder.for_records(self.trace_path, header)
            except TraceError as exc:  # said once; the steps go on, unrecorded
                self.internal_error("opening the trace", exc)
        self._started = True
        if self.on_event is not None:
            self.on_event(header)
        waiting, self._waiting = self._waiting, []
        for record in waiting:
            self.emit(record)

    def header(self, probe: Probe | None = None) -> dict:
        from ..records.trace import header_start

        probe = probe or (self.probes[0] if self.probes else None)
        model = probe.model if probe else None
        return {
            **header_start(),
            "model": probe.name if probe else "?",
            "model_path": probe.name if probe else "?",
            "model_class": probe.class_name if probe else "?",
            "layers": getattr(model.config, "num_hidden_layers", None) if model is not None else None,
            "dtype": str(model.dtype).removeprefix("torch.") if model is not None else "?",
            "device": str(model.device) if model is not None else "?",
            "cache": "program",
            "capacity": None,
            "mode": "watch",
            "source": "watch",
            "program": self.program,
        }

    def internal_error(self, where: str, exc: BaseException) -> None:
        text = f"kvtui's probe failed {where}: {type(exc).__name__}: {exc}"
        self.errors.append(text)
        self._diagnose([Diagnostic("worker-error", "error", text, self.steps)])

    def _diagnose(self, found: list[Diagnostic]) -> None:
        """Alarms raised outside a step (cache edits, refusals): a record of their own."""
        for d in found:
            self.diagnostics.append(d)
            self.emit(diagnostic_record(d))

    # ---- tokens ----------------------------------------------------------------------------------

    def piece(self, token_id: int) -> str:
        return self.builder.piece(token_id)

    def label(self, token_id: int) -> str:
        """`'piece' (id N)` for messages."""
        return self.builder.label(token_id)

    # ---- caches ----------------------------------------------------------------------------------

    def _new_track(self, cache, probe: Probe, length: int, batch: int, made: str) -> CacheTrack:
        capacity = introspect.static_capacity(cache) if hasattr(cache, "layers") else None
        track = self.lineage.first_seen(cache, probe.index, length, batch, made, capacity)
        self._patch_cache_class(type(cache))
        self.emit(track.record())
        return track

    def _patch_cache_class(self, cls: type) -> None:
        if cls in self._cache_classes:
            return
        self._cache_classes.add(cls)
        for name in EDIT_METHODS:
            owner = defining_class(cls, name)
            if owner is not None and callable(owner.__dict__[name]):
                PATCHES.acquire(self, owner, name, edit_wrapper(name, _cache_owner, _edit_begins, _edit_ended))
        acquire_copy_patches(self, cls, _cache_owner, _copied)

    def _copied(self, parent: CacheTrack, copy, how: str, length: int) -> None:
        with self.lock:
            if self.lineage.get(copy) is not None:
                return
            track = self.lineage.copied(parent, copy, how, length)
            track.fingerprint = introspect.fingerprint(copy) if hasattr(copy, "layers") else None
            self._patch_cache_class(type(copy))
            self.emit(track.record())

    # ---- the forward -----------------------------------------------------------------------------

    def begin_forward(self, probe: Probe, args, kwargs, frame: FrameType | None = None) -> Call:
        with self.lock:
            self.builder.use(probe)  # messages before the step (stale prompt, re-fed prefix) name its pieces
            if self._skip is None:
                self._skip = library_dirs()
            line, generating = caller_and_generate(self._skip, frame)
            caller, thread = (
                (line, None) if threading.current_thread() is threading.main_thread() else thread_caller(line)
            )
            # continuous batching, read per request (packed_step.py): its own keyword asked first, a dict lookup
            if "cu_seq_lens_q" in kwargs and is_packed_forward(kwargs):
                return self.packed.begin(self, probe, kwargs, cache_argument(kwargs), caller, thread)
            call = read_call(probe, args, kwargs, caller, thread)
            call.generating = generating
            if call.cache is not None:
                track = self.lineage.get(call.cache)
                if track is None:
                    made = (
                        "generate" if generating and not _passed_to_generate(call.cache, generating[-1]) else "program"
                    )
                    track = self._new_track(call.cache, probe, call.cache_length_before, call.batch, made)
                else:
                    cache_edits.check_edits(self, call, track, call.cache)
                call.track = track
                if track.held is not None:  # a compressed cache: positions continue what its kept keys encode
                    call.expected_start = track.held.expected_next(call.cache_length_before)
                    evictions.begin(call, track)
                elif call.n > 1 or masks.press_hooked(probe):  # a prefill, or any forward under a press's
                    evictions.begin(call, track)  # hooks (DecodingPress compresses inside decoding forwards)
            if call.mask_cached is not None or call.mask_unread:  # a mask's cached columns, or a 4-D mask
                call.count_attended()
            return call

    def _read_call(self, call: Call) -> None:
        """The step's one transfer (the call's inputs, the edit check, and what `prepare` added), then the checks
        of what the forward was called with, in the order they are said."""
        if call.reads is None:  # a packed forward reads its own
            return
        call.reads.resolve()
        call.take_reads()
        generating, track = call.generating, call.track
        if call.pending_edit is not None and track is not None:
            change = call.pending_edit.describe(call.reads)
            if change is not None:
                cache_edits.edit_found(self, call, track, change)
        if call.cache is not None and track is not None:
            if generating:
                if track.made == "generate" and call.cache_length_before == 0:
                    call.found += static_size_ignored(call, generating[0], self.steps + 1)
                cache_edits.generate_started(self, call, generating)
            elif call.mask_length is not None:  # generate() builds its own mask: a stale cache there is stale-cache's
                call.found += mask_against_cache(call, self.steps + 1)
            if call.n > 1 and call.input_ids is not None and not any(d.code == "stale-cache" for d in call.found):
                call.found += check_refed(
                    self.steps + 1, track.name, track.ids(), call.input_ids[0], f" [{call.caller}]"
                )
        self.builder.check_request(call)

    def finish_forward(self, call: Call, output) -> None:
        with self.lock:
            if output is None:  # the forward raised: what it would have been is still worth an alarm
                if call.probe.attention is not None:
                    call.probe.attention.clear()
                evictions.end(call)
                self._read_call(call)
                self._diagnose(
                    list(call.found)
                    or [
                        Diagnostic(
                            "worker-error",
                            "error",
                            f"the forward raised (see the program's traceback) [{call.caller}]",
                            self.steps + 1,
                        )
                    ]
                )
                return
            forward_ms = (time.perf_counter() - call.started) * 1000
            snap_started = time.perf_counter()
            cache = introspect.output_cache(output)
            cache = call.cache if cache is None else cache
            logits = getattr(output, "logits", None)
            if logits is None and isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
                logits = output[0]
            if call.packed is None:
                if self.builder.probe is not call.probe:  # another thread read a forward of another model meanwhile
                    self.builder.use(call.probe)
                masks.stage(call)  # a press's masked keys, when they changed: read in the step's transfer
                self.builder.prepare(call, logits)  # the applied positions and the top-k, in the same transfer
                self._read_call(call)
            if not self._started:
                self._start(call.probe)
            self.steps += 1
            track = call.track if call.cache is cache else self.lineage.get(cache) if cache is not None else None
            if track is None and cache is not None:  # made by this forward (no cache was passed), or swapped in
                track = self._new_track(
                    cache, call.probe, 0 if call.cache is None else call.cache_length_before, call.batch, "forward"
                )
            if call.packed is not None:
                if call.probe.attention is not None:
                    call.probe.attention.clear()  # paged attention is not covered (reading/attention.py PAGED_NOTE)
                self.builder.use(call.probe)
                snapshot = build_packed(self.builder, call, self.steps, track, logits, forward_ms, snap_started)
            else:
                # a forward handed a cache with use_cache off (passed True: it wrote, as asked)
                if call.use_cache is not True and call.cache is not None and call.track is not None:
                    call.found += written_without_use_cache(call, self.steps)
                if call.capturing or (track is not None and track.held is not None):
                    call.found += evictions.after_forward(self, call, track, cache, self.steps)
                if call.masks_staged:
                    call.found += masks.take(call, track, cache, self.steps)
                snapshot = self.builder.build(call, self.steps, cache, track, logits, forward_ms, snap_started)
            self.last = snapshot
            self._last_probe = call.probe
            self._last_quantized = weakref.ref(cache) if snapshot.layers and snapshot.layers[0].quant_bits else None
            if call.last_logits is not None:  # the top-k's float32 copy (a model in another dtype): row 0
                self._last_logits = call.last_logits[0]
            elif logits is not None and logits.dim() == 3:
                last = logits[0, -1].detach()  # [vocab], for verify: a copy (the program may edit its logits)
                self._last_logits = last.clone() if last.dtype == torch.float32 else last.float()
            self.diagnostics.extend(snapshot.diagnostics)
            if snapshot.requests:  # a packed forward's (continuous batching)
                for view in snapshot.requests:
                    self.requests[(snapshot.cache_id, view.request_id)] = view
                while len(self.requests) > REQUESTS_KEPT:  # a long-running server: the newest requests are summarised
                    del self.requests[next(iter(self.requests))]
            if self.recorder is not None:
                self.recorder.record(snapshot)  # written and flushed before the program's next line
            if self.on_snapshot is not None:
                self.on_snapshot(snapshot)
        if self.gate is not None:
            self.gate.after_step(self, snapshot)

    # ---- verify ----------------------------------------------------------------------------------

    def verify(self) -> dict:
        """Compare the last forward's logits with one no-cache forward over what its cache was fed
        (`verify_watched.py`); on a compressed cache, what the compression cost. Refuses (ValueError) what it
        cannot check."""
        return verify_watched(self, self.last, self._last_logits, self._last_probe)

    # ---- tokenizers --------------------------------------------------------------------------------

    def saw_encoding(self, ids: list[int], added: set[int]) -> None:
        self.builder.saw_encoding(ids, added)

    def summary(self) -> str:
        """The waste line of the headless report."""
        if not self.recomputed_tokens:
            line = "no prefill re-encoded what another cache held"
        else:
            line = (
                f"re-encoded {self.recomputed_tokens} tokens that earlier caches held, "
                f"~{self.recomputed_ms:.0f} ms (recomputed-prefix)"
            )
        if self.requeued_tokens:
            line += (
                f"; {self.requeued_tokens} tokens computed again by requests sent back to waiting (request-requeued)"
            )
        return line


def _passed_to_generate(cache, frame) -> bool:
    """Whether the program handed this cache to the (outermost) generate() call, or generate() made it."""
    arguments = frame.f_locals.get("kwargs") or {}
    return any(value is cache for value in arguments.values())


def _edit_begins(handler, cache, name: str, args):
    try:
        return cache_edits.edit_begins(cache)
    except Exception as exc:  # noqa: BLE001  never break the program's own call
        handler[0].internal_error(f"before {name}()", exc)
        return None


def _edit_ended(handler, begun, cache, name: str, args) -> None:
    watcher, track = handler
    if begun is None:
        return
    try:
        cache_edits.edit_ended(watcher, track, cache, name, args, begun)
    except Exception as exc:  # noqa: BLE001  never break the program's own call
        watcher.internal_error(f"following {name}()", exc)


def _copied(handler, original, copy, how: str) -> None:
    watcher, track = handler
    try:
        watcher._copied(track, copy, how, introspect.seq_length(original))
    except Exception as exc:  # noqa: BLE001  never break the program's copy
        watcher.internal_error(f"following a {how}", exc)


# ---- entry points -----------------------------------------------------------------------------------


def watch(
    model,
    tokenizer=None,
    trace=None,
    *,
    top_k: int = TOP_K,
    gate: Gate | None = None,
    on_snapshot=None,
    on_event=None,
    attention: bool = False,
) -> Watcher:
    """Watch `model`'s forwards: `with kvtui.watch(model, tokenizer, trace="run.jsonl"): ...`.

    Usable without `with` in a notebook (`w = kvtui.watch(model)`, later `w.detach()`); `w.last` is the
    newest StepSnapshot and `w.diagnostics` every alarm so far. `attention=True`: each snapshot's `attention`
    holds the newest query's attention in every layer (whatever attention implementation the model uses)."""
    watcher = Watcher(
        tokenizer=tokenizer,
        trace=trace,
        top_k=top_k,
        gate=gate,
        on_snapshot=on_snapshot,
        on_event=on_event,
        attention=attention,
    )
    return watcher.attach(model)
