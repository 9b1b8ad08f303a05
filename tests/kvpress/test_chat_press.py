"""kvtui's own chat under `--press SPEC` (issue #54; transformers 4.57 only: kvpress pins <5.3, so `make test` runs this
folder in .venv-compat). Each truth is independent of kvtui's reading: what the press kept comes from wrapping the
press's own `compress` (its input and output K rows compared densely), the tokens from `with press(model):
model.generate(...)` and from a loop written here the way kvpress's pipeline decodes (logical `position_ids`, no
`cache_position`: the model counts the slots)."""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from kvtui.engine.chat.session import ChatSession, SessionConfig

PROMPT = (
    "Once upon a time a small grey cat lived in a large old house beside the river, and every morning she "
    "walked along the water to watch the boats go by"
)


@pytest.fixture
def llama(tiny_model):
    return tiny_model("llama")


def _session(llama, press="knorm:0.5", **config) -> ChatSession:
    model, tokenizer = llama
    options = {"mode": "completion", "max_new_tokens": 6, "press": press, **config}
    return ChatSession(model, tokenizer, SessionConfig(**options))


def _kept_by_press(press) -> dict[int, list[set[int]]]:
    """Wrap the session's own press object's compress: per layer, per KV head, the input slots (the prefill's
    positions) whose key rows the output holds (keys are rotated by position, so each row names one slot)."""
    kept: dict[int, list[set[int]]] = {}
    original = press.compress

    def compress(module, hidden_states, keys, values, attentions, kwargs):
        new_keys, new_values = original(module, hidden_states, keys, values, attentions, kwargs)
        same = (new_keys[0][:, :, None, :] == keys[0][:, None, :, :]).all(-1)  # [heads, kept, fed]
        kept[module.layer_idx] = [set(torch.nonzero(head)[:, 1].tolist()) for head in same]
        return new_keys, new_values

    press.compress = compress
    return kept


def test_held_positions_are_what_the_press_kept_and_tokens_equal_kvpress_generate(llama):
    from kvpress import KnormPress

    model, _ = llama
    session = _session(llama)
    kept = _kept_by_press(session._press.press)
    snaps, logits = [], []
    session.on_snapshot.add(snaps.append)
    session.on_snapshot.add(lambda s: logits.append(session.last_logits.clone()))
    session.send(PROMPT)
    session.generate()
    prefill = snaps[0]
    n = len(prefill.input_ids)
    assert kept and len(kept) == model.config.num_hidden_layers
    for layer in prefill.layers:
        heads = kept[layer.index]
        runs = layer.held_heads or (layer.held,) * len(heads)
        held = [{p for start, stop in head for p in range(start, stop)} for head in runs]
        assert held == heads, layer.index
        assert layer.seen == n and layer.filled == max(len(h) for h in heads) < n
    assert {d.code for d in session.diagnostics} == {"cache-evicted"}, session.diagnostics
    assert all(d.severity == "info" for d in session.diagnostics)
    # decoded at the logical positions: the cursor counts every token fed, the cache holds fewer slots
    assert session.cursor == len(session.buffer) > session.cache_length
    chosen = [s.chosen.id for s in snaps]
    ids = torch.tensor([list(prefill.input_ids)])
    with torch.no_grad(), KnormPress(compression_ratio=0.5)(model):
        truth = model.generate(
            ids, max_new_tokens=len(chosen), do_sample=False, output_logits=True, return_dict_in_generate=True
        )
    assert truth.sequences[0, n:].tolist() == chosen
    for step, (expected, got) in enumerate(
        zip(truth.logits, logits, strict=True)
    ):  # every step's logits, not only argmax
        assert torch.allclose(expected[0].float(), got, atol=1e-4), step


def test_a_multi_turn_chat_decodes_at_logical_positions_as_kvpress_pipeline_does(llama):
    from kvpress import StreamingLLMPress
    from transformers import DynamicCache

    model, _ = llama
    session = _session(llama, press="streaming:4+16")
    snaps = []
    session.on_snapshot.add(snaps.append)
    session.send(PROMPT)
    session.generate()
    session.send(" and then the cat")
    session.generate()
    assert {d.code for d in session.diagnostics} == {"cache-evicted"}, session.diagnostics
    first = snaps[0]
    assert [layer.held for layer in first.layers] == [
        ((0, 4), (len(first.input_ids) - 16, len(first.input_ids)))
    ] * len(first.layers)
    # the pipeline's way, written here: the context prefilled under the press, then every later chunk at its
    # logical positions with no cache_position (the model counts the slots the cache holds)
    n = len(first.input_ids)
    press = StreamingLLMPress(compression_ratio=(n - 20 - 0.5) / n, n_sink=4)
    cache = DynamicCache()
    with torch.no_grad():
        with press(model):
            out = model(input_ids=torch.tensor([list(first.input_ids)]), past_key_values=cache)
        assert cache.get_seq_length() == 20
        fed = n
        for snap in snaps[1:]:
            assert int(out.logits[0, -1].argmax()) == snaps[snaps.index(snap) - 1].chosen.id  # the token it feeds
            ids = torch.tensor([list(snap.input_ids)])
            positions = torch.arange(fed, fed + ids.shape[1]).unsqueeze(0)
            assert list(snap.positions) == positions[0].tolist()
            out = model(input_ids=ids, past_key_values=cache, position_ids=positions)
            fed += ids.shape[1]
            assert int(out.logits[0, -1].argmax()) == snap.chosen.id, snap.step
        assert torch.allclose(out.logits[0, -1].float(), session.last_logits, atol=1e-4)
        # the bug kvtui's own chat must not commit: decoding at the cache's physical length gives other logits
        wrong = copy.deepcopy(cache)
        pending = torch.tensor([[session.pending.id]])
        at_slots = model(
            input_ids=pending, past_key_values=wrong, position_ids=torch.tensor([[wrong.get_seq_length()]])
        )
        right = model(input_ids=pending, past_key_values=cache, position_ids=torch.tensor([[fed]]))
        assert float((at_slots.logits - right.logits).abs().max()) > 1e-3
    assert session.cursor == fed and session.cache_length == 20 + (fed - n)


def test_rewind_crops_what_was_appended_and_reprefills_inside_the_compressed_prefill(llama):
    session = _session(llama, max_new_tokens=5)
    logits = {}
    session.on_snapshot.add(lambda s: logits.__setitem__(len(s.buffer), session.last_logits.clone()))
    session.send(PROMPT)
    session.generate()
    n = session.held.logical
    length = len(session.buffer)
    slots = session.cache_length
    session.rewind(2)  # two appended tokens: cropped, the one before them re-fed
    assert len(session.buffer) == length - 2 and session.cache_length == slots - 2
    assert torch.allclose(session.last_logits, logits[length - 2], atol=1e-5)
    assert session.held.logical == n and session.cursor == length - 2
    cut = n // 2  # inside the prefill the press compressed: those tokens are prefilled again under the press
    session.rewind_to(cut)
    assert len(session.buffer) == cut == session.cursor and session.held.logical == cut
    assert session.cache_length == int(cut * 0.5)
    assert [d.code for d in session.diagnostics].count("cache-evicted") == 2
    assert not [d for d in session.diagnostics if d.severity != "info"], session.diagnostics
    session.generate()  # and the chat goes on from there
    assert session.cursor == len(session.buffer) > cut


def test_verify_under_a_press_reports_its_cost_not_a_mismatch(llama):
    session = _session(llama)
    session.send(PROMPT)
    session.generate()
    result = session.verify()
    assert result.ok and result.compressed_kl is not None and result.compressed_kl > 0
    assert result.compressed_top1 in (True, False)
    codes = [d.code for d in session.diagnostics]
    assert "compression-cost" in codes and "cache-mismatch" not in codes
    note = next(d for d in session.diagnostics if d.code == "compression-cost")
    assert "--press knorm:0.5" in note.message and "KL(full ‖ compressed)" in note.message
    # no hook left behind: the press is on the model only for its prefill
    assert sum(len(m._forward_hooks) for m in session.model.modules()) == 0


def test_refusals_are_one_line_and_leave_nothing_behind(llama):
    from kvtui.engine.chat.session import SessionError

    with pytest.raises(SessionError, match="--press knorm:0.5 cannot run here: --cache static"):
        _session(llama, cache="static", max_cache_len=64)
    with pytest.raises(SessionError, match="--attention"):
        _session(llama, attention=True)


def _kvtui(*args, cwd=None):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-m", "kvtui.cli", *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        cwd=cwd,
    )


def test_headless_press_and_compare_beside_a_full_cache(tmp_path):
    script = tmp_path / "chat.txt"
    script.write_text(PROMPT + "\n and then the cat\n")
    trace = tmp_path / "run.jsonl"
    run = _kvtui(
        "tiny:llama", "--headless", "--mode", "completion", "--script", script, "--press", "knorm:0.5",
        "--max-new-tokens", "4", "--verify-every", "3", "--trace", trace,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "press knorm:0.5" in run.stdout and "KnormPress kept" in run.stdout
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    assert lines[0]["press"] == "knorm:0.5"
    codes = {d["code"] for line in lines for d in line.get("diagnostics") or []} | {
        line["code"] for line in lines if line.get("type") == "diagnostic"
    }
    assert codes == {"cache-evicted", "compression-cost"}, codes
    verifies = [line for line in lines if line.get("type") == "verify"]
    assert verifies and all(v["ok"] and v["compressed_kl"] is not None for v in verifies)

    compare = _kvtui(
        "compare", "tiny:llama", "--caches", "dynamic,press:knorm:0.5", "--script", script, "--headless",
        "--max-new-tokens", "4", "--threads", "1", "--trace-dir", tmp_path,
    )  # fmt: skip
    assert compare.returncode in (0, 1), compare.stderr[-3000:]  # 1: the tokens differ (the press's doing)
    out = compare.stdout
    assert re.search(r"^dynamic\s+\d", out, re.M) and re.search(r"^press:knorm:0\.5\s+\d", out, re.M), out
    cost = re.search(
        r"^press:knorm:0\.5: holds at most (\d+) of (\d+) tokens fed per layer.*top-1 agrees (\d)/2", out, re.M
    )
    assert cost and int(cost[1]) < int(cost[2]), out
    assert ("tokens identical: yes" in out) == (compare.returncode == 0)
    assert (tmp_path / "compare-press-knorm-0.5.jsonl").exists()


def test_the_panes_show_what_the_chat_cache_holds(llama):
    """The step screen's pure render functions on the chat's own snapshot: slots held of tokens fed, the held runs,
    and the buffer greys exactly what layer 0 no longer holds (streaming: the middle)."""
    from kvtui.widgets.step.cursor_pane import kind_summary
    from kvtui.widgets.step.layers_pane import kept_strip, layer_cells
    from kvtui.widgets.step.token_grid import buffer_title

    session = _session(llama, press="streaming:4+16", max_new_tokens=2)
    session.send(PROMPT)
    session.generate()
    snapshot = session.last
    n = session.held.logical
    fed = len(snapshot.buffer)
    layer = snapshot.layers[0]
    cells = [c.plain for c in layer_cells(layer)]
    assert f"{20 + fed - n} of {fed}" in cells and f"holds 0–3, {n - 16}–{fed - 1}" in cells, cells
    assert f"of {fed} fed" in kept_strip(snapshot.layers).plain
    assert kind_summary(snapshot) == f"{20 + fed - n} slots of {fed} fed (compressed)"
    assert buffer_title(snapshot, layer).endswith(f"holds {20 + fed - n} of {fed}: 0–3, {n - 16}–{fed - 1}")
    assert [i for i in range(fed) if not layer.holds(i)] == list(range(4, n - 16))


def test_a_restarted_engine_restores_the_press_prefill_then_the_rest(llama):
    """restore() (what a restarted engine process runs): the press's prefill replayed, then what followed it, so
    the new cache holds what the old one held and gives the same logits."""
    session = _session(llama)
    session.send(PROMPT)
    session.generate()
    session.send(" and then")
    tokens, state = list(session.buffer), session.restorable()
    assert state["press_at"] == session.held.logical < len(tokens)
    fresh = _session(llama)
    fresh.restore(tokens, state)
    assert fresh.held.slots == session.held.slots and fresh.held.fed_total == session.held.fed_total
    assert fresh.cache_length == session.cache_length and fresh.cursor == session.cursor
    assert torch.allclose(fresh.last_logits, session.last_logits, atol=1e-5)
