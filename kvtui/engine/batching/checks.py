"""The rules that judge a packed forward per request: positions per request, prefixes computed twice.

A packed forward is several sequences side by side, so its positions restart at every request's slice:
each request's positions must continue what its own cache held (`position-gap` otherwise). A prefill that
re-encodes tokens another request's cache already held computed them twice (`recomputed-prefix`): prefix
sharing was off, or it missed (a prefix is matched only when a request is first scheduled, and only in
whole blocks). A prompt that leaves another request's tokens and where that request's text goes on after the
edit computed the rest again too (`recomputed-prefix`, the one edit rule of reading/edits.py, as on an attached
server). A prompt shorter than one block can share nothing (`short-prompt`, counted: one note, then one per
doubling), nor can a start shared with a held prompt that is shorter than one block (`prefix-under-block`, the one
judgement of reading/edits.py, counted the same way). The findings are plain values; the Diagnostic builders word them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ..reading.diagnostics import RECOMPUTED_MIN
from ..reading.edits import REALIGN_LENGTH, realigned, under_block_words, under_one_block
from ..reading.prefixes import common_prefix
from ..records.snapshot import Diagnostic, frozen
from .packed import PackedForward, PackedRequest

DRIFT_TAIL = 64  # tokens after a conversation's difference kept for the template judgement


@frozen
class PositionFinding:
    """A request's first token applied at a position other than the one its cache called for."""

    request_id: str
    token: int  # index of the token in what this forward fed the request (0 = its slice's first)
    position: int  # the position id it was applied at
    expected: int  # tokens its cache held before it (the position it should have had)

    @property
    def offset(self) -> int:
        return self.position - self.expected


@frozen
class PrefixMiss:
    """A prefill that re-encoded tokens another request's cache already held."""

    request_id: str
    count: int  # tokens it re-encoded that the holder held
    first: int  # position of the first of them (the tokens are positions first..first+count-1)
    holder: str  # the request whose cache held them (the longest shared prefix)
    alive: bool  # the holder is still live (False: it had finished)
    differs_at: int | None  # where its prompt leaves the holder's tokens (None: not within its prompt)
    token: int | None  # its prompt's token id there (the first token the two do not share)
    reusable: int  # of `count`, tokens in whole blocks a prefix match could have shared (block granularity)
    block_tokens: int  # tokens per block (0: unknown)


@frozen
class ConversationDrift:
    """A request whose prompt continues a finished request's conversation (it holds that request's prompt and the
    start of its answer) but renders it differently before that request's tokens end."""

    request_id: str
    holder: str  # the finished request it continues
    position: int  # where its prompt leaves the holder's tokens
    token: int  # its prompt's token there
    holder_token: int  # the holder's token there
    tail: tuple[int, ...] = ()  # its prompt from there (at most DRIFT_TAIL tokens): what the template judgement reads
    holder_tail: tuple[int, ...] = ()  # the holder's tokens from there (at most DRIFT_TAIL)


def conversation_drift(
    request_id: str, prompt: Sequence[int], finished: Iterable[tuple[str, Sequence[int], int]]
) -> ConversationDrift | None:
    """`finished`: (request id, its tokens: prompt + generated, its prompt length) of finished requests. A
    prompt that goes past a finished request's prompt into its answer and then leaves its tokens before their end
    re-rendered the conversation (packed_step judges whether only the template's tokens differ)."""
    best = None
    for other_id, tokens, prompt_length in finished:
        same = common_prefix(prompt, tokens)
        if prompt_length < same < min(len(tokens), len(prompt)) and (best is None or same > best[0]):
            best = (same, other_id, tokens)
    if best is None:
        return None
    same, holder, tokens = best
    tail = tuple(int(t) for t in prompt[same : same + DRIFT_TAIL])
    holder_tail = tuple(int(t) for t in tokens[same : same + DRIFT_TAIL])
    return ConversationDrift(request_id, holder, same, int(prompt[same]), int(tokens[same]), tail, holder_tail)


@frozen
class EditedPrefix:
    """A new prompt that left another request's tokens at a token where that request's text goes on after the
    edit (reading/edits.py): the tokens after it were computed again although that request held them."""

    request_id: str
    holder: str  # the request whose tokens it left (the longest shared start)
    alive: bool  # the holder is still live (False: it had finished)
    differs_at: int  # where its prompt leaves the holder's tokens
    edit: tuple[int, int]  # (holder tokens left out or replaced, prompt tokens put in their place)
    count: int  # tokens of the holder's text after the edit that this prompt computed again
    tail: tuple[int, ...] = ()  # its prompt from the difference (at most REALIGN_LENGTH tokens)
    holder_tail: tuple[int, ...] = ()  # the holder's tokens from there (at most REALIGN_LENGTH)


def edited_prefix(
    request_id: str, prompt: Sequence[int], others: Iterable[tuple[str, Sequence[int], int, bool]]
) -> EditedPrefix | None:
    """A new prompt against what the other requests held (`others`: request id, its tokens, how many of them its
    cache held, still live): the one that shares the longest start with it, where its text goes on after the
    difference within reading/edits.py's bounds. None where no held text goes on (another prompt: no waste)."""
    best, holder, alive, held_tokens = 0, "", True, None
    for other_id, tokens, held, live in others:
        if other_id == request_id or held <= best:
            continue
        same = min(common_prefix(prompt, tokens), held)
        if same > best or held_tokens is None:
            best, holder, alive, held_tokens = same, other_id, live, tokens[:held]
    if held_tokens is None or best >= len(prompt) or best >= len(held_tokens):
        return None  # nothing held, or the prompt (or the held text) ends where they part
    edit = realigned(held_tokens, prompt, best)
    if edit is None:
        return None
    left, put = edit
    count = common_prefix(held_tokens[best + left :], prompt[best + put :])
    return EditedPrefix(
        request_id,
        holder,
        alive,
        best,
        edit,
        count,
        tuple(int(t) for t in prompt[best : best + REALIGN_LENGTH]),
        tuple(int(t) for t in held_tokens[best : best + REALIGN_LENGTH]),
    )


@frozen
class UnderBlock:
    """A new prompt (of at least one block, none of it found cached) that shares its start with a held request's
    tokens, fewer than one block of them: no block could match."""

    request_id: str
    holder: str  # the request whose tokens it shares the longest start with
    alive: bool  # the holder is still live (False: it had finished)
    shared: int  # tokens of that start
    block_tokens: int


def under_block(
    request_id: str, prompt: Sequence[int], others: Iterable[tuple[str, Sequence[int], int, bool]], block_tokens: int
) -> UnderBlock | None:
    """The held request sharing the longest start with `prompt` (`others`: request id, its tokens, how many of them
    its cache held, still live), where that start is under one block (reading/edits.under_one_block); else None."""
    best, holder, alive = 0, "", True
    for other_id, tokens, held, live in others:
        if other_id == request_id or held <= best:
            continue
        same = min(common_prefix(prompt, tokens), held)
        if same > best:
            best, holder, alive = same, other_id, live
    if not holder or not under_one_block(best, block_tokens):
        return None
    return UnderBlock(request_id, holder, alive, best, block_tokens)


def under_block_diagnostic(finding: UnderBlock, count: int, step: int, at: str = "") -> Diagnostic:
    """`prefix-under-block` (info) for a request of a packed forward: said once, then at each doubling of `count`."""
    state = "live" if finding.alive else "finished"
    return Diagnostic(
        "prefix-under-block",
        "info",
        f"request {finding.request_id} starts as request {finding.holder} ({state}) does and "
        f"{under_block_words(finding.shared, finding.block_tokens, count)}" + at,
        step,
    )


def check_request_positions(packed: PackedForward) -> list[PositionFinding]:
    """Per request, its positions must be held_before, held_before+1, ... (the tokens its cache held before this
    forward, then one more per token). Without the batch processor (status "unknown") only contiguity is
    checked. At most one finding per request: its first wrong token."""
    found = []
    for request in packed.requests:
        if not request.positions:
            continue
        expected = request.positions[0] if request.status == "unknown" else request.held_before
        for i, position in enumerate(request.positions):
            if position != expected + i:
                found.append(PositionFinding(request.request_id, i, position, expected + i))
                break
    return found


def position_gap_diagnostic(finding: PositionFinding, step: int, at: str = "") -> Diagnostic:
    """`position-gap` for one request of a packed forward (the wording of the sequence rule, per request)."""
    return Diagnostic(
        "position-gap",
        "error",
        f"request {finding.request_id} token {finding.token} was applied at position {finding.position} "
        f"but {finding.expected} tokens of that request precede it (offset {finding.offset:+d}): "
        "RoPE sees the wrong distances" + at,
        step,
    )


def prefix_miss(
    request: PackedRequest,
    prompt: Sequence[int],
    others: Iterable[tuple[str, Sequence[int], int, bool]],
    block_tokens: int = 0,
    prefix_sharing: bool = False,
    min_tokens: int = RECOMPUTED_MIN,
) -> PrefixMiss | None:
    """Did this prefill re-encode tokens another request held before this forward?

    `prompt`: the request's prompt ids; `others`: (request id, its tokens, how many of them its cache held
    before this forward, still live) for the other requests. None when it re-encoded fewer than `min_tokens`
    held tokens, or when the cache shares prefixes and none of them filled a whole block (the rest of a
    partial block is recomputed by design)."""
    if not request.is_prefill or not prompt:
        return None
    best, holder, alive = 0, "", True
    for other_id, tokens, held, live in others:
        if other_id == request.request_id or held <= best:
            continue  # itself, or one that cannot share more than the best so far
        same = min(common_prefix(prompt, tokens), held)
        if same > best:
            best, holder, alive = same, other_id, live
    count = min(best, request.held_after) - request.held_before
    if count < min_tokens:
        return None
    reusable = count
    if block_tokens > 0:
        # transformers matches whole blocks, and never the prompt's last token (something must be fed)
        matchable = min(best // block_tokens, (len(prompt) - 1) // block_tokens) * block_tokens
        reusable = max(0, min(matchable, request.held_after) - request.held_before)
    if prefix_sharing and reusable == 0:
        return None
    differs_at = best if best < len(prompt) else None
    return PrefixMiss(
        request_id=request.request_id,
        count=count,
        first=request.held_before,
        holder=holder,
        alive=alive,
        differs_at=differs_at,
        token=int(prompt[best]) if differs_at is not None else None,
        reusable=reusable,
        block_tokens=block_tokens,
    )


def recomputed_prefix_diagnostic(
    miss: PrefixMiss, step: int, prefix_sharing: bool, token_text: str | None = None, at: str = ""
) -> Diagnostic:
    """`recomputed-prefix` for a request of a packed forward. `token_text`: the differing token by name."""
    state = "still holds" if miss.alive else "held (it has finished)"
    where = ""
    if miss.differs_at is not None:
        name = token_text if token_text is not None else f"id {miss.token}"
        where = f"; its prompt leaves that request's tokens at token {miss.differs_at} ({name})"
    if not prefix_sharing:
        why = "prefix sharing is off (ContinuousBatchingConfig(allow_block_sharing=True), full-attention models only)"
    else:
        why = (
            f"prefix sharing missed {miss.reusable} of them in whole blocks of {miss.block_tokens} tokens "
            "(a prefix is matched only when a request is first scheduled, against blocks already complete)"
        )
    return Diagnostic(
        "recomputed-prefix",
        "info",
        f"request {miss.request_id} re-encoded {miss.count} tokens that request {miss.holder} {state} "
        f"(positions {miss.first}..{miss.first + miss.count - 1}){where}: {why}" + at,
        step,
    )


def edited_prefix_diagnostic(
    edit: EditedPrefix, step: int, have: str, want: str, words: str, at: str = ""
) -> Diagnostic:
    """`recomputed-prefix` for a prompt that left another request's tokens where that request's text goes on:
    `have`/`want` name the two tokens at the difference, `words` the edit (reading/edits.edit_words)."""
    state = "holds" if edit.alive else "held (it has finished)"
    return Diagnostic(
        "recomputed-prefix",
        "info",
        f"request {edit.request_id} left request {edit.holder}'s tokens at token {edit.differs_at}: {have} instead of "
        f"{want}; {edit.count} tokens after it that request {edit.holder} {state} were computed again{words}: a "
        "prefix cache matches a prompt's start only, so text that differs per request belongs after the shared part"
        + at,
        step,
    )


def short_prompt_diagnostic(
    request_id: str, prompt_length: int, block_tokens: int, count: int, step: int, at: str = ""
) -> Diagnostic:
    """`short-prompt` (info): a prompt shorter than one block shares nothing (said once, then at each doubling of
    the count: a flood is counted, not listed)."""
    return Diagnostic(
        "short-prompt",
        "info",
        f"request {request_id}'s prompt has {prompt_length} tokens, fewer than one block of {block_tokens}: the paged "
        f"cache shares whole blocks only, so nothing of it can be reused by another request ({count} such prompt"
        f"{'s' if count != 1 else ''} so far; a smaller --cb-block-size, or a shared start of at least one block, "
        "lets prompts share)" + at,
        step,
    )


def conversation_drift_diagnostic(
    drift: ConversationDrift, step: int, have: str, want: str, at: str = ""
) -> Diagnostic:
    """`template-drift` for a request that re-rendered an earlier request's conversation differently."""
    return Diagnostic(
        "template-drift",
        "warning",
        f"request {drift.request_id} continues request {drift.holder}'s conversation but renders it differently at "
        f"token {drift.position} (request {drift.holder} had {want}, this prompt has {have}): the cached blocks "
        "after it cannot be shared and are computed again; render every turn of a conversation the same way" + at,
        step,
    )


def requeued_diagnostic(resume, step: int, at: str = "") -> Diagnostic:
    """`request-requeued` (info): the scheduler sent a request back to waiting (its blocks were needed) and it
    resumed: restored from its CPU copy, or soft-reset and computed again (a serving lane's event)."""
    if resume.recomputed:
        what = f"computed again the {resume.recomputed} tokens its cache had held (soft reset)"
        if resume.kept:
            what = f"kept {resume.kept} of the {resume.held_before} tokens its cache held and computed again the rest"
    else:
        what = f"its {resume.held_before} tokens restored (offloaded to the CPU and back)"
    return Diagnostic(
        "request-requeued",
        "info",
        f"request {resume.request_id} went back to waiting at step {resume.requeued_at} (the paged cache had no "
        f"free block for it) and resumed at step {resume.step}, {what}: more blocks (num_blocks, --cb-num-blocks) "
        "or fewer requests at once avoid it" + at,
        step,
    )
