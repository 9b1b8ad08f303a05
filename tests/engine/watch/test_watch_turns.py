"""A watched cache's turns are the prefills it still holds: a throwaway forward (a warm-up whose tokens the program
discards with reset() or crop, a forward on a cache the model makes and the program drops, a forward with no cache
at all) is not a turn of the chat that follows. The expected turns are written from what each program did."""

import json
import subprocess
import sys
from pathlib import Path

import torch
from transformers import DynamicCache

from kvtui.engine.watch.probe import watch
from program_headers import model_dir

ROOT = Path(__file__).resolve().parents[3]
PROGRAM = ROOT / "tests" / "watch_corpus" / "warmup_then_chat.py"


def forward(model, ids, cache=None, **kwargs):
    with torch.no_grad():
        return model(input_ids=ids, past_key_values=cache, **kwargs)


def test_turns_count_only_the_prefills_the_cache_still_holds(tiny_model):
    model, tok = tiny_model("llama")
    a = tok("the cat sat on the mat", return_tensors="pt")["input_ids"]
    b = tok("and then it went to sleep", return_tensors="pt")["input_ids"]
    snapshots = []
    with watch(model, tok, on_snapshot=snapshots.append):
        cache = DynamicCache(config=model.config)
        forward(model, a[:, :1])  # a cache the model makes, dropped: not this cache's
        forward(model, a, use_cache=False)  # no cache at all
        forward(model, a, cache)  # warm-up on the chat's cache ...
        cache.crop(-a.shape[1])  # ... discarded (reset() would, on 5.x: 4.57's zeroes the tensors, keeps the length)
        forward(model, a, cache)  # the chat's turn 1
        forward(model, a[:, -1:], cache)  # a decode step of it
        forward(model, b, cache)  # turn 2
        cache.crop(-b.shape[1])  # all of turn 2 cut away (a rewind): turn 2 was never kept
        forward(model, b, cache)  # turn 2 again
        cache.crop(-1)  # part of it kept
        forward(model, b[:, :3], cache)  # turn 3
        cache.reset()
        emptied = int(cache.get_seq_length()) == 0  # 5.x; 4.57's reset() zeroes the tensors and keeps the length
        forward(model, a, cache)  # after a reset that emptied it: turn 1 again
    chat = [s for s in snapshots if s.cache_id == snapshots[-1].cache_id]
    assert [s.turn for s in chat[:-1]] == [1, 1, 1, 2, 2, 3]  # the warm-up's prefill, then the chat's
    assert [s.turn for s in snapshots[:2]] == [0, 0]  # a 1-token forward on its own cache; no cache
    n, m = a.shape[1], b.shape[1]
    assert [t.turn for t in snapshots[-2].buffer] == [1] * (n + 1) + [2] * (m - 1) + [3] * 3
    if emptied:
        assert chat[-1].turn == 1
    else:  # 4.57: the slots stay (zeroed), so kvtui's rows stay too, and the next prefill continues them
        assert chat[-1].turn == 4 and len(chat[-1].buffer) == len(snapshots[-2].buffer) + n
        assert chat[-1].positions[0] == len(snapshots[-2].buffer)


def test_a_warm_up_before_the_chat_is_not_a_turn(tmp_path):
    """The corpus program warms up three ways, then chats three turns through generate() on the warmed (and
    emptied) cache: the trace's prefills on that cache after it was emptied are turns 1, 2, 3."""
    trace = tmp_path / "warm.jsonl"
    result = subprocess.run(
        [sys.executable, "-m", "kvtui.cli", "watch", "--headless", "--trace", str(trace), str(PROGRAM)]
        + [str(model_dir("tiny:qwen2"))],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    steps = [r for r in records if r["type"] == "step"]
    chat = steps[-1]["cache_id"]
    resets = [i for i, r in enumerate(records) if r["type"] == "diagnostic" and ".crop(" in r["message"]]
    assert len(resets) == 1
    after = [r for r in records[resets[0] :] if r["type"] == "step"]
    assert all(s["cache_id"] == chat for s in after)
    prefills = [s["turn"] for s in after if s["phase"] == "prefill" and len(s["input_ids"]) > 1]
    assert prefills[-3:] == [1, 2, 3] and set(prefills) == {1, 2, 3}, prefills
    assert [s["turn"] for s in steps if s["cache_id"] != chat] == [0, 0]  # the dropped cache's, no cache's
