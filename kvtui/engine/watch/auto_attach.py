"""Watching a whole program: `AutoAttach` watches every causal LM it builds and every tokenizer it loads,
made when the program first imports transformers (deferred.py: `run_deferred`, `run_watched`)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from .hooks import WatchRefused
from .tokenizers import TOKENIZERS

# a probe.Watcher: probe imports this module, so naming its class here (even for type checking) is an import
# circle, which the package contract forbids
AnyWatcher = Any


class AutoAttach:
    """Watch every causal LM the program builds (`kvtui watch SCRIPT`): hooks model construction and
    tokenizer loading, for as long as it is installed."""

    def __init__(self, watcher: AnyWatcher):
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
            TOKENIZERS.remember(tokenizer)
            for probe in watcher.probes:
                own = getattr(tokenizer, "name_or_path", None) == probe.name
                if not own and watcher.tokenizer is not None:
                    continue
                with watcher.lock:  # the builder picks it up at the next forward (pieces are kept per tokenizer)
                    if own:  # loaded after its model (the usual order): that model's ids are read with it
                        probe.tokenizer = tokenizer
                    if watcher.tokenizer is None:
                        watcher.tokenizer = tokenizer
                TOKENIZERS.watch(tokenizer, watcher)
            return tokenizer

        PreTrainedTokenizerBase.from_pretrained = classmethod(from_pretrained)
        self._undo.append(lambda: setattr(PreTrainedTokenizerBase, "from_pretrained", loader))
        return self

    def uninstall(self) -> None:
        while self._undo:
            self._undo.pop()()


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
