"""The sample notebook in a real kernel (nbclient + ipykernel), asserting on the HTML it shows; and the
notebook view's own guarantees (escaping, a render error is a line of text, the engine stays Rich-free)."""

from __future__ import annotations

import html
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "samples" / "cache-pitfalls.ipynb"


def _text(markup: str) -> str:
    """What the HTML reads as: tags dropped, entities decoded."""
    return html.unescape(re.sub(r"<[^>]+>", "", markup))


def _html_outputs(cell) -> list[str]:
    return [o["data"]["text/html"] for o in cell.get("outputs", []) if "text/html" in o.get("data", {})]


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    nbformat = pytest.importorskip("nbformat")
    from nbclient import NotebookClient

    work = tmp_path_factory.mktemp("notebook")
    shutil.copy(NOTEBOOK, work / NOTEBOOK.name)
    notebook = nbformat.read(work / NOTEBOOK.name, as_version=4)
    # one cell of the test's own: a loop slow enough (~5 s) for the live view to redraw while it runs, even
    # when a redraw costs 30 ms on a busy machine (redraws are then 1.5 s apart)
    notebook.cells.append(
        nbformat.v4.new_code_cell(
            "import time\nwatch = kvtui.watch(model, tokenizer, display='live')  # test: slow loop\n"
            "cache = DynamicCache(config=model.config)\n"
            "out = model(input_ids=ids, past_key_values=cache, use_cache=True)\n"
            "for _ in range(50):\n    time.sleep(0.1)\n"
            "    out = model(input_ids=out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)\n"
            "print('during the loop', kvtui.notebook.live_display(watch).updates)\nwatch.detach()"
        )
    )
    import os

    os.environ["KVTUI_NOTEBOOK_MODEL"] = "tiny"  # the kernel inherits it: a tiny model built offline
    try:
        NotebookClient(
            notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(work)}}
        ).execute()
    finally:
        os.environ.pop("KVTUI_NOTEBOOK_MODEL", None)
    return notebook, work


def _cell(notebook, marker: str):
    return next(c for c in notebook.cells if c.cell_type == "code" and marker in c.source)


def _reference(work):
    """Lesson 1 again, without kvtui: the same tiny model, the same generate(), numbers read from torch."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvtui.engine.models.tiny import build_tiny

    path = build_tiny("qwen2", work / "reference")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**inputs, max_new_tokens=12, do_sample=False, return_dict_in_generate=True)
    keys = out.past_key_values.layers[0].keys
    with torch.inference_mode():  # the last forward fed every token but the last one generated
        logits = model(input_ids=out.sequences[:, :-1], use_cache=False).logits[0, -1]
    probs = torch.softmax(logits.float(), -1)
    top = int(probs.argmax())
    return tuple(keys.shape), top, float(probs[top]), out.sequences.shape[1] - 1


def test_lesson_one_shows_specials_shapes_and_topk(executed):
    from kvtui.widgets.step.topk_pane import format_prob

    notebook, work = executed
    outputs = _html_outputs(_cell(notebook, 'trace="lesson1.jsonl"'))
    assert len(outputs) == 1
    shown = outputs[0]
    # special tokens: escaped, and drawn as a block (reverse: a background colour)
    assert re.search(r'<span style="[^"]*background-color[^"]*">&lt;\|im_start\|&gt;</span>', shown), shown[:2000]
    k_shape, top_id, top_prob, cached = _reference(work)
    text = _text(shown)
    assert "×".join(map(str, k_shape)) in text and k_shape[2] == cached
    row = next(line for line in text.splitlines() if re.match(rf"\s*1\s.*\s{top_id}\s", line))
    assert format_prob(top_prob) in row
    assert "diagnostics · none" in text


def test_pitfall_cells_show_their_alarms(executed):
    notebook, _ = executed
    stale = _text(_html_outputs(_cell(notebook, '"What is k?", "What is the capital'))[0])
    assert "stale-cache" in stale
    primed = _text(_html_outputs(_cell(notebook, 'the "warm-up"'))[0])
    assert "pad-in-cache" in primed
    # the pads are in the strip, in front of the chat, at positions 0..7
    assert re.search(r"0\s<\|endoftext\|>\s1\s<\|endoftext\|>", primed)


def test_live_display_is_one_output_updated_to_the_last_step(executed):
    notebook, _ = executed
    cell = _cell(notebook, 'display="live"')
    outputs = _html_outputs(cell)
    assert len(outputs) == 1  # updated in place, not appended
    printed = "".join(o.get("text", "") for o in cell.outputs if o.get("output_type") == "stream")
    steps = int(re.search(r"(\d+) forwards.*redrawn \d+ times while the loop ran", printed).group(1))
    assert steps == 41
    assert f"step {steps} · decode" in _text(outputs[0])  # the final state, drawn when the cell ended
    slow = _cell(notebook, "# test: slow loop")
    outputs = _html_outputs(slow)
    assert len(outputs) == 1 and "step 51 · decode" in _text(outputs[0])
    printed = "".join(o.get("text", "") for o in slow.outputs if o.get("output_type") == "stream")
    assert int(re.search(r"during the loop (\d+)", printed).group(1)) >= 2  # redrawn while the loop ran


def test_replay_shows_the_trace_last_step(executed):
    notebook, _ = executed
    text = _text(_html_outputs(_cell(notebook, "kvtui.replay("))[0])
    assert "replay" in text and "12 steps" in text and "step 12 · decode" in text


def test_token_text_is_escaped_and_a_render_error_is_one_line():
    from kvtui.engine.records.snapshot import BufferToken, StepSnapshot, TokenBuffer, TopToken
    from kvtui.notebook import html as to_html

    tokens = [
        BufferToken(position=i, id=i, piece=p, special=i == 0, origin="user", turn=1)
        for i, p in enumerate(["<s>", "<script>alert(1)</script>", "&amp;"])
    ]
    snap = StepSnapshot(
        step=1,
        phase="prefill",
        turn=1,
        input_ids=(0, 1, 2),
        positions=(0, 1, 2),
        cursor=3,
        cache_seq_length=3,
        capacity=None,
        layers=(),
        topk=(TopToken(5, "<b>", 1.0, 0.5, 1),),
        topk_processed=(TopToken(5, "<b>", 1.0, 0.5, 1),),
        watched=(),
        chosen=None,
        chosen_forced=False,
        diagnostics=(),
        forward_ms=1.0,
        snapshot_ms=0.1,
        buffer=TokenBuffer(tokens),
    )
    shown = to_html(snap)
    assert "<script>" not in shown and "<b>" not in shown and "&lt;script&gt;" in shown and "&amp;amp;" in shown
    broken = StepSnapshot(
        **{
            **{
                f: getattr(snap, f)
                for f in (
                    "step",
                    "phase",
                    "turn",
                    "input_ids",
                    "positions",
                    "cursor",
                    "cache_seq_length",
                    "capacity",
                    "topk",
                    "topk_processed",
                    "watched",
                    "chosen",
                    "chosen_forced",
                    "diagnostics",
                    "forward_ms",
                    "snapshot_ms",
                    "buffer",
                )
            },
            "layers": ("not a layer",),
        }
    )
    error = to_html(broken)
    assert error.startswith('<pre class="kvtui-error">kvtui could not draw this StepSnapshot') and len(error) < 400


def test_import_kvtui_registers_formatters_only_inside_ipython():
    code = (
        "import sys, kvtui; "
        "print(','.join(m for m in ('IPython', 'rich', 'kvtui.notebook', 'torch') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
    code = (
        "from IPython.core.interactiveshell import InteractiveShell; shell = InteractiveShell.instance(); "
        "import sys, kvtui; f = shell.display_formatter.formatters['text/html']; "
        "print(('kvtui.engine.records.snapshot', 'StepSnapshot') in f.deferred_printers, "
        "'kvtui.notebook' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "False"]


def test_a_step_with_attention_shows_a_heat_map_of_layers_by_positions():
    """watch(attention=True) in a notebook: the step's view holds one heat-map line per layer, its cells shaded
    by that layer's recorded weights (the largest full), a layer without attention drawn as dots."""
    from kvtui.engine.records.snapshot import BufferToken, StepSnapshot, TokenBuffer
    from kvtui.notebook import html as to_html
    from kvtui.widgets.step.attention_strip import render_heatmap

    tokens = [BufferToken(position=i, id=i, piece=f"t{i}", special=False, origin="user", turn=1) for i in range(4)]
    snap = StepSnapshot(
        step=1,
        phase="prefill",
        turn=1,
        input_ids=(0, 1, 2, 3),
        positions=(0, 1, 2, 3),
        cursor=4,
        cache_seq_length=4,
        capacity=None,
        layers=(),
        topk=(),
        topk_processed=(),
        watched=(),
        chosen=None,
        chosen_forced=False,
        diagnostics=(),
        forward_ms=1.0,
        snapshot_ms=0.1,
        buffer=TokenBuffer(tokens),
        attention=(((0, 0.8), (3, 0.2), (1, 0.0), (2, 0.0)), None, ((3, 0.5), (2, 0.5), (0, 0.0), (1, 0.0))),
    )
    lines = render_heatmap(snap, 80).plain.splitlines()
    assert lines[1:] == ["L0 █  ░", "L1 ····", "L2   ██"]
    import html
    import re

    shown = html.unescape(re.sub("<[^>]+>", "", to_html(snap)))  # the text the output shows
    assert "attention of the newest token" in shown and "L0 █  ░" in shown
