"""Capture on, no attention: the step says why in one line (`StepSnapshot.attention_off`), from the engine, in the
trace (replay shows it too; a trace without it still reads), and nowhere when the attention is there. The model:
tiny Falcon, whose modeling code calls torch's sdpa itself instead of transformers' attention interface (read
here from its module's names, not from kvtui)."""

from __future__ import annotations

import sys

import torch
from transformers import DynamicCache

import kvtui
from kvtui.engine import ChatSession, SessionConfig
from kvtui.engine.records.codec import _step, step_record

TEXT = "The attention layer reads the keys and values of earlier tokens."


def bypasses_the_interface(model) -> bool:
    names = vars(sys.modules[type(model).__module__])
    return "ALL_ATTENTION_FUNCTIONS" not in names and "eager_attention_forward" not in names


def test_a_model_that_bypasses_the_interface_says_why(tiny_model):
    model, tokenizer = tiny_model("falcon")
    assert bypasses_the_interface(model)
    ids = tokenizer(TEXT, return_tensors="pt")["input_ids"]
    snapshots = []
    with torch.no_grad(), kvtui.watch(model, tokenizer, attention=True, on_snapshot=snapshots.append):
        cache = DynamicCache(config=model.config)
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
        model(input_ids=out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)
    assert len(snapshots) == 2
    for snapshot in snapshots:
        assert snapshot.attention is None
        reason = snapshot.attention_off
        assert reason and "\n" not in reason and len(reason) < 160, reason
        assert "FalconAttention" in reason and "attention interface" in reason, reason
    record = step_record(snapshots[-1])  # the trace carries it; replay reads it back
    assert record["attention_off"] == snapshots[-1].attention_off
    assert _step(record, snapshots[-1].buffer).attention_off == snapshots[-1].attention_off
    old = {k: v for k, v in record.items() if k != "attention_off"}  # a trace written before it
    assert _step(old, snapshots[-1].buffer).attention_off is None


def test_kvtuis_own_chat_says_why_too(tiny_model):
    model, tokenizer = tiny_model("falcon")
    session = ChatSession(model, tokenizer, SessionConfig(max_new_tokens=2, attention=True))
    try:
        snapshot = session.send("What is k?")
        assert snapshot.attention is None and "FalconAttention" in (snapshot.attention_off or "")
    finally:
        session.close_attention()


def test_no_reason_where_the_attention_is_there_or_capture_is_off(tiny_model):
    model, tokenizer = tiny_model("llama")
    ids = tokenizer(TEXT, return_tensors="pt")["input_ids"]
    for attention in (True, False):
        snapshots = []
        with torch.no_grad(), kvtui.watch(model, tokenizer, attention=attention, on_snapshot=snapshots.append):
            model(input_ids=ids, past_key_values=DynamicCache(config=model.config), use_cache=True)
        assert (snapshots[0].attention is not None) == attention and snapshots[0].attention_off is None
        assert "attention_off" not in step_record(snapshots[0])


def test_headless_watch_says_it_once_with_its_count(tiny_dir, tmp_path):
    import subprocess

    program = tmp_path / "falcon_loop.py"
    program.write_text(
        "import sys\nimport torch\nfrom transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache\n"
        "tok = AutoTokenizer.from_pretrained(sys.argv[1])\n"
        "model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)\n"
        "ids = tok('The attention layer reads the keys', return_tensors='pt')['input_ids']\n"
        "cache = DynamicCache(config=model.config)\n"
        "with torch.no_grad():\n"
        "    out = model(input_ids=ids, past_key_values=cache, use_cache=True)\n"
        "    model(input_ids=out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)\n"
    )
    result = subprocess.run(
        [sys.executable, "-m", "kvtui.cli", "watch", "--headless", "--attention", str(program)]
        + [str(tiny_dir("falcon"))],
        capture_output=True,
        text=True,
        timeout=600,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("attention off:")]
    assert lines == ["attention off: FalconAttention bypasses transformers' attention interface (2 step(s))"], lines
