"""Faults and slow-downs for the engine process. The app pickles these (by reference) into the engine's
setup, and the engine process imports this module from the test's import path: module-level only."""

from __future__ import annotations

import os
import time
from functools import partial


def _fail_once(action: str, message: str, session) -> None:
    if action == "export":  # the engine looks export_cache up at call time
        import kvtui.engine.reading.export as module

        owner, name = module, "export_cache"
        error = OSError(message)
    else:
        owner, name = session, action
        error = RuntimeError(message)
    real = getattr(owner, name)

    def broken(*args, **kwargs):
        setattr(owner, name, real)  # one failure, then the real thing again
        raise error

    setattr(owner, name, broken)


def fail_once(action: str, message: str):
    """engine_setup: the next call of session.<action> (or export_cache) raises, the ones after work."""
    return partial(_fail_once, action, message)


def broken_load():
    """loader: an exception nobody foresaw."""
    raise RuntimeError("disk on fire")


def _gated_load(gate: str, model_dir: str):
    from kvtui.engine.chat.loader import load_model

    deadline = time.monotonic() + 60
    while not os.path.exists(gate) and time.monotonic() < deadline:
        time.sleep(0.02)
    return load_model(model_dir, dtype="float32", device="cpu")


def gated_load(gate, model_dir):
    """loader: waits until the file `gate` exists (the test opens it), then loads the tiny model."""
    return partial(_gated_load, str(gate), str(model_dir))


class _SlowModel:
    """The forward takes 300 ms more of wall time (sleeping: no CPU of its own)."""

    def __init__(self, model):
        self._model = model

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __call__(self, **kwargs):
        time.sleep(0.3)
        return self._model(**kwargs)


def slow_first_forward(session) -> None:
    """engine_setup: the first forward (the prefill) sleeps 300 ms, the later ones do not."""
    real = session.model

    class Once(_SlowModel):
        def __call__(self, **kwargs):
            session.model = real
            return super().__call__(**kwargs)

    session.model = Once(real)


def _die_on_step(how: str, marker: str, session) -> None:
    if os.path.exists(marker):  # a restarted engine: the fault happened already
        return

    def dying(*args, **kwargs):
        open(marker, "w").close()
        if how == "kill":  # as the out-of-memory killer would
            os.kill(os.getpid(), __import__("signal").SIGKILL)
        print("fatal: simulated crash in the engine", file=__import__("sys").stderr, flush=True)
        os._exit(3)  # no cleanup, no answer: the process is simply gone

    session.step = dying


def die_on_step(how: str, marker):
    """engine_setup: the first engine process dies at its next step ("kill": SIGKILL; "exit": code 3 after
    a line on stderr). `marker` (a file) tells a restarted engine that it already happened."""
    return partial(_die_on_step, how, str(marker))
