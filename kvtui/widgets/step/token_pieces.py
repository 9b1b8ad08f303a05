"""How a token is shown where it is not a character on its own (pure: no Textual, shared by the buffer, cursor and
top-k panes and the notebook).

A token is bytes. Where its decoded piece is not its bytes (a snapshot's `token_bytes`: a character split across
tokens by byte-level BPE or SentencePiece byte fallback), a run of tokens is read as bytes: a character is drawn
once, on the token where its first byte is, and every other token that holds some of its bytes shows
CONTINUED; bytes that make no character in the run are shown as bytes, `⟨e4 bd⟩`, never as U+FFFD. Every other
token is its piece, as `fmt.token_text` shows it (special tokens, whitespace and control characters unchanged).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ...engine.records.snapshot import BufferToken
from ...engine.records.token_bytes import hex_bytes, valid_utf8
from ...fmt import token_text

CONTINUED = "⋯"  # this token holds the rest of a character drawn on an earlier token
MAX_CHAR = 4  # bytes of the longest UTF-8 character: the most tokens one character can span


def char_length(lead: int) -> int:
    """The bytes of the UTF-8 character this byte begins (0: it begins none)."""
    if lead < 0x80:
        return 1
    if 0xC2 <= lead <= 0xDF:
        return 2
    if 0xE0 <= lead <= 0xEF:
        return 3
    if 0xF0 <= lead <= 0xF4:
        return 4
    return 0


def _labels_of_run(runs: list[bytes]) -> list[str]:
    """One label per token of a run of token bytes: the characters that begin in it (CONTINUED first where it
    holds the end of a character begun before it), bytes that make no character as `⟨..⟩`."""
    owner = [i for i, data in enumerate(runs) for _ in data]
    data = b"".join(runs)
    parts: list[list[tuple[bool, bytearray]]] = [[] for _ in runs]
    continued = [False] * len(runs)

    def add(index: int, is_text: bool, chunk: bytes) -> None:
        if parts[index] and parts[index][-1][0] == is_text:
            parts[index][-1][1].extend(chunk)
        else:
            parts[index].append((is_text, bytearray(chunk)))

    at = 0
    while at < len(data):
        size = char_length(data[at])
        chunk = data[at : at + size] if size else b""
        if size and len(chunk) == size and valid_utf8(chunk):
            first = owner[at]
            add(first, True, chunk)
            for later in range(first + 1, owner[at + size - 1] + 1):
                continued[later] = True
            at += size
        else:
            add(owner[at], False, data[at : at + 1])
            at += 1
    labels = []
    for index, found in enumerate(parts):
        shown = "".join(
            token_text(bytes(chunk).decode()) if is_text else hex_bytes(bytes(chunk)) for is_text, chunk in found
        )
        labels.append((CONTINUED if continued[index] else "") + shown if found or continued[index] else "∅")
    return labels


def piece_labels(buffer: Sequence[BufferToken], start: int, stop: int, table: Mapping[int, bytes]) -> list[str]:
    """The labels of tokens `start..stop-1` of a buffer. O(stop - start): the run read around them is at most
    MAX_CHAR - 1 tokens wider on each side (where a character they hold part of can begin or end)."""
    tokens = [buffer[i] for i in range(start, stop)]
    if not table or not any(t.id in table for t in tokens):
        return [token_text(t.piece) for t in tokens]
    lo, hi = max(0, start - (MAX_CHAR - 1)), min(len(buffer), stop + MAX_CHAR - 1)
    window = [buffer[i] for i in range(lo, hi)]
    exact = [table.get(t.id) for t in window]
    # a token whose piece is its bytes breaks no character: it keeps its own label (specials, whitespace as today)
    runs = [t.piece.encode() if data is None else data for t, data in zip(window, exact)]
    labels = _labels_of_run(runs)
    return [labels[i - lo] if exact[i - lo] is not None else token_text(buffer[i].piece) for i in range(start, stop)]


def token_label(token_id: int, piece: str, table: Mapping[int, bytes]) -> str:
    """One token on its own (a top-k candidate, a pending token): its piece, or its bytes where they are no
    character on their own (`⟨e4 bd⟩`); a token that begins with whole characters shows them, its stray bytes
    as bytes."""
    data = table.get(token_id)
    if data is None:
        return token_text(piece)
    return _labels_of_run([data])[0]


def bytes_note(token_id: int, table: Mapping[int, bytes]) -> str | None:
    """`⟨e4 bd⟩`: a token's bytes where its piece is not them (None: its piece is its bytes)."""
    data = table.get(token_id)
    return None if data is None else hex_bytes(data)


def completed_by(first: int, piece: str, then: int, then_piece: str, table: Mapping[int, bytes]) -> str | None:
    """What a token that begins a character becomes when `then` follows it (None: it is whole, or `then` does
    not complete it)."""
    data = table.get(first)
    if data is None or valid_utf8(data):
        return None
    both = data + table.get(then, then_piece.encode())
    text = both.decode("utf-8", errors="replace")
    return None if "\ufffd" in text else text


def open_character(buffer: Sequence[BufferToken], table: Mapping[int, bytes]) -> bytes:
    """The bytes of a character the buffer ends inside of (a token that begins it, the next not fed yet), or
    b"". Reads at most MAX_CHAR - 1 tokens."""
    count = len(buffer)
    tail = b"".join(table.get(t.id, t.piece.encode()) for t in (buffer[i] for i in range(max(0, count - 3), count)))
    lead = max((i for i, byte in enumerate(tail) if byte & 0xC0 != 0x80), default=None)
    if lead is None:
        return b""
    size = char_length(tail[lead])
    begun = tail[lead:]
    return begun if size > len(begun) else b""
