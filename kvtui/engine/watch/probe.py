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
its first forward, from its own frame (`stale-cache`: the cache is not a prefix of the prompt). Every alarm comes from
`diagnostics.py`, the rulebook kvtui's own session uses too, and names the line of the user's code.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import asdict
from types import FrameType
from typing import TYPE_CHECKING

import torch

from ..reading import introspect
from ..reading.diagnostics import check_refed, check_stale_prompt
from ..reading.tokens import find_sub
from ..reading.verify import judge_recompute, mismatch_alarm, recompute_last_logits
from ..records.snapshot import Diagnostic, StepSnapshot
from .lineage import CacheTrack, Lineage
from .patches import (
    PATCHES,
    Registry,
    acquire_copy_patches,
    call_wrapper,
    compiling,
    defining_class,
    edit_wrapper,
    peek_wrapper,
    started_at,
    thread_start_wrapper,
)
from .silent_writes import edit_changed_nothing, written_without_use_cache
from .watch_step import Call, StepBuilder, read_call

if TYPE_CHECKING:
    from ..records.recorder import Recorder  # imported when a trace starts

TOP_K = 10
EDIT_METHODS = ("crop", "reset", "reorder_cache", "batch_select_indices", "batch_repeat_interleave")
_KVTUI_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_LIBRARY_DIRS = (os.path.dirname(os.path.abspath(torch.__file__)) + os.sep, _KVTUI_DIR)


def _library_dirs() -> tuple[str, ...]:
    import transformers

    extra = [
        os.path.dirname(os.path.abspath(transformers.__file__)) + os.sep,
        os.path.dirname(inspect.__file__) + os.sep,
        os.path.dirname(threading.__file__) + os.sep + "threading.py",
    ]
    return _LIBRARY_DIRS + tuple(extra)


def caller_line(skip: tuple[str, ...] | None = None) -> str:
    """ "file.py:42": the innermost frame that belongs to the user's code, not to torch/transformers/kvtui."""
    skip = skip or _library_dirs()
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(skip) and not name.startswith("<frozen"):
            return f"{_short_path(name)}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


_GENERATE_CODES: set = set()  # code objects of the watched models' generate(): their frames hold the prompt


def caller_and_generate(skip: tuple[str, ...]) -> tuple[str, list]:
    """The user's line (as caller_line) and the generate() frames between it and here, innermost first.
    generate() is read from its frame, not wrapped: a wrapper would become the caller that its warnings
    (stacklevel) point at, and the program's stderr would change."""
    frames = []
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code in _GENERATE_CODES:
            frames.append(frame)
        name = code.co_filename
        if not name.startswith(skip) and not name.startswith("<frozen"):
            return f"{_short_path(name)}:{frame.f_lineno}{_fixture(code, frame.f_globals)}", frames
        frame = frame.f_back
    return "?", frames


_FIXTURES: dict = {}  # code object -> " in fixture NAME" or ""


def _fixture(code, module_globals: dict) -> str:
    """ " in fixture NAME" when the user's line is inside a pytest fixture (a session-scoped fixture that
    tokenizes is where "prompt of 862 tokens, cache of 863" hides); looked up once per function."""
    found = _FIXTURES.get(code)
    if found is None:
        definition = module_globals.get(code.co_name) if "pytest" in sys.modules else None
        is_fixture = (
            type(definition).__name__ == "FixtureFunctionDefinition"  # pytest >= 8.4
            or hasattr(definition, "_pytestfixturefunction")
        )  # older pytest marks the function
        found = _FIXTURES[code] = f" in fixture {code.co_name}" if is_fixture else ""
    return found


def thread_caller(line: str) -> tuple[str, str | None]:
    """(caller, thread): on another thread than the main one, its name; with no program frame on its
    stack, the caller names the thread and the line that started it."""
    thread = threading.current_thread()
    if thread is threading.main_thread():
        return line, None
    where = started_at(thread)
    name = thread.name + (f", started at {where}" if where else "")
    return (name if line == "?" else line), name


@functools.lru_cache(maxsize=1024)
def _short_path(path: str) -> str:
    """Relative to the working directory when kvtui first met the file (a getcwd per forward adds up)."""
    try:
        relative = os.path.relpath(path)
    except ValueError:
        return path
    return relative if not relative.startswith("..") else path


def _inside_transformers() -> bool:
    """Whether the code that called a cache's edit method is transformers itself (generate's beam search)."""
    import transformers

    root = os.path.dirname(os.path.abspath(transformers.__file__)) + os.sep
    frame: FrameType | None = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(_KVTUI_DIR):  # kvtui's wrapper frames
        frame = frame.f_back
    return frame is not None and frame.f_code.co_filename.startswith(root)


class Gate:
    """Where a front end may hold the program: before each watched forward, after each step."""

    def before_forward(self, watcher: Watcher) -> None:
        pass

    def after_step(self, watcher: Watcher, snapshot: StepSnapshot) -> None:
        pass


class _State(threading.local):
    def __init__(self):
        self.stack: list[Call | None] = []  # top-level forwards in flight on this thread (None: nested)
        self.prompt: weakref.ref | None = None  # the prompt of the generate() call this thread last ran a forward of
        self.frame: int | None = None  # and the id of that call's frame

    @property
    def current(self) -> Call | None:
        return self.stack[-1] if self.stack else None


_STATE = _State()
_MODELS: Registry[_Probe] = Registry()  # watched model -> its _Probe
_POSITIONS: Registry[tuple[_Probe, str]] = Registry()  # position module -> (its _Probe, "rotary" | "embedding")
_WATCHERS: list[Watcher] = []  # attached watchers (caches are found through them)


class WatchRefused(ValueError):
    """kvtui cannot read this model's cache on the installed transformers (the message is one line)."""


def _cache_owner(cache):
    for watcher in _WATCHERS:
        track = watcher.lineage.get(cache)
        if track is not None:
            return watcher, track
    return None


class _Probe:
    """One watched model: its registry entries (no hooks on the instance) and what kvtui read of it. The
    model and its modules are held weakly: a program that drops its model gets its memory back, watched
    or not."""

    def __init__(self, watcher: Watcher, model, index: int):
        self.watcher, self.index = watcher, index
        self._model = weakref.ref(model)
        self.class_name = type(model).__name__
        self.name = getattr(model, "name_or_path", None) or self.class_name
        self.role: str | None = None  # "draft" when passed to generate() as assistant_model
        self._tokenizer: weakref.ref | None = None  # its own tokenizer (the program's, held weakly)
        self.window = introspect.config_window(model.config)
        self.accepts_cache_position = introspect.forward_accepts(model, "cache_position")
        parameters = list(inspect.signature(type(model).forward).parameters.values())[1:]  # after self
        self.positional = tuple(p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
        _MODELS.add(model, self)
        PATCHES.acquire(watcher, type(model), "__call__", call_wrapper(_MODELS.get, _before_forward, _after_forward))
        owner = defining_class(type(model), "generate")
        if owner is not None:
            _GENERATE_CODES.add(inspect.unwrap(owner.__dict__["generate"]).__code__)
        self._position_modules = []
        for module, source in _position_modules(model):
            self._position_modules.append(weakref.ref(module))
            _POSITIONS.add(module, (self, source))
            PATCHES.acquire(watcher, type(module), "__call__", peek_wrapper(_POSITIONS.get, _saw_positions))

    @property
    def model(self):
        """The watched model, or None once the program has let go of it."""
        return self._model()

    @property
    def tokenizer(self):
        """The tokenizer loaded from this model's own directory, when the program loaded one (else None: the
        watcher's serves). Held weakly: it lives as long as the program keeps it."""
        return self._tokenizer() if self._tokenizer is not None else None

    @tokenizer.setter
    def tokenizer(self, tokenizer) -> None:  # one the registry found: it took a weak reference already
        self._tokenizer = weakref.ref(tokenizer)

    @property
    def label(self) -> str | None:
        """`model 1: draft` when the program runs several models (or this one drafts), else None."""
        if self.role is None and len(self.watcher.probes) < 2:
            return None
        return f"model {self.index}" + (f": {self.role}" if self.role else "")

    def detach(self) -> None:
        for ref in (self._model, *self._position_modules):
            held = ref()
            if held is not None:  # a collected one's entry is dead already
                (_MODELS if ref is self._model else _POSITIONS).discard(held)


def _before_forward(probe: _Probe, module, args, kwargs):
    if _STATE.stack:  # a nested call (a model inside a watched forward): the outer one is the step
        _STATE.stack.append(None)
        return None
    watcher = probe.watcher
    try:
        call = watcher._begin(probe, args, kwargs)
    except Exception as exc:  # noqa: BLE001  never break the user's program
        watcher._internal_error("before a forward", exc)
        call = None
    if call is not None:
        watcher.gate.before_forward(watcher)  # may hold the program here, or raise (its ctrl+c): nothing pushed yet
        call.started = time.perf_counter()
    _STATE.stack.append(call)
    return None


def _after_forward(probe: _Probe, token, output) -> None:
    call = _STATE.stack.pop() if _STATE.stack else None
    if call is None:
        return
    try:
        probe.watcher._finish(call, output)
    except Exception as exc:  # noqa: BLE001  never break the user's program
        probe.watcher._internal_error("after a forward", exc)


def _saw_positions(entry, args, kwargs) -> None:
    probe, source = entry
    call = _STATE.current
    if call is None or call.probe is not probe or call.applied is not None:
        return
    if source == "rotary":
        positions = kwargs.get("position_ids", args[1] if len(args) > 1 else None)
    else:
        positions = args[0] if args else kwargs.get("input")
    if isinstance(positions, torch.Tensor) and positions.dtype in (torch.long, torch.int, torch.int32):
        call.applied, call.positions_source = positions, source


def _position_modules(model) -> list[tuple[torch.nn.Module, str]]:
    """The modules whose input is the position ids the model applies: rotary embeddings, else a learned
    position table (GPT-2's `wpe`). Only the first call per forward is read."""
    found = [(m, "rotary") for m in model.modules() if "RotaryEmbedding" in type(m).__name__]
    if found:
        return found
    for name, module in model.named_modules():
        if type(module) is torch.nn.Embedding and name.rsplit(".", 1)[-1] in (
            "wpe",
            "embed_positions",
            "position_embeddings",
        ):
            return [(module, "embedding")]
    return []


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
    ):
        self.tokenizer = tokenizer
        self.top_k = top_k
        self.gate = gate or Gate()
        self.on_snapshot, self.on_event = on_snapshot, on_event
        self.program = program
        self.trace_path = trace
        self.recorder: Recorder | None = None
        self.probes: list[_Probe] = []
        self.steps = 0
        self.diagnostics: list[Diagnostic] = []
        self.last: StepSnapshot | None = None
        self.watch_ids: tuple[int, ...] = ()
        self.lineage = Lineage()
        self.recomputed_tokens = 0  # tokens prefills re-encoded that another cache held (recomputed-prefix)
        self.recomputed_ms = 0.0
        self.builder = StepBuilder(self)
        self._skip: tuple[str, ...] | None = None  # _library_dirs(), at the first forward
        self._lock = threading.RLock()
        self._started = False  # the header is out (first forward)
        self._waiting: list[dict] = []  # records raised before it
        self._cache_classes: set[type] = set()
        self._last_logits: torch.Tensor | None = None
        self._last_probe: _Probe | None = None  # the model of the last forward (not its call: that holds the cache)
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
        probe = _Probe(self, model, len(self.probes))
        self.probes.append(probe)
        own = _TOKENIZERS.loaded_from(getattr(model, "name_or_path", None))
        if own is not None:
            probe.tokenizer = own
            _TOKENIZERS.watch(own, self)
        if self.tokenizer is None:
            self.tokenizer = _TOKENIZERS.find(model)
        if self.tokenizer is not None:
            _TOKENIZERS.watch(self.tokenizer, self)
        self._event(
            {
                "type": "model",
                "index": probe.index,
                "name": probe.name,
                "class": type(model).__name__,
                "layers": getattr(model.config, "num_hidden_layers", None),
            }
        )
        return self

    def detach(self) -> None:
        """Remove every patch and registry entry: the program's objects, copies included, run unwatched."""
        for probe in self.probes:
            probe.detach()
        _TOKENIZERS.unwatch(self)
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

    def tokenizer_of(self, probe: _Probe | None):
        """The tokenizer that reads this model's ids: its own when the program loaded one, else the watcher's."""
        own = probe.tokenizer if probe is not None else None
        return own if own is not None else self.tokenizer

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
        if self.recorder is not None:
            self.recorder.record(record)
        if self.on_event is not None:
            self.on_event(record)

    def _start(self, probe: _Probe) -> None:
        from ..records.recorder import Recorder

        header = self.header(probe)
        if self.trace_path is not None:
            self.recorder = Recorder.for_records(self.trace_path, header)
        self._started = True
        if self.on_event is not None:
            self.on_event(header)
        waiting, self._waiting = self._waiting, []
        for record in waiting:
            self._event(record)

    def header(self, probe: _Probe | None = None) -> dict:
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

    def _internal_error(self, where: str, exc: BaseException) -> None:
        text = f"kvtui's probe failed {where}: {type(exc).__name__}: {exc}"
        self.errors.append(text)
        self._diagnose([Diagnostic("worker-error", "error", text, self.steps)])

    def _diagnose(self, found: list[Diagnostic]) -> None:
        """Alarms raised outside a step (cache edits, refusals): a record of their own."""
        for d in found:
            self.diagnostics.append(d)
            self._event(
                {"type": "diagnostic", "step": d.step, "code": d.code, "severity": d.severity, "message": d.message}
            )

    # ---- tokens ----------------------------------------------------------------------------------

    def piece(self, token_id: int) -> str:
        return self.builder.piece(token_id)

    def label(self, token_id: int) -> str:
        """`'piece' (id N)` for messages."""
        return self.builder.label(token_id)

    # ---- caches ----------------------------------------------------------------------------------

    def _new_track(self, cache, probe: _Probe, length: int, batch: int, made: str) -> CacheTrack:
        capacity = introspect.static_capacity(cache) if hasattr(cache, "layers") else None
        track = self.lineage.first_seen(cache, probe.index, length, batch, made, capacity)
        self._patch_cache_class(type(cache))
        self._event(track.record())
        return track

    def _patch_cache_class(self, cls: type) -> None:
        if cls in self._cache_classes:
            return
        self._cache_classes.add(cls)
        for name in EDIT_METHODS:
            owner = defining_class(cls, name)
            if owner is not None and callable(owner.__dict__[name]):
                PATCHES.acquire(self, owner, name, edit_wrapper(name, _cache_owner, _edited))
        acquire_copy_patches(self, cls, _cache_owner, _copied)

    def _copied(self, parent: CacheTrack, copy, how: str, length: int) -> None:
        with self._lock:
            if self.lineage.get(copy) is not None:
                return
            track = self.lineage.copied(parent, copy, how, length)
            track.fingerprint = introspect.fingerprint(copy) if hasattr(copy, "layers") else None
            self._patch_cache_class(type(copy))
            self._event(track.record())

    def _edited(self, track: CacheTrack, cache, name: str, args, run):
        internal = _inside_transformers()
        before = introspect.seq_length(cache)
        result = run()
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
            track.truncate(after)
            track.fingerprint = introspect.fingerprint(cache)
            if not internal:  # generate's own bookkeeping (beam reordering, assisted crops) is followed, not said
                shown = ", ".join(_short_arg(a) for a in args)
                call = f"{track.name}.{name}({shown}) at [{caller_line(self._skip or _library_dirs())}]"
                self._diagnose(
                    edit_changed_nothing(self.steps, call, name, args, before, after)
                    or [
                        Diagnostic(
                            "cache-edited",
                            "info",  # the program called the cache's own method: said, not blamed
                            f"{call}: {before} -> {after} tokens outside a forward",
                            self.steps,
                        )
                    ]
                )
        return result

    def _check_edits(self, call: Call, track: CacheTrack, cache) -> None:
        """Compare the cache with its fingerprint after the last forward: a change means an edit outside one."""
        before, track.fingerprint = track.fingerprint, None  # spent: the forward makes the next one
        if before is None:
            return
        change = introspect.changed(before, cache)
        if change is None:
            return
        track.truncate(call.cache_length_before)
        call.found.append(
            Diagnostic(
                "cache-edited",
                "warning",
                f"{track.name} changed since the last forward without a forward: {change} (noticed at [{call.caller}])",
                self.steps + 1,
            )
        )

    # ---- generate() ------------------------------------------------------------------------------

    def _generate(self, call: Call, frames: list) -> None:
        """The forward runs inside generate(): name a draft model, and at generate's first forward check the
        cache against the whole prompt (generate feeds only the prompt tokens past the cache's length,
        whatever the cache holds)."""
        for frame in frames:
            assistant = frame.f_locals.get("assistant_model")
            helper = _MODELS.get(assistant) if assistant is not None else None
            if helper is not None and helper.watcher is self:
                helper.role = "draft"
        prompt = frames[0].f_locals.get("input_ids")
        track = call.track
        if not isinstance(prompt, torch.Tensor) or prompt.dim() != 2 or track is None:
            return
        # generate()'s first forward: a prompt tensor this thread has not seen a forward for yet (a weak
        # reference: the program's tensor lives exactly as long as without kvtui)
        first = _STATE.prompt is None or _STATE.prompt() is not prompt or _STATE.frame != id(frames[0])
        _STATE.prompt, _STATE.frame = weakref.ref(prompt), id(frames[0])
        if not first or not call.cache_length_before:
            return
        length = prompt.shape[-1]
        call.found += check_stale_prompt(
            self.steps + 1,
            track.name,
            track.ids(),
            prompt[0].tolist(),
            self.label,
            f" [{call.caller}]",
            fed_from=length - call.n,
        )

    # ---- the forward -----------------------------------------------------------------------------

    def _begin(self, probe: _Probe, args, kwargs) -> Call:
        with self._lock:
            self.builder.use(probe)  # messages before the step (stale prompt, re-fed prefix) name its pieces
            if self._skip is None:
                self._skip = _library_dirs()
            line, generating = caller_and_generate(self._skip)
            caller, thread = thread_caller(line)
            call = read_call(probe, args, kwargs, caller, thread)
            if call.cache is not None:
                track = self.lineage.get(call.cache)
                if track is None:
                    made = (
                        "generate" if generating and not _passed_to_generate(call.cache, generating[-1]) else "program"
                    )
                    track = self._new_track(call.cache, probe, call.cache_length_before, call.batch, made)
                else:
                    self._check_edits(call, track, call.cache)
                call.track = track
                if generating:
                    self._generate(call, generating)
                if call.n > 1 and call.input_ids is not None and not any(d.code == "stale-cache" for d in call.found):
                    call.found += check_refed(
                        self.steps + 1, track.name, track.ids(), call.input_ids[0], f" [{call.caller}]"
                    )
            self.builder.check_request(call)
            return call

    def _finish(self, call: Call, output) -> None:
        with self._lock:
            if output is None:  # the forward raised: what it would have been is still worth an alarm
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
            if not self._started:
                self._start(call.probe)
            self.steps += 1
            track = None
            if cache is not None:
                track = call.track if call.cache is cache else self.lineage.get(cache)
                if track is None:  # made by this forward (no cache was passed), or a cache it swapped in
                    track = self._new_track(
                        cache, call.probe, 0 if call.cache is None else call.cache_length_before, call.batch, "forward"
                    )
            if call.cache is not None and call.track is not None:
                call.found += written_without_use_cache(call, self.steps)
            snapshot = self.builder.build(call, self.steps, cache, track, logits, forward_ms, snap_started)
            self.last = snapshot
            self._last_probe = call.probe
            if logits is not None and logits.dim() == 3:
                last = logits[0, -1].detach()  # [vocab], for verify: a copy (the program may edit its logits)
                self._last_logits = last.clone() if last.dtype == torch.float32 else last.float()
            self.diagnostics.extend(snapshot.diagnostics)
            if self.recorder is not None:
                self.recorder.record(snapshot)  # written and flushed before the program's next line
            if self.on_snapshot is not None:
                self.on_snapshot(snapshot)
        self.gate.after_step(self, snapshot)

    # ---- verify ----------------------------------------------------------------------------------

    def verify(self) -> dict:
        """Compare the last forward's logits (row 0) with one no-cache forward over what its cache row
        holds (attended tokens, positions 0..n-1), judged as kvtui's own session judges. Runs in the
        program's thread, between two forwards. Refuses (ValueError) what it cannot check."""
        snapshot, logits, probe = self.last, self._last_logits, self._last_probe  # set together, by a forward
        if snapshot is None or logits is None or probe is None:
            raise ValueError("nothing to verify yet: the program has not run a forward")
        unknown = snapshot.cache_unknown
        if unknown:
            raise ValueError(
                f"cannot check {snapshot.cache_id}: its first {unknown} tokens were written before kvtui saw it "
                f"(made before attaching, loaded or copied from an unwatched cache), so a recompute has nothing "
                f"to start from; the {len(snapshot.buffer) - unknown} tokens after them were fed while watched"
            )
        tokens = [t.id for t in snapshot.buffer if t.origin != "pad" and t.id >= 0]
        model = probe.model
        if model is None:
            raise ValueError(f"cannot check {snapshot.cache_id}: the program has let go of its model ({probe.name})")
        _STATE.stack.append(None)  # kvtui's own forward, not one of the program's: no step, never held by the gate
        try:
            fresh, ms = recompute_last_logits(model, tokens)
        finally:
            _STATE.stack.pop()
        dtype = str(model.dtype).removeprefix("torch.")
        quant_bits = next((layer.quant_bits for layer in snapshot.layers if layer.quant_bits), None)
        result = judge_recompute(logits, fresh, dtype, self.top_k, len(tokens), ms, quant_bits)
        if not result.ok:
            self._diagnose([mismatch_alarm(result, f"the program's cached logits ({snapshot.cache_id})", self.steps)])
        record = asdict(result)
        record["cached_top"], record["recomputed_top"] = list(result.cached_top), list(result.recomputed_top)
        if self.recorder is not None:
            self.recorder.record({"type": "verify", "step": self.steps, **record})
        return record

    # ---- tokenizers --------------------------------------------------------------------------------

    def saw_encoding(self, ids: list[int], added: set[int]) -> None:
        self.builder.saw_encoding(ids, added)

    def summary(self) -> str:
        """The waste line of the headless report."""
        if not self.recomputed_tokens:
            return "no prefill re-encoded what another cache held"
        return (
            f"re-encoded {self.recomputed_tokens} tokens that earlier caches held, "
            f"~{self.recomputed_ms:.0f} ms (recomputed-prefix)"
        )


def _passed_to_generate(cache, frame) -> bool:
    """Whether the program handed this cache to the (outermost) generate() call, or generate() made it."""
    arguments = frame.f_locals.get("kwargs") or {}
    return any(value is cache for value in arguments.values())


def _short_arg(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor{list(value.shape)}" if value.numel() > 8 else str(value.tolist())
    return repr(value)


def _edited(handler, cache, name: str, args, run):
    watcher, track = handler
    return watcher._edited(track, cache, name, args, run)


def _copied(handler, original, copy, how: str) -> None:
    watcher, track = handler
    try:
        watcher._copied(track, copy, how, introspect.seq_length(original))
    except Exception as exc:  # noqa: BLE001  never break the program's copy
        watcher._internal_error(f"following a {how}", exc)


# ---- tokenizer calls ---------------------------------------------------------------------------------


_TOKENIZING = threading.local()  # depth of watched tokenizer calls on this thread: only the outermost counts


class _TokenizerRegistry:
    """Tokenizers the program loaded (to find pieces), and the calls of watched ones (to find what the
    tokenizer added and which rendering a fed slice came from): `__call__`, `encode` and
    `apply_chat_template`, patched on the class while anything is watched."""

    ENTRY_POINTS = ("__call__", "encode", "apply_chat_template")

    def __init__(self):
        self.loaded: list = []  # weak refs, newest last
        self._watchers: Registry[list[Watcher]] = Registry()  # tokenizer -> [watchers]

    def remember(self, tokenizer) -> None:
        try:
            self.loaded.append(weakref.ref(tokenizer))
        except TypeError:
            return
        del self.loaded[:-8]

    def loaded_from(self, name):
        """The newest tokenizer the program loaded from `name` (a model's name_or_path), or None."""
        if not name:
            return None
        for ref in reversed(self.loaded):
            tok = ref()
            if tok is not None and getattr(tok, "name_or_path", None) == name:
                return tok
        return None

    def find(self, model):
        """The tokenizer loaded from the same place as the model, else the newest one loaded."""
        name = getattr(model, "name_or_path", None)
        own = self.loaded_from(name)
        if own is not None:
            return own
        candidates = [ref() for ref in reversed(self.loaded) if ref() is not None]
        if candidates:
            return candidates[0]
        if name and os.path.isdir(name):
            try:
                from transformers import AutoTokenizer

                return AutoTokenizer.from_pretrained(name)
            except Exception:  # noqa: BLE001  a tokenizer that does not load: the watch goes on without one
                return None
        return None

    def watch(self, tokenizer, watcher: Watcher) -> None:
        watchers = self._watchers.get(tokenizer)
        if watchers is None:
            watchers = []
            self._watchers.add(tokenizer, watchers)
        if watcher not in watchers:
            watchers.append(watcher)
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase

        for name in self.ENTRY_POINTS:
            owner = defining_class(PreTrainedTokenizerBase, name)
            if owner is not None:
                PATCHES.acquire(self, owner, name, _tokenizer_wrapper(name, self))

    def unwatch(self, watcher: Watcher) -> None:
        for watchers in self._watchers.values():
            if watcher in watchers:
                watchers.remove(watcher)
        self._watchers.prune()
        if not any(self._watchers.values()):
            self._watchers.clear()
            PATCHES.release(self)

    def watchers_of(self, tokenizer) -> list[Watcher]:
        return self._watchers.get(tokenizer) or []


def _tokenizer_wrapper(name: str, registry: _TokenizerRegistry):
    def make(original):
        @functools.wraps(original)
        def wrapper(tok, *args, **kwargs):
            depth = getattr(_TOKENIZING, "depth", 0)
            if depth or compiling():
                return original(tok, *args, **kwargs)
            _TOKENIZING.depth = 1
            try:
                result = original(tok, *args, **kwargs)
                watchers = registry.watchers_of(tok)
                if watchers:
                    try:
                        _saw_call(watchers, name, original, tok, args, kwargs, result)
                    except Exception:  # noqa: BLE001  never break the user's program
                        pass
                return result
            finally:
                _TOKENIZING.depth = 0

        return wrapper

    return make


def _id_rows(result) -> list[list[int]]:
    """The ids a tokenizer call returned, as rows: a list, a BatchEncoding, a tensor, batched or not."""
    ids = result.get("input_ids") if hasattr(result, "get") and not isinstance(result, list) else result
    if isinstance(ids, torch.Tensor):
        ids = ids.tolist()
    if not isinstance(ids, list) or not ids:
        return []
    if isinstance(ids[0], list):
        return [row for row in ids if row and all(isinstance(i, int) for i in row)]
    return [ids] if all(isinstance(i, int) for i in ids) else []


def _saw_call(watchers, name: str, original, tok, args, kwargs, result) -> None:
    """One outermost tokenizer call: each encoded row, and which of its ids the tokenizer added."""
    if name == "apply_chat_template":  # the template's own tokens: nothing added (add_special_tokens=False)
        for row in _id_rows(result):
            for watcher in watchers:
                watcher.saw_encoding(row, set())
        return
    text = args[0] if args else kwargs.get("text")
    texts = (
        [text]
        if isinstance(text, str)
        else text
        if isinstance(text, list) and all(isinstance(t, str) for t in text)
        else None
    )
    rows = _id_rows(result)
    if texts is None or len(rows) != len(texts):
        return
    add = kwargs.get("add_special_tokens", True)
    for text, ids in zip(texts, rows):
        added: set[int] = set()
        if add:
            bare = tok.encode(text, add_special_tokens=False)  # nested: not recorded itself
            real = [i for i in ids if i != tok.pad_token_id] if tok.pad_token_id is not None else ids
            front = find_sub(ids, bare)
            if front >= 0 and len(real) != len(bare):
                added = set(range(front)) | {
                    i for i in range(front + len(bare), len(ids)) if ids[i] != tok.pad_token_id
                }
        for watcher in watchers:
            watcher.saw_encoding(ids, added)


_TOKENIZERS = _TokenizerRegistry()


# ---- entry points -----------------------------------------------------------------------------------


def watch(
    model, tokenizer=None, trace=None, *, top_k: int = TOP_K, gate: Gate | None = None, on_snapshot=None, on_event=None
) -> Watcher:
    """Watch `model`'s forwards: `with kvtui.watch(model, tokenizer, trace="run.jsonl"): ...`.

    Usable without `with` in a notebook (`w = kvtui.watch(model)`, later `w.detach()`); `w.last` is the
    newest StepSnapshot and `w.diagnostics` every alarm so far."""
    watcher = Watcher(
        tokenizer=tokenizer, trace=trace, top_k=top_k, gate=gate, on_snapshot=on_snapshot, on_event=on_event
    )
    return watcher.attach(model)


class AutoAttach:
    """Watch every causal LM the program builds (`kvtui watch SCRIPT`): hooks model construction and
    tokenizer loading, for as long as it is installed."""

    def __init__(self, watcher: Watcher):
        self.watcher = watcher
        self._undo: list[Callable[[], None]] = []

    def install(self) -> AutoAttach:
        return self.install_models().install_tokenizers()

    def install_models(self) -> AutoAttach:
        from transformers import PreTrainedModel

        watcher = self.watcher
        post_init = PreTrainedModel.post_init

        def watched_post_init(model, *args, **kwargs):
            result = post_init(model, *args, **kwargs)
            if _is_causal_lm(model):
                try:
                    watcher.attach(model)
                except WatchRefused as exc:  # one line, and the program runs on with that model unwatched
                    if str(exc) not in watcher.refused:
                        watcher.refused.append(str(exc))
                        print(f"kvtui watch: not watching this model: {exc}", file=sys.stderr, flush=True)
            return result

        PreTrainedModel.post_init = watched_post_init
        self._undo.append(lambda: setattr(PreTrainedModel, "post_init", post_init))
        return self

    def install_tokenizers(self) -> AutoAttach:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase

        watcher = self.watcher
        loader = PreTrainedTokenizerBase.__dict__["from_pretrained"]  # a classmethod object

        def from_pretrained(cls, *args, **kwargs):
            tokenizer = loader.__func__(cls, *args, **kwargs)
            _TOKENIZERS.remember(tokenizer)
            for probe in watcher.probes:
                own = getattr(tokenizer, "name_or_path", None) == probe.name
                if not own and watcher.tokenizer is not None:
                    continue
                with watcher._lock:  # the builder picks it up at the next forward (pieces are kept per tokenizer)
                    if own:  # loaded after its model (the usual order): that model's ids are read with it
                        probe.tokenizer = tokenizer
                    if watcher.tokenizer is None:
                        watcher.tokenizer = tokenizer
                _TOKENIZERS.watch(tokenizer, watcher)
            return tokenizer

        PreTrainedTokenizerBase.from_pretrained = classmethod(from_pretrained)
        self._undo.append(lambda: setattr(PreTrainedTokenizerBase, "from_pretrained", loader))
        return self

    def uninstall(self) -> None:
        while self._undo:
            self._undo.pop()()


def run_watched(watcher: Watcher, target: str, args: list[str], module: bool = False) -> tuple[int, list[str]]:
    """Run a program (script or module) with every causal LM it builds watched by `watcher`; the patches are
    gone afterwards. Returns (the program's exit code, "name (Class)" of each model it watched)."""
    from .program import run_program

    attach = AutoAttach(watcher).install()
    try:
        code = run_program(target, args, module=module)
    finally:
        attach.uninstall()
        models = [f"{p.name} ({p.class_name})" for p in watcher.probes]
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
    except Exception:  # noqa: BLE001  a model whose can_generate() fails: treated as a causal LM
        return True
