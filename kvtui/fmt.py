"""Text for people: one small module every view uses (TUI panes, notifications, the headless summary,
`kvtui diff`). Torch-free and UI-library-free, so the engine's callers and the front ends share it.

- `printable(text)`: control characters, escape sequences and bidi overrides made visible (`\\x1b`,
  `\\u202e`), never interpreted by the terminal. Model output and user input pass through it.
- `one_line(text, limit)`: whitespace collapsed, escaped, cut with … (summary tables).
- `token_text(piece)`: one token's text on one line, the same in every pane (`↵` `→`, escapes).
- `size(n)`: bytes as `1023 B`, `1.5 KiB`, `3.0 MiB`.
- `positions(values)`: `3..7` for a run, else the numbers.
"""

from __future__ import annotations

import math
import unicodedata
from functools import lru_cache

# Bidirectional formatting characters: they reorder the rest of a terminal line.
BIDI = frozenset("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")
_SEPARATORS = frozenset("\u2028\u2029\x85")  # Unicode line/paragraph separators, NEL


def _escape(ch: str) -> str:
    code = ord(ch)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def unsafe(ch: str) -> bool:
    """A character a terminal would act on instead of showing (C0/C1 controls, DEL, bidi overrides)."""
    code = ord(ch)
    return code < 0x20 or 0x7F <= code < 0xA0 or ch in BIDI or ch in _SEPARATORS


def printable(text: object, *, newlines: bool = False) -> str:
    """`text` with every control character escaped; `newlines=True` keeps line breaks (and tabs) as they are."""
    text = str(text)
    if not any(unsafe(ch) for ch in text):
        return text
    keep = "\n\t" if newlines else ""
    return "".join(_escape(ch) if unsafe(ch) and ch not in keep else ch for ch in text)


def one_line(text: object, limit: int | None = None) -> str:
    """Whitespace runs collapsed to one space, controls escaped, cut to `limit` characters with …."""
    text = printable(" ".join(str(text).split()))
    if limit is not None and len(text) > limit:
        return text[: max(0, limit - 1)] + "…"
    return text


def size(n: int | float) -> str:
    """1023 -> '1023 B', 1536 -> '1.5 KiB', 3 MiB -> '3.0 MiB'."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def positions(values) -> str:
    """[3, 4, 5] -> '3..5'; [7] -> '7'; [] -> '-'; anything else: the numbers."""
    values = list(values)
    if not values:
        return "-"
    if values == list(range(values[0], values[0] + len(values))):
        return f"{values[0]}..{values[-1]}" if len(values) > 1 else str(values[0])
    return " ".join(map(str, values))


_VISIBLE = {"\n": "↵", "\r": "␍", "\t": "→"}
_ESCAPED_CATEGORIES = {"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"}


@lru_cache(maxsize=16384)
def token_text(piece: str) -> str:
    """A token's piece as one printable line: `↵` `→` for newline/tab, `·` for the spaces of an
    all-whitespace piece, other control/format characters as `\\xNN` / `\\uNNNN` escapes."""
    if not piece:
        return "∅"
    only_space = piece.isspace()
    out: list[str] = []
    for ch in piece:
        if ch in _VISIBLE:
            out.append(_VISIBLE[ch])
        elif only_space and unicodedata.category(ch) == "Zs":
            out.append("·")
        elif unicodedata.category(ch) in _ESCAPED_CATEGORIES:
            code = ord(ch)
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}")
        else:
            out.append(ch)
    text = "".join(out)
    if unicodedata.combining(text[0]) or unicodedata.category(text[0]) in ("Mn", "Me"):
        text = "◌" + text  # a lone combining mark would otherwise fuse with the separator
    return text


def runs_text(runs: tuple[tuple[int, int], ...], limit: int = 3, *, sentence: bool = False) -> str:
    """Half-open runs of positions as a person counts them: ((0, 4), (170, 195)) -> '0–3, 170–194', more runs than
    `limit` as '+N runs' (a pane's cell); `sentence`: '0–3 and 170–194', '... and N more runs' (an alarm's text)."""
    parts = [f"{a}" if b == a + 1 else f"{a}–{b - 1}" for a, b in runs[:limit]]
    more = len(runs) - limit
    if not sentence:
        return ", ".join(parts) + (f" +{more} runs" if more > 0 else "")
    if more > 0:
        parts.append(f"{more} more runs")
    if len(parts) < 2:
        return parts[0] if parts else "nothing"
    return ", ".join(parts[:-1]) + " and " + parts[-1]


def quantization_text(errors: tuple[tuple[float, float], ...] | None) -> str:
    """`errors` (quantized_errors) in a few words: the worst layer's K and V error, or nothing."""
    known = [(i, k, v) for i, (k, v) in enumerate(errors or ()) if not (math.isnan(k) or math.isnan(v))]
    if not known:
        return ""
    i, k, v = max(known, key=lambda row: max(row[1], row[2]))
    mean = sum(max(k, v) for _, k, v in known) / len(known)
    return (
        f", quantization error (dequantized K/V against the recompute's, of their range) worst in layer {i}: "
        f"K {k:.2%}, V {v:.2%}; mean over {len(known)} layers {mean:.2%}"
    )


def evicted_text(shares: tuple[float | None, ...] | None) -> str:
    """What the uncompressed recompute's newest query puts on the evicted positions (per layer), in a few words."""
    known = [(i, s) for i, s in enumerate(shares or ()) if s is not None]
    if not known:
        return ""
    worst, share = max(known, key=lambda row: row[1])
    mean = sum(s for _, s in known) / len(known)
    return (
        f"; the recompute puts {mean:.1%} of the newest query's attention on the evicted positions (mean over"
        f" {len(known)} layers; layer {worst}: {share:.1%})"
    )
