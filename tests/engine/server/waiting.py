"""One wait for the server tests: until a condition holds (polled), never a sleep that guards an outcome; and one
subscriber thread started and stopped around a test's publishing (`following`)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from kvtui.engine.server.prefix_cache import PrefixCache
from kvtui.engine.server.subscriber import EventEndpoint, Subscriber


def wait_for(condition: Callable[[], object], timeout: float = 15.0) -> bool:
    """Whether `condition()` held within `timeout` seconds (asked every 20 ms)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return False


@contextmanager
def following(
    cache: PrefixCache, endpoints: Sequence[EventEndpoint], publishers: Sequence, problems: list
) -> Iterator[Subscriber]:
    """A Subscriber of `endpoints` into `cache` on its own thread, connected and subscribed at every publisher (a SUB
    socket's subscription reaches the PUB side a moment after connecting) when the block starts; stopped and joined
    when it ends, whatever happened. Problems it reports go to `problems`."""
    subscriber = Subscriber(list(endpoints), cache, on_problem=problems.append)
    thread = threading.Thread(target=subscriber.run, daemon=True)
    thread.start()
    try:
        assert subscriber.connected.wait(5)
        assert all(publisher.wait_subscribed() for publisher in publishers)
        yield subscriber
    finally:
        subscriber.stop.set()
        thread.join(5)
