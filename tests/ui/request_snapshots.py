"""Hand-built continuous-batching steps (what the watch step builder fills for a packed forward): four
requests over a paged cache, two sharing a system-prompt prefix, arriving, prefilling, decoding and finishing.
Deterministic, so a screenshot of them is too."""

from __future__ import annotations

from kvtui.engine.records.snapshot import (
    BufferToken,
    PagedGroupView,
    RequestView,
    RowView,
    StepSnapshot,
    TokenBuffer,
    TopToken,
)

SYSTEM = ["<|im_start|>", "system", "\n", "You", " are", " terse", ".", "<|im_end|>"]  # 8 tokens: one block of 8
PROMPTS = {
    "req-a1": [*SYSTEM, "<|im_start|>", "user", "\n", "Name", " a", " fruit", "<|im_end|>", "\n"],
    "req-b2": [*SYSTEM, "<|im_start|>", "user", "\n", "Name", " a", " colour", "<|im_end|>", "\n"],
    "req-c3": ["<|im_start|>", "user", "\n", "Count", " to", " three", "<|im_end|>", "\n"],
}
REPLIES = {"req-a1": [" Apple", ".", "<|im_end|>"], "req-b2": [" Blue", ".", "<|im_end|>"], "req-c3": [" 1", " 2"]}


def token(position: int, piece: str) -> BufferToken:
    special = piece.startswith("<|")
    return BufferToken(position, 1000 + sum(map(ord, piece)) if not special else 1, piece, special, "fed", 0)


def buffer(request_id: str, held: int) -> TokenBuffer:
    pieces = [*PROMPTS[request_id], *REPLIES[request_id]][:held]
    return TokenBuffer([token(i, piece) for i, piece in enumerate(pieces)])


def top(*pieces: str) -> tuple[TopToken, ...]:
    probs = (0.7, 0.2, 0.1)
    return tuple(TopToken(2000 + i, piece, 3.0 - i, probs[i], i + 1) for i, piece in enumerate(pieces))


def request(request_id, status, phase, fed, held, generated, hit=0, recomputed=0, blocks=(), shared=0):
    return RequestView(
        request_id=request_id,
        status=status,
        phase=phase,
        fed=fed,
        held=held,
        prompt_length=len(PROMPTS[request_id]),
        generated=generated,
        prefix_hit=hit,
        recomputed=recomputed,
        blocks=(("full", tuple(blocks)),),
        shared=shared,
    )


def group(used: int, shared: int, cached: int) -> tuple[PagedGroupView, ...]:
    return (PagedGroupView("full", 2, 8, 16, used, 16 - used - cached, shared, cached),)


def step(number: int, requests: tuple[RequestView, ...], tops: dict[str, tuple[str, ...]], paged) -> StepSnapshot:
    """One packed forward: every fed request a row (packing order), its tokens, positions and top-k."""
    rows = []
    input_ids: list[int] = []
    positions: list[int] = []
    for view in requests:
        if not view.fed:
            continue
        held = buffer(view.request_id, view.held)
        fed = held[view.held - view.fed :]
        rows.append(
            RowView(
                row=len(rows),
                input_ids=tuple(t.id for t in fed),
                positions=tuple(t.position for t in fed),
                topk=top(*tops[view.request_id]),
                buffer=held,
                request_id=view.request_id,
            )
        )
        input_ids += [t.id for t in fed]
        positions += [t.position for t in fed]
    first = rows[0]
    return StepSnapshot(
        step=number,
        phase="prefill" if any(r.phase.startswith("prefill") for r in requests) else "decode",
        turn=1,
        input_ids=first.input_ids,
        positions=first.positions,
        cursor=sum(view.held for view in requests),  # the paged cache's tokens, every request's
        cache_seq_length=sum(view.held for view in requests),
        capacity=None,
        layers=(),  # a paged cache: its blocks are in `paged`
        topk=first.topk,
        topk_processed=first.topk,
        watched=(),
        chosen=None,
        chosen_forced=False,
        diagnostics=(),
        forward_ms=4.0,
        snapshot_ms=0.1,
        buffer=first.buffer,
        source="watch",
        caller="transformers/generation/continuous_batching/continuous_api.py:812",
        cache_id="PagedAttentionCache#1",
        batch=len(rows),
        rows=tuple(rows),
        requests=requests,
        paged=paged,
    )


def steps() -> list[StepSnapshot]:
    """a1 and b2 arrive and prefill together (b2 finds the shared system block), c3 waits; c3 prefills while
    a1 and b2 decode; a1 finishes; b2 finishes and a1 has left the live list; c3 decodes on."""
    return [
        step(
            1,
            (
                request("req-a1", "prefilling", "prefill", 16, 16, 0, blocks=(0, 1)),
                request("req-b2", "prefilling", "prefill", 8, 16, 0, hit=8, blocks=(0, 2), shared=1),
                request("req-c3", "waiting", "", 0, 0, 0),
            ),
            {"req-a1": (" Apple", " Banana", " Pear"), "req-b2": (" Blue", " Red", " Green")},
            group(3, 1, 0),
        ),
        step(
            2,
            (
                request("req-a1", "decoding", "decode", 1, 17, 1, blocks=(0, 1, 3)),
                request("req-b2", "decoding", "decode", 1, 17, 1, hit=8, blocks=(0, 2, 4), shared=1),
                request("req-c3", "prefilling", "prefill", 8, 8, 0, recomputed=3, blocks=(5,)),
            ),
            {"req-a1": (".", "!", ","), "req-b2": (".", "ish", "!"), "req-c3": (" 1", " One", " one")},
            group(6, 1, 0),
        ),
        step(
            3,
            (
                request("req-a1", "finished", "decode", 1, 18, 2, blocks=(0, 1, 3)),
                request("req-b2", "decoding", "decode", 1, 18, 2, hit=8, blocks=(0, 2, 4), shared=1),
                request("req-c3", "decoding", "decode", 1, 9, 1, recomputed=3, blocks=(5, 6)),
            ),
            {"req-a1": ("<|im_end|>", "\n", " "), "req-b2": ("<|im_end|>", "\n", "."), "req-c3": (" 2", ",", " and")},
            group(7, 1, 0),
        ),
        step(
            4,
            (
                request("req-b2", "finished", "decode", 1, 19, 3, hit=8, blocks=(0, 2, 4)),
                request("req-c3", "decoding", "decode", 1, 10, 2, recomputed=3, blocks=(5, 6)),
            ),
            {"req-b2": ("\n", " ", "."), "req-c3": (" 3", ",", " and")},
            group(5, 0, 2),
        ),
    ]
