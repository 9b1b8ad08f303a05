"""Silent cache bugs users report around generate() (issue 37, classes 4 to 6), each named at the program's
line with one alarm per cause where the installed transformers has the bug: a right-padded batch whose rows
get positions that do not match their tokens, assisted decoding past a sliding window, and a static cache
sized other than the program asked. What the installed transformers does is feature-tested (program_headers),
so the expectations hold on 4.57 and 5.x alike."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvtui.engine.reading.silent_rules import check_cache_config_size
from kvtui.engine.records.diagnostic_groups import group_diagnostics
from program_headers import (
    assisted_caches_slide,
    cache_config_sizes_the_static_cache,
    cache_position_drives_positions,
    expected_codes,
    model_dir,
)
from test_silent_position_rules import line_of, watched_alarms, watched_run

ROOT = Path(__file__).resolve().parents[3]
CORPUS = ROOT / "tests" / "watch_corpus"


# ---- class 4: a right-padded batch in generate() --------------------------------------------------------


def test_a_right_padded_batch_is_one_padding_side_group(tmp_path):
    program = CORPUS / "right_padded_generate.py"
    found = watched_alarms(program, tmp_path)
    assert {d.code for d in found} == expected_codes(program) == {"padding-side"}
    at = f"[{line_of(program, 'out = model.generate(')}]"
    assert all(at in d.message for d in found)
    assert "row 0 ends with 14 pad(s)" in found[0].message
    # 4.57 derives each row's positions from the mask (they match its tokens): the prefill's alarm only.
    # 5.x places the short row's new tokens after its pads (position 1 with 4 tokens before it): the same
    # cause, counted under padding-side, not a second position-gap with another reason
    groups = group_diagnostics(found)
    if cache_position_drives_positions():
        assert [(g.code, g.count) for g in groups] == [("padding-side", 1)]
    else:
        assert [(g.code, g.count) for g in groups] == [("padding-side", 2)]
        assert "the right padding again: row 0 token 0 was applied at position 1" in found[1].message
    assert len({d.message for d in found}) == len(found)


# ---- class 5: assisted decoding past a sliding window -------------------------------------------------


def test_assisted_decoding_past_the_window_keeps_the_reply(tmp_path):
    """Judged not a bug on 4.57 and 5.24: the reply is plain greedy decoding's; 5.x's sliding layers say they
    evicted (info, one group per cache), 4.57's assisted caches keep full layers (nothing to say)."""
    program = CORPUS / "assisted_sliding_window.py"
    found, printed = watched_run(program, tmp_path)
    assert {d.code for d in found} == expected_codes(program)
    assert all(d.severity == "info" for d in found)
    if assisted_caches_slide():
        assert [g.code for g in group_diagnostics(found)] == ["sliding-eviction"]
    directory = model_dir("tiny:mistral")
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    ids = tokenizer("The quick brown fox jumps over the lazy dog again", return_tensors="pt")["input_ids"]
    greedy = model.generate(ids, max_new_tokens=16, do_sample=False)[0, ids.shape[-1] :].tolist()
    assert ids.shape[-1] > 8 and f"reply: {greedy}" in printed


# ---- class 6: a static cache sized other than the program asked ----------------------------------------


def test_a_static_size_in_cache_config_that_generate_ignores_is_named(tmp_path):
    program = CORPUS / "static_cache_config.py"
    found = watched_alarms(program, tmp_path)
    assert {d.code for d in found} == expected_codes(program)
    if cache_config_sizes_the_static_cache():  # a transformers that honours it: quiet
        assert found == []
        return
    assert len(found) == 1 and f"[{line_of(program, 'out = model.generate(')}]" in found[0].message
    assert "cache_config max_cache_len=64 was ignored: generate() made StaticCache#1 with room for 18" in (
        found[0].message
    )


def test_the_rule_for_a_static_size_asked():
    assert check_cache_config_size(1, "StaticCache#1", 64, 64, "") == []
    (said,) = check_cache_config_size(1, "StaticCache#1", 8, 18, " [p.py:3]")
    assert (said.code, said.severity) == ("ignored-argument", "warning") and "room for 18" in said.message
