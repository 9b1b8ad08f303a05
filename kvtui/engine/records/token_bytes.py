"""A token is bytes: what each id is as bytes, and the text of a run of tokens rebuilt from them.

Byte-level BPE (GPT-2, SmolLM2, Llama 3, Qwen) and SentencePiece's byte fallback split one character (CJK, an
emoji, an accented letter) across tokens; each piece decoded alone is U+FFFD. The decoded piece stays the
display text of a token; where it is not the token's exact bytes (`piece.encode() != bytes`), the bytes are kept
beside it in a table `{id: bytes}` (a snapshot's `token_bytes`, a trace's `"bytes"` field), so that the text of
any run of tokens is `run_text(...)`: the bytes joined, then decoded once. Nothing here imports a tokenizer
library: a tokenizer is read through the methods transformers' tokenizers have.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import compress, repeat

TokenBytes = Mapping[int, bytes]  # id -> its bytes, for the ids whose decoded piece is not exact
_FALLBACK_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_table() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted: the printable character a byte-level vocab writes for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


BYTE_OF_CHAR = _byte_level_table()


def decoder_kind(tokenizer) -> str:
    """How the tokenizer's vocab spells bytes: "byte-level" (GPT-2's table), "byte-fallback" (SentencePiece:
    `<0xE4>` pieces, '▁' for a space) or "text" (the decoded piece is all there is). Read once per tokenizer
    from its backend's decoder."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    try:
        decoder = json.loads(backend.to_str()).get("decoder") if backend is not None else None
    except Exception:  # noqa: BLE001  a backend that cannot describe itself: text only
        decoder = None
    found = json.dumps(decoder or {})
    if '"ByteLevel"' in found:
        return "byte-level"
    if '"ByteFallback"' in found:
        return "byte-fallback"
    return "text"


def raw_token(tokenizer, token_id: int) -> str | None:
    """The vocab's own spelling of a token (`convert_ids_to_tokens`), None for an id the tokenizer does not have."""
    try:
        found = tokenizer.convert_ids_to_tokens(token_id)
    except Exception:  # noqa: BLE001  a tokenizer without this id's token
        return None
    return found if isinstance(found, str) else None


def tokenizer_bytes(tokenizer) -> Callable[[dict[int, str]], dict[int, bytes]]:
    """`inexact(found)`: of the ids just decoded (`{id: piece}`), those whose piece is not their bytes, with their
    bytes (special and added tokens: their text, never listed). Called once per batch of new ids (TokenTexts
    keeps the answer): for a byte-level vocab only the pieces holding U+FFFD are looked at, found in C, so
    learning whole-character tokens costs no Python line per id (benchmarks/b_work.py counts them)."""
    kind = decoder_kind(tokenizer) if tokenizer is not None else "text"
    added = set(getattr(tokenizer, "added_tokens_decoder", None) or ()) | set(
        getattr(tokenizer, "all_special_ids", None) or ()
    )

    def byte_level_bytes(token_id: int) -> bytes | None:
        raw = raw_token(tokenizer, token_id)
        if raw is not None and BYTE_OF_CHAR.keys() >= set(raw):
            return bytes(map(BYTE_OF_CHAR.__getitem__, raw))  # char by char, in C
        return None  # no such token, or not spelled in the byte table (added to the vocab): its piece is its text

    def fallback_bytes(token_id: int) -> bytes | None:
        raw = raw_token(tokenizer, token_id)
        if raw is None:  # an id the tokenizer does not have: its piece is all there is
            return None
        fallback = _FALLBACK_BYTE.fullmatch(raw)
        return bytes([int(fallback.group(1), 16)]) if fallback else raw.replace("\u2581", " ").encode()

    exact_bytes = byte_level_bytes if kind == "byte-level" else fallback_bytes

    def inexact(found: dict[int, str]) -> dict[int, bytes]:
        ids: Iterable[int] = found
        if kind == "byte-level":  # a byte-level piece is its bytes unless they are no whole character (U+FFFD)
            ids = list(compress(found, map(str.__contains__, found.values(), repeat("\ufffd"))))
            if not ids:  # (most new tokens)
                return {}
        elif kind == "text":
            return {}
        out = {}
        for token_id in ids:
            exact = None if token_id in added else exact_bytes(token_id)
            if exact is not None and exact != found[token_id].encode():
                out[token_id] = exact
        return out

    return inexact


def token_bytes(token_id: int, piece: str, table: TokenBytes) -> bytes:
    """One token's bytes: from the table where its piece is not exact, else its piece's UTF-8."""
    found = table.get(token_id)
    return found if found is not None else piece.encode()


def run_bytes(tokens: Iterable[tuple[int, str]], table: TokenBytes) -> bytes:
    """The bytes of a run of (id, piece) tokens, in order."""
    return b"".join(token_bytes(i, piece, table) for i, piece in tokens)


def run_text(tokens: Iterable[tuple[int, str]], table: TokenBytes) -> str:
    """The text of a run of (id, piece) tokens: their bytes joined, decoded once (a character split across
    tokens comes back whole; bytes that never complete a character stay U+FFFD, as tokenizer.decode gives)."""
    return run_bytes(tokens, table).decode("utf-8", errors="replace")


def unfinished_tail(buffer: Sequence, table: TokenBytes) -> bytes:
    """The bytes a token buffer (its tokens' `id` and `piece`) ends on that begin a character whose rest is not
    there yet (a reply generated into the middle of an emoji, or cut there by its token limit); b"" when it ends
    on a whole character. Such a beginning is at most 3 bytes, so its last 3 tokens hold it. A decoder of the
    joined bytes shows this tail as one U+FFFD."""
    return _unfinished(run_bytes(((t.id, t.piece) for t in buffer[-3:]), table))


def _unfinished(data: bytes) -> bytes:
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    decoder.decode(data, final=False)
    return decoder.getstate()[0]  # what it holds back, waiting for the rest of a character


def shown_text(data: bytes) -> str:
    """Bytes generated so far as a pane shows them: decoded, a character not complete yet at the end as its
    bytes (`🌟⟨f0 9f⟩`)."""
    return ending_on(data.decode("utf-8", errors="replace"), _unfinished(data[-3:]))


def ending_on(text: str, unfinished: bytes) -> str:
    """`text`, decoded from tokens the cache ends on, with the U+FFFD its decoder gave their `unfinished` tail (one
    for Python's and byte-level BPE's decode, one per byte for SentencePiece's byte fallback) shown as those bytes,
    `⟨f0 9f⟩`; as it is when the cache ends on a whole character or the text does not end on U+FFFD."""
    if not unfinished or not text.endswith("\ufffd"):
        return text
    cut = max(0, len(text) - len(unfinished))
    return text[:cut] + text[cut:].rstrip("\ufffd") + hex_bytes(unfinished)


def valid_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def hex_bytes(data: bytes) -> str:
    """`⟨e4 bd⟩`: bytes as a person reads them, for a token that is no character on its own."""
    return "⟨" + data.hex(" ") + "⟩"


def bytes_record(ids: Iterable[int], table: TokenBytes) -> dict[str, str]:
    """The trace's `"bytes"` field: `{"id": "hex"}` for the given ids whose piece is not exact (empty: none)."""
    found = set(ids).intersection(table)
    return dict(zip(map(str, found), map(bytes.hex, map(table.__getitem__, found))))  # in C: no line per id


def learn_bytes(record: Mapping | None, table: dict[int, bytes]) -> None:
    """Add a record's `"bytes"` field (absent in traces written before it) to a reader's table."""
    if record:
        table.update({int(k): bytes.fromhex(v) for k, v in record.items()})
