"""A watched step's position and layer checks (StepBuilder.build calls them in its order): each row's applied
positions against what its cache attended (or, on a compressed cache, where its kept keys continue), and the
layers' infos with the sliding eviction they show."""

from __future__ import annotations

from ..reading.diagnostics import check_padding_side, check_row_positions
from ..reading.introspect.held import held_infos, masked_infos
from ..reading.silent_rules import (
    check_window_positions,
    counted_under_padding,
    note_right_padding,
    positions_stuck_at_window,
)
from ..records.snapshot import Diagnostic, LayerInfo


def check_positions(
    alarms, call, step: int, applied: list[list[int]], masks: list[list[int]], stale: bool, at: str
) -> list[Diagnostic]:
    """A prefill's padding side, and each row's applied positions against what its cache attended (`call`: the
    forward's watch_step.Call, which imports this module)."""
    found: list[Diagnostic] = []
    if call.pads_unknown:  # a mask kvtui cannot map to the cache's slots, and no count to continue: no claim
        return found
    if call.n > 1:
        padded = check_padding_side(step, masks, at)
        note_right_padding(alarms, bool(padded))
        found += padded
    attended_before = call.real_before if call.real_before is not None else [call.cache_length_before] * call.batch
    because = ""
    if call.expected_start is not None and call.track is not None and call.track.held is not None:
        track = call.track
        # a compressed cache: the kept keys encode where they were fed (or their slots, re-rotated)
        attended_before = [call.expected_start] * call.batch
        because = (
            f"; {track.name} held {call.cache_length_before} slots after {track.held.cause}, and its kept keys "
            f"continue at position {call.expected_start}"
        )
    # the repeat state is kept either way; a stale cache's gap is said by stale-cache
    window = call.probe.window  # a model with sliding layers: positions stuck at one's length have one cause
    if window and positions_stuck_at_window(applied, attended_before, window):
        gaps = check_window_positions(alarms, step, applied[0][0], attended_before[0], window, at)
    else:
        gaps = check_row_positions(alarms, step, applied, masks, attended_before, at, because)
    if gaps and not stale:
        found += counted_under_padding(alarms, gaps)
    return found


def checked_layers(
    alarms, call, step: int, cache, cache_len: int, layers: tuple[LayerInfo, ...], found: list[Diagnostic]
) -> tuple[LayerInfo, ...]:
    """The cache's per-layer infos (`layers`; a compressed cache's with the positions each layer holds); the
    sliding eviction they show added to `found`."""
    track = call.track if cache is call.cache else None
    if track is not None and (track.held is not None or track.masked is not None):
        if track.held is not None:  # a compressed cache: which positions each layer holds, not a prefix
            layers = held_infos(layers, track.held)
        if track.masked is not None:  # keys a press masked per head: in their slots, out of what each head attends
            layers = masked_infos(layers, track.masked, track.held)
    # the program sizes its own static cache (generate() sizes it exactly): only an overflow is news,
    # and check_request names it before the forward; here only sliding eviction is said
    found += [at_caller(d, call.caller) for d in alarms.check_layers(step, layers, None, cache_len, reserve=1)]
    return layers


def at_caller(d: Diagnostic, caller: str) -> Diagnostic:
    return Diagnostic(d.code, d.severity, f"{d.message} [{caller}]", d.step)
