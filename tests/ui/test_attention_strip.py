"""The attention strip on screen (replayed traces, 80x24 and 120x36): the rows of a two-turn chat are a partition
(the earlier turn has its row, the percentages add to 100 up to rounding) and fit the strip; a model whose
attention kvtui cannot capture shows the engine's reason where the rows would be."""

from __future__ import annotations

import re

import pytest

from kvtui import viewers
from kvtui.engine import ChatSession, SessionConfig
from kvtui.engine.records.codec import buffer_record, to_record
from kvtui.engine.records.trace import TraceWriter, header_record
from kvtui.widgets.step.attention_strip import AttentionStrip
from pilot_helpers import wait_for

SIZES = [(80, 24), (120, 36)]


def record_chat(model, tok, path, messages, system=None):
    session = ChatSession(model, tok, SessionConfig(max_new_tokens=4, attention=True, system=system))
    try:
        with TraceWriter(path, header_record(session, "tiny", "tiny")) as writer:
            session.on_snapshot.add(lambda snapshot: writer.write(to_record(snapshot)))
            for message in messages:
                session.send(message)
                session.generate()
                writer.write(buffer_record(session.buffer))
        return session.last
    finally:
        session.close_attention()


async def strip_text(path, size):
    app = viewers.replay(path)
    async with app.run_test(size=size) as pilot:
        strip = app.query_one(AttentionStrip)
        await wait_for(pilot, lambda: strip.display and str(strip.render()).strip())
        driver = app.screen.driver
        for _ in range(len(driver.replay)):  # a finished recording opens on its first step: to its last
            if driver.at_end:
                break
            await pilot.press("space")
            await pilot.pause(0.05)
        assert driver.at_end
        await pilot.pause(0.3)
        return str(strip.render()), strip.region


@pytest.mark.parametrize("size", SIZES)
async def test_the_regions_of_a_second_turn_add_to_100(size, tiny_model, tmp_path):
    model, tok = tiny_model("llama")
    path = tmp_path / "chat.jsonl"
    messages = ["What is k? It is the key of a token.", "And what is v? Say it in a few words, please."]
    last = record_chat(model, tok, path, messages, system="You are terse and exact.")
    text, region = await strip_text(path, size)
    lines = text.splitlines()
    assert lines[0].startswith("attn all 2 layers · #")  # drawn to its width: the top weights too
    rows = re.findall(r"([a-z][a-z0-9 –]*?) +[ ▁▂▃▄▅▆▇█]+ +(\d+)%", "\n".join(lines[1:]))
    names = [name.strip() for name, _ in rows]
    assert {"sink", "special", "system", "turn 1", "this turn"} <= set(names), text
    assert set(names) <= {"sink", "pad", "special", "last 16", "system", "unknown", "turn 1", "this turn"}
    assert abs(sum(int(p) for _, p in rows) - 100) <= len(rows) / 2, text  # each rounded: 0.5 % at most
    # the engine's shares: the mean over layers of each row, what the strip prints, adds to 1
    detail = last.attention_detail
    assert all(abs(sum(row) - 1) < 1e-5 for row in detail.shares)
    assert len(lines) <= 5 and region.height == len(lines)  # header + the rows, two to a line past four
    assert all(len(line) <= region.width - 2 for line in lines)


@pytest.mark.parametrize("size", SIZES)
async def test_a_model_outside_the_interface_says_why(size, tiny_model, tmp_path):
    model, tok = tiny_model("falcon")
    path = tmp_path / "falcon.jsonl"
    last = record_chat(model, tok, path, ["What is k?"])
    assert last.attention is None and last.attention_off
    text, region = await strip_text(path, size)
    assert " ".join(text.split()) == last.attention_off  # the reason, whole (wrapped where narrow)
    assert "FalconAttention" in text and region.height <= 2
