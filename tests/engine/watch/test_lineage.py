"""Where every watched cache came from, what it wasted, and what was stale: copies keep their parent's
tokens (and verify on them passes), caches filled out of sight have an unknown prefix (and verify says
so), re-encoded prefixes are counted against an independent longest-common-prefix, stale caches are
named whatever made the ids, and each cache/thread keeps its own turn and caller."""

import copy
import pickle
import threading

import pytest
import torch
from transformers import DynamicCache

from kvtui.engine.reading.diagnostics import common_prefix, token_text
from kvtui.engine.watch.probe import watch

PROMPT = "the cat sat on the mat and then it went to sleep"


def codes(watcher) -> list[str]:
    return [d.code for d in watcher.diagnostics]


def prefill(model, ids, cache):
    with torch.no_grad():
        return model(input_ids=ids, past_key_values=cache, use_cache=True)


def test_a_deepcopy_is_its_own_cache_with_its_parents_tokens(tiny_model):
    model, tok = tiny_model("llama")
    ids = tok(PROMPT, return_tensors="pt")["input_ids"]  # [1, n]
    n = ids.shape[1]
    snapshots = []
    with watch(model, tok, on_snapshot=snapshots.append) as watcher:
        cache = DynamicCache(config=model.config)
        prefill(model, ids, cache)
        child = copy.deepcopy(cache)
        child.crop(-2)  # the copy's own crop: the original keeps its length
        assert (int(cache.get_seq_length()), int(child.get_seq_length())) == (n, n - 2)
        prefill(model, ids[:, -2:], child)
        step = snapshots[-1]
        assert step.cache_id != snapshots[0].cache_id
        assert (step.cache_parent, step.cache_copied_at) == (snapshots[0].cache_id, n)
        assert step.buffer.ids() == ids[0].tolist()  # the parent's tokens, then what the copy was fed
        assert [t.origin for t in step.buffer][:1] == [snapshots[0].buffer[0].origin]
        assert watcher.verify()["ok"]
    assert "cache-mismatch" not in codes(watcher)


def test_a_cache_filled_out_of_sight_has_an_unknown_prefix_and_verify_says_so(tiny_model):
    model, tok = tiny_model("llama")
    ids = tok(PROMPT, return_tensors="pt")["input_ids"]
    cache = DynamicCache(config=model.config)
    prefill(model, ids, cache)  # before watching
    loaded = pickle.loads(pickle.dumps(cache))
    snapshots = []
    with watch(model, tok, on_snapshot=snapshots.append) as watcher:
        prefill(model, ids[:, :1], loaded)
        step = snapshots[-1]
        assert step.cache_unknown == ids.shape[1] and len(step.buffer) == ids.shape[1] + 1
        assert [t.origin for t in step.buffer].count("unknown") == ids.shape[1]
        with pytest.raises(ValueError, match=f"first {ids.shape[1]} tokens were written before kvtui saw it"):
            watcher.verify()
    assert "cache-mismatch" not in codes(watcher)


def prompt_ids(tok, text, how):
    if how == "call":
        return tok(text, return_tensors="pt")["input_ids"]
    if how == "encode":
        return torch.tensor([tok.encode(text)])
    # precomputed: one id per character, so the second prompt (49 ids) is longer than what the first left in the
    # cache (41 + 3): 4.57's generate() raises IndexError before any forward when the cache holds at least as
    # many tokens as the prompt (tests/watch_corpus/reuse_forgot_deepcopy_encode.py asserts that case)
    return torch.tensor([[1, *[(7 * i + len(text)) % 200 + 20 for i in range(len(text))]]])


@pytest.mark.parametrize("how", ["call", "encode", "precomputed"])
def test_a_cache_reused_across_independent_prompts_is_stale(tiny_model, how):
    model, tok = tiny_model("llama")
    with watch(model, tok) as watcher:
        shared = DynamicCache(config=model.config)
        for text in ("the cat sat on the mat and then it slept", "a dog ran in the park and then went home to eat"):
            ids = prompt_ids(tok, text, how)
            model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                past_key_values=shared,
                max_new_tokens=3,
                do_sample=False,
                pad_token_id=tok.pad_token_id,
            )
    stale = [d for d in watcher.diagnostics if d.code == "stale-cache"]
    assert len(stale) == 1 and "test_lineage.py:" in stale[0].message, watcher.diagnostics
    assert "never fed" in stale[0].message or "whole prompt again" in stale[0].message
    assert "template-drift" not in codes(watcher)  # the same cause, said once


def test_the_docs_prompt_reuse_with_deepcopy_is_quiet(tiny_model):
    model, tok = tiny_model("llama")
    prefix = "you are a helpful assistant that answers in short words."
    with watch(model, tok) as watcher:
        prompt_cache = DynamicCache(config=model.config)
        inputs = tok(prefix, return_tensors="pt")
        prefill(model, inputs["input_ids"], prompt_cache)
        for question in (" what is the cat?", " where is the dog going today?"):
            new = tok(prefix + question, return_tensors="pt")
            model.generate(
                **new,
                past_key_values=copy.deepcopy(prompt_cache),
                max_new_tokens=3,
                do_sample=False,
                pad_token_id=tok.pad_token_id,
            )
    assert [c for c in codes(watcher) if c != "cache-edited"] == [], watcher.diagnostics


def chat_re_encoding(model, tok, turns=3):
    """A chat through generate() that re-encodes its whole history each turn (a new cache per call)."""
    history = "user: hello there, how are you doing today my friend?"
    for _ in range(turns):
        out = model.generate(
            **tok(history, return_tensors="pt"), max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id
        )
        history = tok.decode(out[0], skip_special_tokens=True) + " user: and then what happened next?"


def test_a_chat_that_re_encodes_its_history_is_counted(tiny_model):
    model, tok = tiny_model("llama")
    snapshots = []
    with watch(model, tok, on_snapshot=snapshots.append) as watcher:
        chat_re_encoding(model, tok)
    prefills = [s for s in snapshots if s.phase == "prefill"]
    assert len(prefills) == 3 and len({s.cache_id for s in prefills}) == 3
    expected = 0
    for i, step in enumerate(prefills[1:], start=1):
        earlier = [s for s in snapshots[: snapshots.index(step)] if s.cache_id == prefills[i - 1].cache_id][-1]
        held = earlier.buffer.ids()  # what the earlier cache held at its last forward
        same = common_prefix(step.buffer.ids(), held)
        assert step.recomputed == same, (step.recomputed, same)
        expected += same
    waste = [d for d in watcher.diagnostics if d.code == "recomputed-prefix"]
    assert len(waste) == 2 and all(d.severity == "info" for d in waste)
    assert f"re-encoded {prefills[1].recomputed} tokens that {prefills[0].cache_id}" in waste[0].message
    assert watcher.recomputed_tokens == expected > 0


def test_a_chat_that_reuses_its_cache_wastes_nothing(tiny_model):
    model, tok = tiny_model("llama")

    def reuse_chat():
        ids = tok("user: hello there, how are you doing today my friend?", return_tensors="pt")["input_ids"]
        cache = DynamicCache(config=model.config)
        for _ in range(3):
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                past_key_values=cache,
                max_new_tokens=4,
                do_sample=False,
                pad_token_id=tok.pad_token_id,
            )
            ids = torch.cat(
                [out, tok(" user: and then?", add_special_tokens=False, return_tensors="pt")["input_ids"]], -1
            )

    with watch(model, tok) as watcher:
        reuse_chat()
    assert "recomputed-prefix" not in codes(watcher) and "stale-cache" not in codes(watcher), watcher.diagnostics
    assert watcher.recomputed_tokens == 0


def test_two_threads_with_two_caches_keep_their_own_turns_and_callers(tiny_model):
    model, tok = tiny_model("llama")
    snapshots = []
    lock = threading.Lock()

    def work(text):
        cache = DynamicCache(config=model.config)
        for turn in range(2):
            ids = tok(text + " again" * turn, return_tensors="pt")["input_ids"]
            with lock:  # one forward at a time: the tiny model is shared
                prefill(model, ids[:, int(cache.get_seq_length()) :], cache)

    with watch(model, tok, on_snapshot=snapshots.append):
        threads = [threading.Thread(target=work, args=(text,)) for text in ("the cat sat", "a dog ran far")]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        # generate() itself as a thread's target: no program frame on that thread's stack
        runner = threading.Thread(
            target=model.generate,
            kwargs=dict(**tok("hi there", return_tensors="pt"), max_new_tokens=2, do_sample=False),
        )
        runner.start()
        runner.join()
    by_cache = {}
    for s in snapshots[:4]:
        by_cache.setdefault(s.cache_id, []).append(s)
        assert s.caller.startswith("tests/engine/watch/test_lineage.py:")
        assert s.thread and s.thread.startswith("Thread-")
    assert len(by_cache) == 2 and all([s.turn for s in steps] == [1, 2] for steps in by_cache.values())
    started_here = f"{runner.name}, started at tests/engine/watch/test_lineage.py:"
    assert all(s.caller.startswith(started_here) for s in snapshots[4:])


def test_messages_name_tokens_with_ids_and_never_a_lone_replacement_character():
    assert token_text("hi", 5) == "'hi' (id 5)"
    assert token_text("\ufffd", 226, raw="Ã¢") == "'Ã¢' (id 226)"
    assert "\ufffd" not in token_text("\ufffd", 226)
    assert token_text("<script>", 7) == "'<script>' (id 7)"


def test_replay_rebuilds_each_caches_buffer(tiny_model, tmp_path):
    from kvtui.engine.records.replay import Replay
    from kvtui.engine.records.trace import read_trace

    model, tok = tiny_model("llama")
    ids = tok(PROMPT, return_tensors="pt")["input_ids"]
    snapshots = []
    trace = tmp_path / "t.jsonl"
    with watch(model, tok, trace=trace, on_snapshot=snapshots.append):
        first = DynamicCache(config=model.config)
        prefill(model, ids, first)
        child = copy.deepcopy(first)
        other = DynamicCache(config=model.config)
        prefill(model, ids[:, :4], other)
        prefill(model, ids[:, -1:], child)
        prefill(model, ids[:, 4:6], other)
    replayed = Replay(read_trace(trace)).snapshots
    assert [s.buffer.ids() for s in replayed] == [s.buffer.ids() for s in snapshots]
    assert [s.lineage for s in replayed] == [s.lineage for s in snapshots]
