"""A watched model's hooks: its registry entry (`Probe`, nothing stored on the model), the forwards in flight
on each thread, and the positions its rotary / position-embedding module applied."""

from __future__ import annotations

import inspect
import sys
import threading
import time
import weakref
from types import FrameType
from typing import Any, Protocol

import torch

from ..reading import introspect
from ..reading.attention import AttentionCapture
from .callers import GENERATE_CODES
from .patches import PASS, PATCHES, Registry, call_wrapper, defining_class, peek_wrapper
from .watch_step import Call


class WatcherHooks(Protocol):
    """What the class patches' hooks (here, auto_attach, packed_step) call on the watcher a model is registered
    with: probe.Watcher is the one implementation (probe imports this module, so naming its class here would be
    an import circle, which the package contract forbids). Each call may come from any thread of the program."""

    lock: threading.RLock  # held while a forward is read or built, and while its tokenizer changes
    probes: list  # the watched models' Probes, in attach order
    steps: int  # forwards made so far
    gate: Any  # watch.child's Gate (pause / step / run), or a gate that never holds
    refused: list[str]  # why a model it attached is not (or no longer) watched by it, one line each

    def begin_forward(self, probe: Probe, args: tuple, kwargs: dict, frame: FrameType | None = None) -> Call:
        """A watched model's forward starts: what it was handed, read before it runs (`frame`: the one that called
        the model, where the walk to the user's line starts)."""
        ...

    def finish_forward(self, call: Call, output: Any) -> None:
        """The forward returned (`output`; None: it raised): its step built and sent."""
        ...

    def emit(self, record: dict) -> None:
        """A record that is not a step (lineage, refusals): to the trace and to the viewer."""
        ...

    def internal_error(self, where: str, exc: BaseException) -> None:
        """kvtui's own failure inside a hook: said as a worker-error, never raised into the program."""
        ...


AnyWatcher = WatcherHooks


class Forwards(threading.local):
    """This thread's forwards: those in flight, and the generate() call it last ran one for."""

    def __init__(self):
        self.stack: list[Call | None] = []  # top-level forwards in flight on this thread (None: nested)
        # id of each generate() frame on this thread's stack that ran a forward -> its prompt (held weakly): an
        # assistant's generate() nested in the model's is a call of its own, not the start of a new outer one
        self.prompts: dict[int, weakref.ref] = {}


STATE = Forwards()
MODELS: Registry[Probe] = Registry()  # watched model -> its Probe
POSITIONS: Registry[tuple[Probe, str]] = Registry()  # position module -> (its Probe, "rotary" | "embedding")


class WatchRefused(ValueError):
    """kvtui cannot read this model's cache on the installed transformers (the message is one line)."""


class Probe:
    """One watched model: its registry entries (no hooks on the instance) and what kvtui read of it. The
    model and its modules are held weakly: a program that drops its model gets its memory back, watched
    or not."""

    def __init__(self, watcher: AnyWatcher, model, index: int):
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
        MODELS.add(model, self)
        PATCHES.acquire(watcher, type(model), "__call__", call_wrapper(MODELS, before_forward, after_forward))
        # its decoder without the LM head, called directly (kvpress's pipeline prefills with `model.model`): a
        # step of this model with no logits; inside the model's own forward it is nested, so not a step
        self._inner: weakref.ref | None = None
        inner = getattr(model, "model", None)
        if isinstance(inner, torch.nn.Module) and inner is not model and hasattr(inner, "layers"):
            self._inner = weakref.ref(inner)
            MODELS.add(inner, self)
            PATCHES.acquire(watcher, type(inner), "__call__", call_wrapper(MODELS, before_forward, after_forward))
        owner = defining_class(type(model), "generate")
        if owner is not None:
            GENERATE_CODES.add(inspect.unwrap(owner.__dict__["generate"]).__code__)
        # the newest query's attention in every layer (watch(attention=True)): kvtui's own registry, off by default
        self.attention = AttentionCapture(model) if getattr(watcher, "attention", False) else None
        # each layer's attention module (the deepest module carrying that `layer_idx`), held weakly: where a press
        # hangs its hooks and kvpress keeps the keys it masks per head (`masked_key_indices`, read by masks.py)
        attention: dict[int, torch.nn.Module] = {}
        for module in model.modules():
            layer = getattr(module, "layer_idx", None)
            if isinstance(layer, int) and module is not model:
                attention[layer] = module  # modules() is pre-order: a layer's own attention comes after the layer
        self.attention_modules = [(layer, weakref.ref(module)) for layer, module in sorted(attention.items())]
        self.attention_refs = tuple(ref for _, ref in self.attention_modules)  # for masks.py's C-level passes
        # layer -> the masked_key_indices last read (its id, its first tensor held weakly)
        self.masks_seen: dict[int, tuple] = {}
        self._position_modules = []  # (module held weakly, its POSITIONS entry)
        for module, source in position_modules(model):
            entry = (self, source)
            self._position_modules.append((weakref.ref(module), entry))
            POSITIONS.add(module, entry)
            PATCHES.acquire(watcher, type(module), "__call__", peek_wrapper(POSITIONS, saw_positions))

    def positions_read(self) -> list:
        """The live modules whose input is the positions this model applies (rotary / position embeddings)."""
        return [module for module in (ref() for ref, _ in self._position_modules) if module is not None]

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
    def tokenizer_ref(self) -> weakref.ref | None:
        """The weak reference to its own tokenizer (None: none was found): the same object while it is the same."""
        return self._tokenizer

    @property
    def label(self) -> str | None:
        """`model 1: draft` when the program runs several models (or this one drafts), else None."""
        if self.role is None and len(self.watcher.probes) < 2:
            return None
        return f"model {self.index}" + (f": {self.role}" if self.role else "")

    def detach(self) -> None:
        """Its registry entries go (a collected object's are dead already); not those of a newer watch of the same
        model, which replaced them."""
        if self.attention is not None:
            self.attention.detach()
        for ref in (self._model, self._inner):
            held = ref() if ref is not None else None
            if held is not None:
                MODELS.discard(held, self)
        for ref, entry in self._position_modules:
            held = ref()
            if held is not None:
                POSITIONS.discard(held, entry)


def before_forward(probe: Probe, module, args, kwargs):
    if STATE.stack:  # a nested call (a model inside a watched forward): the outer one is the step
        outer = STATE.stack[-1]
        if outer is not None and outer.probe is probe:  # its own decoder: the outer call reads on, nothing pushed
            return PASS
        STATE.stack.append(None)  # another model inside it: not a step, and its positions are not the outer's
        return None
    watcher = probe.watcher
    try:
        # the walk to the user's line starts at the model's caller: this frame and the class's __call__ below it
        # (patches.call_wrapper) are kvtui's own
        call = watcher.begin_forward(probe, args, kwargs, sys._getframe(2))
    except Exception as exc:  # noqa: BLE001  never break the user's program
        watcher.internal_error("before a forward", exc)
        call = None
    if call is not None:
        if watcher.gate is not None:  # may hold the program here, or raise (its ctrl+c): nothing pushed yet
            watcher.gate.before_forward(watcher)
        call.started = time.perf_counter()
    STATE.stack.append(call)  # (None returned: the forward runs, its result comes to after_forward)


def after_forward(probe: Probe, token, output) -> None:
    call = STATE.stack.pop() if STATE.stack else None
    if call is None:
        return
    try:
        probe.watcher.finish_forward(call, output)
    except Exception as exc:  # noqa: BLE001  never break the user's program
        probe.watcher.internal_error("after a forward", exc)


def saw_positions(entry, args, kwargs) -> None:
    probe, source = entry
    call = STATE.stack[-1] if STATE.stack else None  # the forward in flight on this thread (None: a nested one)
    if call is None or call.probe is not probe or call.applied is not None:
        return
    if source == "rotary":
        positions = kwargs.get("position_ids", args[1] if len(args) > 1 else None)
    else:
        positions = args[0] if args else kwargs.get("input")
    if isinstance(positions, torch.Tensor) and positions.dtype in (torch.long, torch.int, torch.int32):
        call.applied, call.positions_source = positions, source


def position_modules(model) -> list[tuple[torch.nn.Module, str]]:
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
