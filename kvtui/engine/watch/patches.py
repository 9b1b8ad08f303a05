"""The only place the probe changes a class: every patch lives on a class (never on the user's objects),
looks the instance up in kvtui's own registries, and is removed when the last watcher lets it go.

Why classes and not instances: anything stored on an instance (a bound wrapper in a cache's `__dict__`, a
hook in a model's `_forward_pre_hooks`) travels with `copy.deepcopy`, `copy.copy`, pickle and
`torch.save`, still bound to the original object, and survives `detach()` on every copy. A class-level
function that finds nothing for an instance in the registry calls the original at once: copies, objects
made before attaching and unwatched objects run exactly as unpatched. Under `torch.compile` tracing every
patch is the original (`torch.compiler.is_compiling()`), so a compiled graph never contains kvtui.

A patch on a class that only inherits the attribute is deleted on restore (the class's `__dict__` is as
it was); one that replaced the class's own attribute puts it back.
"""

from __future__ import annotations

import copy
import copyreg
import functools
import threading
import weakref
from collections.abc import Callable
from typing import Generic, TypeVar

import torch

_MISSING = object()
V = TypeVar("V")  # a Registry's values


def _not_compiling() -> bool:  # older torch: no torch.compiler
    return False


# whether torch.compile is tracing the caller: torch's own function, called directly (no frame of kvtui's per patch)
compiling: Callable[[], bool] = getattr(getattr(torch, "compiler", None), "is_compiling", None) or _not_compiling


class ClassPatches:
    """Refcounted class patches: `acquire(user, cls, name, make)` installs `make(original)` as
    `cls.name` unless it is installed already; `release(user)` drops what that user acquired and
    restores a class attribute when nobody needs it any more."""

    def __init__(self):
        self._lock = threading.RLock()
        self._installed: dict[tuple[type, str], tuple[object, object, set[int]]] = {}  # -> (own, patch, users)

    def acquire(self, user: object, cls: type, name: str, make: Callable[[object], object]) -> None:
        with self._lock:
            key = (cls, name)
            entry = self._installed.get(key)
            if entry is None:
                own = cls.__dict__.get(name, _MISSING)
                original = getattr(cls, name, None)
                if isinstance(own, (staticmethod, classmethod)):
                    raise TypeError(f"{cls.__name__}.{name} is not an instance method")
                patch = make(original)
                setattr(cls, name, patch)
                entry = (own, patch, set())
                self._installed[key] = entry
            entry[2].add(id(user))

    def release(self, user: object) -> None:
        with self._lock:
            for key, (own, patch, users) in list(self._installed.items()):
                users.discard(id(user))
                if users:
                    continue
                cls, name = key
                if cls.__dict__.get(name) is patch:
                    if own is _MISSING:
                        delattr(cls, name)
                    else:
                        setattr(cls, name, own)
                del self._installed[key]

    def installed(self) -> list[tuple[type, str]]:
        with self._lock:
            return list(self._installed)


PATCHES = ClassPatches()


def defining_class(cls: type, name: str) -> type | None:
    """The class in `cls`'s MRO whose own `__dict__` holds `name` (where a patch must go so that every
    instance that resolves to it is covered), or None."""
    for klass in cls.__mro__:
        if name in klass.__dict__:
            return klass
    return None


# ---- the wrappers -------------------------------------------------------------------------------------


class Registry(Generic[V]):
    """Objects kvtui watches, by identity, without touching them: id -> (weak ref, value). A dead or
    reused id never matches: a live object's entry leaves as it dies (`get`, `by_id`, `values` read only those)."""

    def __init__(self):
        self._items: dict[int, tuple[weakref.ref, V]] = {}
        # id -> value of the live objects only: an entry goes in its object's weak-ref callback, which CPython runs
        # as the object is freed, before its id can be another object's. `by_id(id(obj))` is a dict lookup in C,
        # for the wrappers every watched forward goes through
        self._live: dict[int, V] = {}
        self.by_id: Callable[[int], V | None] = self._live.get

    def add(self, obj, value: V, on_dead: Callable[[], None] | None = None) -> None:
        """`on_dead`: called when obj is collected (it must only let go of what the value holds)."""
        key = id(obj)

        def dead(ref: weakref.ref) -> None:
            entry = self._items.get(key)
            if entry is None or entry[0] is ref:  # its own entry (or pruned already), not one a later object made
                self._live.pop(key, None)
            if on_dead is not None:
                on_dead()

        self._items[key] = (weakref.ref(obj, dead), value)
        self._live[key] = value

    def get(self, obj) -> V | None:
        return self._live.get(id(obj))

    def discard(self, obj, value: object = None) -> None:
        """Forget obj; with `value`, only while its entry still holds that value (not one added after it)."""
        entry = self._items.get(id(obj))
        if entry is not None and entry[0]() is obj and (value is None or entry[1] is value):
            del self._items[id(obj)]
            self._live.pop(id(obj), None)

    def prune(self) -> list[V]:
        """Forget dead objects; return their values."""
        dead = [key for key, (ref, _) in self._items.items() if ref() is None]
        return [self._items.pop(key)[1] for key in dead]

    def values(self) -> list[V]:
        return list(self._live.values())

    def clear(self) -> None:
        self._items.clear()
        self._live.clear()

    def __len__(self) -> int:
        return len(self._items)


PASS = object()  # what a `before` returns for a call it leaves alone (a model's decoder inside its own forward)


def call_wrapper(registry: Registry, before: Callable, after: Callable):
    """`__call__` of a model class: `before(handler, module, args, kwargs) -> token` and
    `after(handler, token, output_or_None)` around the original, for the instances in `registry` only (and no
    `after` when `before` returned PASS)."""
    lookup = registry.by_id

    def make(original):
        @functools.wraps(original)
        def __call__(self, *args, **kwargs):
            handler = lookup(id(self))
            if handler is None or compiling():
                return original(self, *args, **kwargs)
            token = before(handler, self, args, kwargs)
            if token is PASS:
                return original(self, *args, **kwargs)
            try:
                output = original(self, *args, **kwargs)
            except BaseException:
                after(handler, token, None)
                raise
            after(handler, token, output)
            return output

        return __call__

    return make


def peek_wrapper(registry: Registry, seen: Callable):
    """`__call__` of a submodule whose input kvtui reads (rotary / position embedding): `seen(handler,
    args, kwargs)` then the original, for the instances in `registry`."""
    lookup = registry.by_id

    def make(original):
        @functools.wraps(original)
        def __call__(self, *args, **kwargs):
            handler = lookup(id(self))
            if handler is not None and not compiling():
                seen(handler, args, kwargs)
            return original(self, *args, **kwargs)

        return __call__

    return make


_EDITING = threading.local()


def edit_wrapper(name: str, lookup: Callable[[object], object], before: Callable, after: Callable):
    """A cache's own edit method (crop, reset, reorder_cache, ...): `before(handler, cache, name, args) -> token`,
    the original (called from this frame: a traceback through it shows one frame of kvtui's), then
    `after(handler, token, cache, name, args)` follows what it did. Re-entrant calls (an edit method calling
    another on the same cache) are the outer call's business."""

    def make(original):
        @functools.wraps(original)
        def wrapper(self, *args, **kwargs):
            handler = lookup(self)
            active = getattr(_EDITING, "caches", None)
            if handler is None or compiling() or (active and id(self) in active):
                return original(self, *args, **kwargs)
            if active is None:
                active = _EDITING.caches = set()
            token = before(handler, self, name, args)
            active.add(id(self))
            try:
                result = original(self, *args, **kwargs)
            finally:
                active.discard(id(self))
            after(handler, token, self, name, args)
            return result

        return wrapper

    return make


def default_copy(obj, memo: dict | None = None):
    """What `copy.deepcopy` (a memo) or `copy.copy` (none) does for an object without `__deepcopy__` /
    `__copy__`: copy's own steps, in order."""
    reductor = copyreg.dispatch_table.get(type(obj))
    rv = reductor(obj) if reductor is not None else obj.__reduce_ex__(4)
    if isinstance(rv, str):
        return obj
    return copy._reconstruct(obj, memo, *rv)  # type: ignore[attr-defined]  # copy's own (private) last step


def copy_wrappers(lookup: Callable[[object], object], copied: Callable):
    """`__deepcopy__` / `__copy__` for a cache class: the copy is made exactly as copy would make it,
    then `copied(handler, original, copy, how)` gives it its parent's history."""

    def make_deep(original):
        def __deepcopy__(self, memo):
            result = original(self, memo) if original is not _DEFAULT else default_copy(self, memo)
            handler = lookup(self)
            if handler is not None and result is not self:
                copied(handler, self, result, "deepcopy")
            return result

        return __deepcopy__

    def make_shallow(original):
        def __copy__(self):
            result = original(self) if original is not _DEFAULT else default_copy(self)
            handler = lookup(self)
            if handler is not None and result is not self:
                copied(handler, self, result, "copy")
            return result

        return __copy__

    return make_deep, make_shallow


_DEFAULT = object()


def _over_default(make: Callable[[object], object]) -> Callable[[object], object]:
    """A `make` for a class without its own method: the wrapper runs copy's default instead."""
    return lambda _original: make(_DEFAULT)


def acquire_copy_patches(user, cls: type, lookup, copied) -> None:
    """Patch `cls`'s copy protocol where it is defined, or add it to `cls` when copy's default applies."""
    make_deep, make_shallow = copy_wrappers(lookup, copied)
    for name, make in (("__deepcopy__", make_deep), ("__copy__", make_shallow)):
        owner = defining_class(cls, name)
        if owner is None or owner is object:
            PATCHES.acquire(user, cls, name, _over_default(make))
        else:
            PATCHES.acquire(user, owner, name, make)


# ---- threads ------------------------------------------------------------------------------------------

_THREAD_STARTS: weakref.WeakKeyDictionary[threading.Thread, str] = weakref.WeakKeyDictionary()


def thread_start_wrapper(where: Callable[[], str]):
    """`threading.Thread.start`: remember the program line that started each thread (while watching)."""

    def make(original):
        @functools.wraps(original)
        def start(self, *args, **kwargs):
            try:
                _THREAD_STARTS[self] = where()
            except Exception:  # noqa: BLE001  never break the program
                pass
            return original(self, *args, **kwargs)

        return start

    return make


def started_at(thread: threading.Thread) -> str | None:
    return _THREAD_STARTS.get(thread)


def update_wrapper(lookup: Callable[[object], dict | None]):
    """A cache's `update(key_states, value_states, layer_idx, ...)`: for a registered cache, the K/V the layer
    returns (its whole K/V after the write, before anything inside the forward changes it) are kept by reference
    in the registered dict (layer index -> (K, V)); no copy, nothing stored on the cache."""

    def make(original):
        @functools.wraps(original)
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            out = original(self, key_states, value_states, layer_idx, *args, **kwargs)
            written = lookup(self)
            if written is not None and not compiling():
                written[layer_idx] = out
            return out

        return update

    return make
