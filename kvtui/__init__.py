"""kvtui: a terminal inspector for the live KV cache of Hugging Face transformers models."""

from ._version import __version__  # noqa: F401  (one place, read by the engine too)
from .notebook_hook import register_formatters as _register_formatters

DISPLAYS = (None, "live")


def watch(model, tokenizer=None, trace=None, *, display=None, **options):
    """Watch a model's forwards from your own code: `with kvtui.watch(model, tokenizer, trace="run.jsonl"): ...`
    (see kvtui.engine.watch.probe.watch). Imported lazily: `import kvtui` stays free of torch.

    In a notebook the handle shows itself (the newest step, every alarm); `display="live"` also draws one output
    per cell that follows the model while generate() or a loop runs, a few times a second (kvtui.notebook)."""
    if display not in DISPLAYS:
        raise ValueError(f"display must be None or 'live', not {display!r}")
    live = None
    if display == "live":
        from .notebook import LiveDisplay

        live = LiveDisplay()
        user_callback = options.pop("on_snapshot", None)
        if user_callback is None:
            options["on_snapshot"] = live
        else:

            def both(snapshot, _user=user_callback, _live=live):
                _user(snapshot)
                _live(snapshot)

            options["on_snapshot"] = both
    from .engine.watch.probe import watch as _watch

    watcher = _watch(model, tokenizer, trace, **options)
    if live is not None:
        live.bind(watcher)
    return watcher


def replay(path):
    """A recorded trace, every step rebuilt (engine.records.replay.Replay); in a notebook it shows its last step."""
    from .engine.records.replay import Replay
    from .engine.records.trace import read_trace

    return Replay(read_trace(path))


_register_formatters()
