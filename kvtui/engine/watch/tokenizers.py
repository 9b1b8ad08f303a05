"""The program's tokenizers: those it loaded (to decode a model's ids) and the calls of watched ones (which
ids a call added, and which rendering a fed slice came from)."""

from __future__ import annotations

import functools
import os
import threading
import weakref
from typing import Any

import torch

from ..reading.tokens import find_sub
from .patches import PATCHES, Registry, compiling, defining_class

# a probe.Watcher: probe imports this module, so naming its class here (even for type checking) is an import
# circle, which the package contract forbids
AnyWatcher = Any

_TOKENIZING = threading.local()  # depth of watched tokenizer calls on this thread: only the outermost counts


class TokenizerRegistry:
    """Tokenizers the program loaded (to find pieces), and the calls of watched ones (to find what the
    tokenizer added and which rendering a fed slice came from): `__call__`, `encode` and
    `apply_chat_template`, patched on the class while anything is watched."""

    ENTRY_POINTS = ("__call__", "encode", "apply_chat_template")

    def __init__(self):
        self.loaded: list = []  # weak refs, newest last
        self._watchers: Registry[list[AnyWatcher]] = Registry()  # tokenizer -> [watchers]

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

    def watch(self, tokenizer, watcher: AnyWatcher) -> None:
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

    def unwatch(self, watcher: AnyWatcher) -> None:
        for watchers in self._watchers.values():
            if watcher in watchers:
                watchers.remove(watcher)
        self._watchers.prune()
        if not any(self._watchers.values()):
            self._watchers.clear()
            PATCHES.release(self)

    def watchers_of(self, tokenizer) -> list[AnyWatcher]:
        return self._watchers.get(tokenizer) or []


def _tokenizer_wrapper(name: str, registry: TokenizerRegistry):
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


TOKENIZERS = TokenizerRegistry()
