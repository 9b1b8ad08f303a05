"""Token ids to display text, remembered: the one token-text cache (a watched program's tokenizer, kvtui's own
chat, a server's tokenizer or its `/detokenize`). What it learned can be written to a trace, so replay needs no
tokenizer."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import partial
from itertools import compress
from operator import is_, le

from ..records.token_bytes import hex_bytes, raw_token, tokenizer_bytes
from .diagnostics import token_text

_is_none = partial(is_, None)
_non_negative = partial(le, 0)  # 0 <= id


def _unknown(token_id: int) -> str:
    """What an id no tokenizer decoded shows: `<embeds>` (-1: fed as inputs_embeds), `?` (-2: not known), `#N`."""
    return "<embeds>" if token_id == -1 else "?" if token_id < 0 else f"#{token_id}"


class TokenTexts:
    """`resolve(ids) -> {id: piece}` decodes what is missing (in one call per batch of ids): by `ensure` only (a
    server's `/detokenize`: never from a widget), or also on a `piece` of an unknown id (`lazy`: a local
    tokenizer). `raw(id)` gives a token's raw form where a piece is part of a multi-byte character. `bytes_of({id:
    piece})`: the bytes of those new ids whose piece does not spell them, kept in `token_bytes` (append-only: a
    snapshot shares it, records/token_bytes.py)."""

    def __init__(
        self,
        resolve: Callable[[list[int]], dict[int, str]] | None = None,
        special: Iterable[int] = (),
        raw: Callable[[int], str | None] | None = None,
        lazy: bool = False,
        bytes_of: Callable[[dict[int, str]], dict[int, bytes]] | None = None,
    ):
        self.pieces: dict[int, str] = {}
        self.token_bytes: dict[int, bytes] = {}  # id -> bytes where the decoded piece is not the token's bytes
        self._bytes_of = bytes_of
        self.special: set[int] = set(special)
        self.fresh: dict[int, str] = {}  # learned since the last take_fresh() (the trace writes them)
        self._labels: dict[int, str] = {}
        self._resolve = resolve
        self._raw = raw
        self._lazy = lazy

    def learn(self, pieces: dict[int, str], special: Iterable[int] = ()) -> None:
        self.pieces.update(pieces)
        self.special.update(special)
        self._labels.clear()

    def ensure(self, ids: Iterable[int]) -> None:
        if self._resolve is None:
            return
        # the ids not known yet, found in C (a set's difference with the dict's keys): asked on every event of a
        # server, where nearly all are known
        missing = sorted(i for i in set(ids).difference(self.pieces) if i >= 0)
        if missing:
            self._learn(missing)

    def _learn(self, missing: list[int]) -> None:
        """Decode these ids (none known yet, none negative), in this order, and keep what they are."""
        if missing and self._resolve is not None:
            found = self._resolve(missing)
            if self._bytes_of is not None:  # once per id, as it is decoded: never on the way of a known one
                self.token_bytes.update(self._bytes_of(found))
            self.pieces.update(found)
            self.fresh.update(found)
            self.special.update(getattr(self._resolve, "special", ()))  # a source that learns them as it goes

    def take_fresh(self) -> dict[int, str]:
        fresh, self.fresh = self.fresh, {}
        return fresh

    def piece(self, token_id: int) -> str:
        text = self.pieces.get(token_id)
        if text is None:
            if token_id >= 0 and self._lazy:
                self.ensure((token_id,))
                text = self.pieces.get(token_id)
            if text is None:
                return _unknown(token_id)
        return text

    def pieces_of(self, ids: list[int]) -> list[str]:
        """`piece` of each id, in order: the known ones found by one C-level pass over the ids (a step's top-k:
        no Python call per id), any unknown one through `piece` as before."""
        found: list = list(map(self.pieces.get, ids))  # str, or None where unknown
        if None in found:
            if self._lazy:  # the unknown ones decoded at once, in the order met (a `piece` each decoded one)
                self._learn(list(filter(_non_negative, dict.fromkeys(compress(ids, map(_is_none, found))))))
                found = list(map(self.pieces.get, ids))
            if None in found:  # an id no tokenizer decoded
                return [_unknown(i) if text is None else text for i, text in zip(ids, found)]
        return found

    def label(self, token_id: int) -> str:
        """`'piece' (id N)`, escaped; a piece that is part of a multi-byte character shows its bytes."""
        text = self._labels.get(token_id)
        if text is None:
            piece = self.piece(token_id)
            raw = None
            if "\ufffd" in piece:  # part of a character: its bytes where known, else its raw vocab token
                exact = self.token_bytes.get(token_id)
                raw = hex_bytes(exact) if exact is not None else self._raw(token_id) if self._raw else None
            text = token_text(piece, token_id, raw)
            if token_id in self.pieces:  # a label of a piece not known yet is not kept
                self._labels[token_id] = text
        return text

    def text(self, ids: Iterable[int]) -> str:
        return "".join(self.piece(i) for i in ids)


def tokenizer_texts(tokenizer) -> TokenTexts:
    """The token texts of a local tokenizer (a watched program's, kvtui's own chat's): each id decoded on its first
    `piece` (skip_special_tokens=False), a multi-byte character's part labelled by its raw token; an id the
    tokenizer cannot decode is shown by its number."""

    decode_one = partial(tokenizer.decode, skip_special_tokens=False) if tokenizer is not None else None

    def resolve(ids: list[int]) -> dict[int, str]:
        if decode_one is not None:
            try:  # each id decoded alone, by C-level maps (no Python line per id)
                return dict(zip(ids, map(decode_one, map(list, zip(ids)))))
            except Exception:  # noqa: BLE001  an id the tokenizer cannot decode: each one on its own, below
                pass
        out = {}
        for token_id in ids:
            try:
                out[token_id] = tokenizer.decode([token_id], skip_special_tokens=False) if tokenizer else f"#{token_id}"
            except Exception:  # noqa: BLE001  a tokenizer that cannot decode this id: shown by its number
                out[token_id] = f"#{token_id}"
        return out

    raw = partial(raw_token, tokenizer) if tokenizer is not None else None  # an id without one: shown by its piece
    return TokenTexts(resolve, raw=raw, lazy=True, bytes_of=tokenizer_bytes(tokenizer))
