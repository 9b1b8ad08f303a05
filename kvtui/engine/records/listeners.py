"""A subscriber list: the callbacks of one event, called in the order they were added.

A session's `on_snapshot` and `on_event` are `Listeners`: the recorder, the engine process, the headless
runner and a benchmark's stamp each add their own, so a second subscriber never replaces the first.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, ParamSpec

P = ParamSpec("P")


class Listeners(Generic[P]):
    """Callbacks taking the same arguments; calling the list calls each of them, in order."""

    def __init__(self) -> None:
        self._callbacks: list[Callable[P, object]] = []

    def add(self, callback: Callable[P, object], *, first: bool = False) -> Callable[P, object]:
        """Subscribe `callback` (last, or `first` to run before the others); returns it, for `remove`."""
        if first:
            self._callbacks.insert(0, callback)
        else:
            self._callbacks.append(callback)
        return callback

    def remove(self, callback: Callable[P, object]) -> None:
        """Unsubscribe `callback` (its first subscription); one that is not subscribed is ignored."""
        try:
            self._callbacks.remove(callback)
        except ValueError:
            pass

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> None:
        for callback in tuple(self._callbacks):  # a callback may unsubscribe itself or another one
            callback(*args, **kwargs)

    def __len__(self) -> int:
        return len(self._callbacks)

    def __iter__(self) -> Iterator[Callable[P, object]]:
        return iter(tuple(self._callbacks))
