"""kvtui: a terminal inspector for the live KV cache of Hugging Face transformers models."""

from ._version import __version__  # noqa: F401  (one place, read by the engine too)


def watch(model, tokenizer=None, trace=None, **options):
    """Watch a model's forwards from your own code: `with kvtui.watch(model, tokenizer, trace="run.jsonl"): ...`
    (see kvtui.engine.probe.watch). Imported lazily: `import kvtui` stays free of torch."""
    from .engine.probe import watch as _watch

    return _watch(model, tokenizer, trace, **options)
