"""Rendering a chat into the (id, origin) tokens the model will see, comparing them with the tokens the
cache already holds (template drift), and the ids that end a reply (what the template writes after one).

Origins say who wrote each token: "system" | "user" | "assistant" (a message's own words), "template"
(what the chat template adds around them), "tokenizer-added" (BOS/EOS the tokenizer adds to plain text).
"""

from __future__ import annotations

from collections.abc import Callable

from ..reading.diagnostics import SpecialIds
from ..reading.prefixes import common_prefix
from ..reading.tokens import find_sub
from ..records.snapshot import BufferToken, Diagnostic
from .session_types import SessionError

Tokens = list[tuple[int, str]]  # (token id, origin)


def render_chat(tokenizer, messages: list[dict], chat_tokenize: str) -> Tokens:
    """The whole chat as (id, origin) pairs, exactly as the model will see it."""
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as exc:
        raise SessionError(f"the chat template failed: {exc}") from exc
    if chat_tokenize == "text":
        return tokenize(tokenizer, text, add_special=True, messages=messages)
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    if hasattr(ids, "keys"):  # 5.x returns a BatchEncoding
        ids = ids["input_ids"]
    ids = list(ids[0]) if ids and isinstance(ids[0], list) else list(ids)
    labelled = tokenize(tokenizer, text, add_special=False, messages=messages)
    if [i for i, _ in labelled] != ids:  # origins from offsets only when they describe the same ids
        return [(i, "template") for i in ids]
    return labelled


def tokenize(tokenizer, text: str, add_special: bool, messages: list[dict] | None = None) -> Tokens:
    """tokenizer(text) with an origin per token: what the tokenizer added is found by comparing
    with add_special_tokens=False (flags like add_bos_token can lie)."""
    bare = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = bare["input_ids"], bare["offset_mapping"]
    spans = _content_spans(text, messages) if messages is not None else [(0, len(text), "user")]
    origins = [_origin_at(start, end, spans) for start, end in offsets]
    if not add_special:
        return list(zip(ids, origins))
    full = tokenizer(text)["input_ids"]
    front = find_sub(full, ids)
    if front < 0:  # the tokenizer changed the text's own tokens: trust its ids, label them plainly
        return [(i, "template" if messages is not None else "user") for i in full]
    back = len(full) - front - len(ids)
    return (
        [(i, "tokenizer-added") for i in full[:front]]
        + list(zip(ids, origins))
        + [(i, "tokenizer-added") for i in full[len(full) - back :]]
    )


def rendered_prefix(
    chat: list[BufferToken], rendered: Tokens, piece: Callable[[int], str], step: int
) -> tuple[int, list[Diagnostic]]:
    """How many of the cached chat tokens the re-rendered chat starts with, and a template-drift alarm
    (at `step`) when that is not all of them: the cache must then be rewound to the common prefix. (kvtui
    rendered both from the same messages, so whatever differs is the template's rendering.)"""
    common = common_prefix([t.id for t in chat], [i for i, _ in rendered])
    if common == len(chat):
        return common, []
    cached, fresh = chat[common], rendered[common][0] if common < len(rendered) else None
    drift = Diagnostic(
        "template-drift",
        "warning",
        f"the cached tokens are not a prefix of the re-rendered chat: at index {common} the cache holds "
        f"{piece(cached.id)!r} (id {cached.id}) but the template renders "
        + (f"{piece(fresh)!r} (id {fresh})" if fresh is not None else "nothing")
        + f"; rewinding {len(chat) - common} tokens to the common prefix",
        step,
    )
    return common, [drift]


def special_ids(model, tokenizer, special: frozenset[int], chat: bool) -> SpecialIds:
    """BOS, PAD and every id that ends a reply: the generation config's and the tokenizer's EOS, and in chat
    mode the template's end-of-turn token."""
    eos = set()
    gen = getattr(model, "generation_config", None)
    for source in (getattr(gen, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(source, int):
            eos.add(source)
        elif source:
            eos.update(int(i) for i in source)
    eot = end_of_turn_id(tokenizer, special) if chat else None
    if eot is not None:
        eos.add(eot)
    return SpecialIds(bos=tokenizer.bos_token_id, eos=frozenset(eos), pad=tokenizer.pad_token_id)


def end_of_turn_id(tokenizer, special: frozenset[int]) -> int | None:
    """The first special token the template writes after an assistant's words (e.g. <|im_end|>)."""
    marker = "kvtuimarker"
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": marker}], tokenize=False
        )
    except Exception:  # noqa: BLE001  templates that insist on other roles: no extra stop token
        return None
    tail = text[text.rfind(marker) + len(marker) :]
    for token_id in tokenizer(tail, add_special_tokens=False)["input_ids"]:
        if token_id in special:
            return token_id
    return None


def _content_spans(text: str, messages: list[dict] | None) -> list[tuple[int, int, str]]:
    """Character spans of each message's content inside the rendered text, found in order."""
    spans, cursor = [], 0
    for message in messages or []:
        content = message.get("content") or ""
        if not isinstance(content, str) or not content:
            continue
        at = text.find(content, cursor)
        if at < 0:  # the template rewrote it (stripped, reformatted): its tokens count as template
            continue
        spans.append((at, at + len(content), message["role"]))
        cursor = at + len(content)
    return spans


def _origin_at(start: int, end: int, spans) -> str:
    if end <= start:
        return "template"
    for span_start, span_end, role in spans:
        if span_start <= start and end <= span_end:
            return role if role in ("system", "user", "assistant") else "template"
    return "template"
