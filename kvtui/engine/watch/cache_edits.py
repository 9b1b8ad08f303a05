"""What a watched program does to its caches outside a forward (their own edit methods, slicing, in-place writes:
`cache-edited`, or `cache-evicted` for an eviction) and at generate()'s first forward (`stale-cache`, a draft
model named): the Watcher's checks between forwards, kept here so the Watcher stays its attaching and records."""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch

from ..reading import introspect
from ..reading.diagnostics import check_stale_prompt
from ..records.snapshot import Diagnostic
from . import evictions
from .callers import caller_line, inside_transformers, library_dirs
from .hooks import MODELS, STATE
from .lineage import CacheTrack
from .silent_writes import edit_changed_nothing
from .watch_step import Call


def edit_begins(cache) -> tuple[bool, int]:
    """Before a cache's own edit method runs: (whether transformers itself called it, the cache's length)."""
    return inside_transformers(), introspect.seq_length(cache)


def edit_ended(watcher, track: CacheTrack, cache, name: str, args, begun: tuple[bool, int]) -> None:
    """After it returned: the cache's rows and fingerprint follow it; a call of the program's own is said."""
    internal, before = begun
    with watcher.lock:
        after = introspect.seq_length(cache)
        if name == "reorder_cache" and args:
            order = args[0].tolist() if isinstance(args[0], torch.Tensor) else list(args[0])
            track.rows = [list(track.rows[i]) if i < len(track.rows) else [] for i in order]
        elif name == "batch_select_indices" and args:
            order = args[0].tolist() if isinstance(args[0], torch.Tensor) else list(args[0])
            track.rows = [list(track.rows[i]) for i in order if i < len(track.rows)]
        elif name == "batch_repeat_interleave" and args:
            track.rows = [list(r) for r in track.rows for _ in range(int(args[0]))]
        elif name == "reset" and after == 0:  # 4.x's reset zeroes K/V in place and keeps the length: rows kept
            track.rows = [[] for _ in track.rows]
        track.held = None  # its own method: held positions are followed only through forwards and slicing
        track.truncate(after)
        track.fingerprint = introspect.fingerprint(cache)
        if not internal:  # generate's own bookkeeping (beam reordering, assisted crops) is followed, not said
            shown = ", ".join(short_arg(a) for a in args)
            call = f"{track.name}.{name}({shown}) at [{caller_line(watcher._skip or library_dirs())}]"
            watcher._diagnose(
                edit_changed_nothing(watcher.steps, call, name, args, before, after)
                or [
                    Diagnostic(
                        "cache-edited",
                        "info",  # the program called the cache's own method: said, not blamed
                        f"{call}: {before} -> {after} tokens outside a forward",
                        watcher.steps,
                    )
                ]
            )


def check_edits(watcher, call: Call, track: CacheTrack, cache) -> None:
    """Compare the cache with its fingerprint after the last forward: a change means an edit outside one.
    Shapes and tensors are compared now (on the host); the values of inference tensors in the step's one
    transfer (`edit_found`, once it is resolved)."""
    before, track.fingerprint = track.fingerprint, None  # spent: the forward makes the next one
    if before is None:
        return
    reads = call.reads if call.reads is not None else introspect.HostReads()
    entries = before.layers  # (layer, K, V, ...) after the last forward: references, kept past the release
    change, call.pending_edit = introspect.check_edits(before, cache, reads)
    call.edits_at = len(call.found)
    if change is not None:
        evicted = evictions.between(watcher, call, track, [entry[1:3] for entry in entries], cache)
        if evicted is not None:  # said as an eviction, the buffer kept (not cut to the cache's slots)
            call.found.insert(call.edits_at, evicted)
        else:
            edit_found(watcher, call, track, change)


def edit_found(watcher, call: Call, track: CacheTrack, change: str) -> None:
    track.truncate(call.cache_length_before)
    call.found.insert(
        call.edits_at,
        Diagnostic(
            "cache-edited",
            "warning",
            f"{track.name} changed since the last forward without a forward: {change} (noticed at [{call.caller}])",
            watcher.steps + 1,
        ),
    )


def generate_started(watcher, call: Call, frames: Sequence) -> None:
    """The forward runs inside generate(): name a draft model, and at generate's first forward check the
    cache against the whole prompt (generate feeds only the prompt tokens past the cache's length,
    whatever the cache holds)."""
    for frame in frames:
        assistant = frame.f_locals.get("assistant_model")
        helper = MODELS.get(assistant) if assistant is not None else None
        if helper is not None and helper.watcher is watcher:
            helper.role = "draft"
    prompt = frames[0].f_locals.get("input_ids")
    track = call.track
    if not isinstance(prompt, torch.Tensor) or prompt.dim() != 2 or track is None:
        return
    # generate()'s first forward: a prompt tensor this generate() frame has not run a forward for yet (a weak
    # reference: the program's tensor lives exactly as long as without kvtui)
    seen = STATE.prompts.get(id(frames[0]))
    first = seen is None or seen() is not prompt
    live = {id(frame) for frame in frames}  # generate() calls that returned are forgotten
    STATE.prompts = {key: ref for key, ref in STATE.prompts.items() if key in live}
    STATE.prompts[id(frames[0])] = weakref.ref(prompt)
    if not first or not call.cache_length_before:
        return
    length = prompt.shape[-1]
    call.found += check_stale_prompt(
        watcher.steps + 1,
        track.name,
        track.ids(),
        prompt[0].tolist(),
        watcher.label,
        f" [{call.caller}]",
        fed_from=length - call.n,
    )


def short_arg(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor{list(value.shape)}" if value.numel() > 8 else str(value.tolist())
    return repr(value)
