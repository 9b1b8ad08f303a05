"""The miss rules of an attached server on a watched batching server's requests: one edit rule (reading/edits.py)
and one code, `recomputed-prefix`, whatever the edit; `short-prompt` for prompts shorter than one block, counted;
`prefix-under-block` for a start shared with a held request that is shorter than one block (the server's judgement).
Judged on hand-built packed forwards (the lanes), against the server's rules on the same tokens, and on a real
continuous-batching manager of a tiny model, watched."""

from __future__ import annotations

import pytest
from serving_runs import run_watched_manager

from kvtui.engine.batching.checks import UnderBlock, under_block_diagnostic
from kvtui.engine.batching.lanes import RequestLanes
from kvtui.engine.batching.packed import PREFILL, PackedForward, PackedRequest
from kvtui.engine.reading.edits import REALIGN_SEARCH, edit_words, under_block_words
from kvtui.engine.reading.introspect.paged import CacheGroup
from kvtui.engine.reading.token_texts import TokenTexts
from kvtui.engine.server.kv_events import BlocksStored, EventBatch
from kvtui.engine.server.prefix_cache import PrefixCache

try:
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
except ImportError:  # 4.57: continuous batching sizes its cache from accelerator memory, it does not run on CPU
    ContinuousBatchingConfig = None

BLOCK = 8
CACHED = list(range(1000, 1320))  # 320 tokens: 40 blocks of 8


def prefill(request_id: str, prompt: list[int], held_before: int = 0) -> PackedRequest:
    fed = tuple(prompt[held_before:])
    return PackedRequest(
        request_id=request_id,
        start=0,
        end=len(fed),
        fed_ids=fed,
        positions=tuple(range(held_before, len(prompt))),
        phase=PREFILL,
        status="prefilling",
        held_before=held_before,
        prompt_length=len(prompt),
        generated=0,
        planned=len(fed),
        blocks=(),
        prompt_ids=tuple(prompt),
    )


def forward(*requests: PackedRequest, sharing: bool = True, block: int = BLOCK) -> PackedForward:
    group = CacheGroup("full_attention", (0,), block, 64, 0, 64, 0, 0)
    ids = tuple(r.request_id for r in requests)
    return PackedForward(requests, (group,), sum(r.n for r in requests), sharing, sharing, ids, (), "allocators")


def reworded(cached: list[int], at: int, left: int, put: list[int]) -> list[int]:
    return cached[:at] + put + cached[at + left :]


EDITS = [  # (left, put): another length, a pure insertion, a deletion, a one-token swap
    (4, list(range(5000, 5007))),
    (0, [5100, 5101]),
    (5, []),
    (1, [5200]),
]


@pytest.mark.parametrize(("left", "put"), EDITS)
def test_any_edit_of_a_held_prompt_is_found_by_the_same_rule_as_on_a_server(left, put):
    """The same tokens judged by a batching server's lanes and by an attached server's rules: the same difference,
    the same edit, the same words (one implementation)."""
    new = reworded(CACHED, 11, left, put)
    lanes = RequestLanes()
    lanes.observe(forward(prefill("a", CACHED)), 1)
    changes = lanes.observe(forward(prefill("b", new, held_before=8)), 2)  # its first block shared by a match
    (edit,) = changes.edits
    assert (edit.request_id, edit.holder, edit.differs_at, edit.edit) == ("b", "a", 11, (left, len(put)))
    assert edit.count == len(CACHED) - 11 - left  # the held text after the edit, computed again
    assert lanes.get("b").recomputed == edit.count

    cache = PrefixCache(TokenTexts())  # the server: the same prompts as KV events, blocks of 8
    cache.apply(EventBatch(0, 0.0, (BlocksStored(tuple(f"a{i}" for i in range(40)), None, tuple(CACHED), BLOCK),)))
    blocks = len(new) // BLOCK
    keys = tuple(f"n{i}" for i in range(blocks - 1))
    cache.apply(EventBatch(1, 1.0, (BlocksStored(keys, "a0", tuple(new[BLOCK : blocks * BLOCK]), BLOCK),)))
    (note,) = [n for n in cache.notes if n.code == "recomputed-prefix"]
    assert note.where.position == edit.differs_at

    text = TokenTexts().text  # ids by number ('#1011'), as the server's cache words them without a tokenizer
    words = edit_words(edit.holder_tail, edit.tail, 0, edit.edit, text)
    assert words == edit_words(CACHED, new, 11, edit.edit, text)
    assert words in note.message  # "" for a one-token swap: both name the two tokens instead


def test_another_question_after_a_shared_start_or_an_edit_past_the_bound_is_no_miss():
    lanes = RequestLanes()
    lanes.observe(forward(prefill("a", CACHED)), 1)
    other = CACHED[:40] + list(range(7000, 7100))  # says something else from token 40 on
    far = reworded(CACHED, 11, 4, list(range(6000, 6000 + REALIGN_SEARCH + 10)))  # an edit longer than the bound
    changes = lanes.observe(forward(prefill("b", other, 40), prefill("c", far, 8)), 2)
    assert changes.edits == () and changes.short == ()


def test_another_one_token_question_before_the_same_turn_end_is_no_miss_on_either_path():
    """Seen in `transformers serve`: 'Hi' then 'Hello' after the same system turn; the template's turn end (6 tokens)
    follows both, then the first request's answer, where the second prompt ends: another question, no note."""
    system, end, answer = list(range(100, 111)), list(range(200, 206)), list(range(300, 307))
    held, new = [*system, 7000, *end, *answer], [*system, 7001, *end]
    lanes = RequestLanes()
    lanes.observe(forward(prefill("hi", held)), 1)
    assert lanes.observe(forward(prefill("hello", new)), 2).edits == ()
    cache = PrefixCache(TokenTexts())  # blocks of 8 hold prompt and answer alike
    cache.apply(EventBatch(0, 0.0, (BlocksStored(("a0", "a1", "a2"), None, tuple(held[:24]), BLOCK),)))
    answered = [*new, 400, 401, 402, 403, 404, 405]
    cache.apply(EventBatch(1, 1.0, (BlocksStored(("b1", "b2"), "a0", tuple(answered[8:24]), BLOCK),)))
    assert cache.notes == []


def test_short_prompts_are_counted_and_noted_once_per_doubling():
    lanes = RequestLanes()
    notes = []
    for i in range(9):
        prompt = list(range(100 * i, 100 * i + BLOCK - 1))  # one token short of a block
        notes += lanes.observe(forward(prefill(f"s{i}", prompt)), i + 1).short
    full = lanes.observe(forward(prefill("full", list(range(5000, 5000 + BLOCK)))), 10)  # fills one block
    assert full.short == () and lanes.short_prompts == 9
    assert [(n.request_id, n.count, n.prompt_length, n.block_tokens) for n in notes] == [
        ("s0", 1, 7, 8),
        ("s1", 2, 7, 8),
        ("s3", 4, 7, 8),
        ("s7", 8, 7, 8),
    ]
    off = RequestLanes()  # without prefix sharing nothing is shared anyway: no note
    assert off.observe(forward(prefill("x", [1, 2, 3]), sharing=False), 1).short == ()


def test_a_shared_start_under_one_block_is_the_servers_judgement_counted_the_same_way():
    big = 64
    system = list(range(1000, 1040))  # 40 shared tokens, under one block of 64
    lanes = RequestLanes()
    lanes.observe(forward(prefill("a", system + list(range(2000, 2090))), block=big), 1)
    found = []
    for i in range(9):
        found += lanes.observe(
            forward(prefill(f"q{i}", system + list(range(3000 + 100 * i, 3090 + 100 * i))), block=big), i + 2
        ).under
    assert [(f.request_id, f.holder, f.shared, f.block_tokens, count) for f, count in found] == [
        ("q0", "a", 40, 64, 1),
        ("q1", "a", 40, 64, 2),
        ("q3", "a", 40, 64, 4),
        ("q7", "a", 40, 64, 8),
    ]
    none = RequestLanes()  # never seen, a template-sized start, a prompt under one block (short-prompt's), a match
    none.observe(forward(prefill("a", system + list(range(2000, 2090))), block=big), 1)
    quiet = [
        prefill("never", list(range(5000, 5100))),
        prefill("header", system[:10] + list(range(6000, 6100))),
        prefill("short", system + [7000]),
        prefill("matched", system + list(range(2000, 2030)) + list(range(8000, 8050)), held_before=64),
    ]
    changes = none.observe(forward(*quiet, block=big), 2)
    assert changes.under == () and [s.request_id for s in changes.short] == ["short"]

    cache = PrefixCache(TokenTexts())  # the same two prompts as a server's events: one rule, the same words
    held, new = system + list(range(2000, 2088)), system + list(range(3000, 3088))
    cache.apply(EventBatch(0, 0.0, (BlocksStored(("a0",), None, tuple(held[:big]), big),)))
    (note,) = cache.apply(EventBatch(1, 1.0, (BlocksStored(("b0",), None, tuple(new[:big]), big),)))
    assert note.code == "prefix-under-block" and under_block_words(40, 64, 1) in note.message
    diagnostic = under_block_diagnostic(UnderBlock("q0", "a", False, 40, 64), 1, 2)
    assert diagnostic.message == (f"request q0 starts as request a (finished) does and {under_block_words(40, 64, 1)}")


@pytest.fixture(scope="module")
def manager_run(tiny_dir):
    """Requests one after another on one watched manager with prefix sharing: a held prompt, the same with a
    sentence reworded to another length, a short prompt, one that fills a block, another question."""
    if ContinuousBatchingConfig is None:
        pytest.skip("continuous batching runs on CPU from transformers 5.x (4.57 sizes its cache from GPU memory)")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_dir("llama")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa")

    def ids(text: str) -> list[int]:
        return list(tokenizer(text)["input_ids"])

    rules = " ".join(f"Rule {n}: answer in plain words and cite the page you read it on." for n in range(8))
    prompts = {
        "held": ids(f"You are a helpful teaching assistant. {rules} Question: what is a cache?"),
        "reworded": ids(f"You are a friendly tutor for a small school. {rules} Question: what is a cache?"),
        "short": ids("Hi there"),
        "one-block": ids("Tell me, in a few plain words, what a key value cache keeps for the model."),
        "other": ids(f"You are a helpful teaching assistant. {rules} Question: why do positions matter?"),
    }
    return tokenizer, prompts, run_watched_manager(model, tokenizer, prompts, page_size=16, num_blocks=64)


def test_a_watched_batching_server_names_a_reworded_sentence_and_a_short_prompt(manager_run):
    tokenizer, prompts, watcher = manager_run
    assert len(prompts["short"]) < 16 <= len(prompts["one-block"])  # the page size
    notes = [(d.code, d.message) for d in watcher.diagnostics]
    assert sorted(code for code, _ in notes) == ["recomputed-prefix", "short-prompt"], notes
    (miss,) = [m for code, m in notes if code == "recomputed-prefix"]
    held, new = prompts["held"], prompts["reworded"]
    at = next(i for i, (a, b) in enumerate(zip(held, new)) if a != b)  # independently: where they part
    assert miss.startswith(f"request reworded left request held's tokens at token {at}: ")
    same_tail = next(i for i in range(1, len(held)) if held[-i] != new[-i]) - 1  # the text after the edit
    assert f"; {same_tail} tokens after it that request held held (it has finished) were computed again" in miss
    assert "became" in miss  # words of another length in place of the held ones
    (short,) = [m for code, m in notes if code == "short-prompt"]
    assert (
        short.startswith(f"request short's prompt has {len(prompts['short'])} tokens, fewer than one block of 16: ")
        and "(1 such prompt so far;" in short
    )
    requests = {rid: view for (_, rid), view in watcher.requests.items()}
    assert requests["reworded"].recomputed >= same_tail


def test_a_watched_batching_server_with_large_blocks_names_a_system_prompt_under_one_block(tiny_dir):
    """A real continuous-batching manager (blocks of 64, prefix sharing on), watched: two prompts whose shared system
    prompt is under one block share nothing, and the second says so; the cache shared none of it (its hit is 0)."""
    if ContinuousBatchingConfig is None:
        pytest.skip("continuous batching runs on CPU from transformers 5.x (4.57 sizes its cache from GPU memory)")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_dir("llama")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa")
    system = "You are a helpful teaching assistant. Answer briefly."
    first = " ".join(f"Fact {n}: the sky was {n} shades of blue today." for n in range(8))
    second = " ".join(f"Why do rivers number {n} bend west near old mills?" for n in range(8))  # another question
    prompts = {
        "first": list(tokenizer(f"{system} {first}")["input_ids"]),
        "second": list(tokenizer(f"{system} {second}")["input_ids"]),
    }
    shared = next(i for i, (a, b) in enumerate(zip(*prompts.values())) if a != b)  # independently: where they part
    assert 16 <= shared < 64 <= min(map(len, prompts.values()))
    watcher = run_watched_manager(model, tokenizer, prompts, page_size=64, num_blocks=16)
    notes = [(d.code, d.message) for d in watcher.diagnostics]
    assert [code for code, _ in notes] == ["prefix-under-block"], notes
    assert notes[0][1].startswith(
        f"request second starts as request first (finished) does and shares its first {shared} tokens"
    )
    assert "fewer than one block of 64 tokens" in notes[0][1]
    requests = {rid: view for (_, rid), view in watcher.requests.items()}
    assert requests["second"].prefix_hit == 0
