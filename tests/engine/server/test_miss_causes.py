"""Why each prefill missed the prefix cache (server/rules.py's classify_miss), one code per cause, on events built
here and, across two publishers, through the subscriber: evicted or cleared, same tokens under another hash, held
on another replica, diverged at a token whatever the edit; no note for tokens never seen."""

from __future__ import annotations

import pytest

from kvtui.engine.reading.edits import REALIGN_MIN, REALIGN_SEARCH
from kvtui.engine.reading.token_texts import TokenTexts
from kvtui.engine.server.kv_events import AllCleared, BlocksRemoved, BlocksStored, EventBatch, encode_batch
from kvtui.engine.server.prefix_cache import PrefixCache
from kvtui.engine.server.subscriber import EventEndpoint
from local_publisher import LocalPublisher
from waiting import following, wait_for

pytestmark = pytest.mark.version_free("a server's events, HTTP and traces, read by kvtui alone: no transformers code")

SIZE = 8
PROMPT = tuple(range(100, 164))  # 64 tokens: 8 blocks of 8


def stored(keys, tokens, parent=None, **kw) -> BlocksStored:
    return BlocksStored(tuple(keys), parent, tuple(tokens), SIZE, **kw)


def keys(prefix: str, n: int) -> list[str]:
    return [f"{prefix}{i}" for i in range(n)]


def apply(cache: PrefixCache, seq: int, ts: float, *events, origin: str = "a:1"):
    return cache.apply(EventBatch(seq, ts, tuple(events)), origin)


def codes(cache: PrefixCache) -> list[str]:
    return [n.code for n in cache.notes]


def test_a_prompt_never_seen_raises_nothing():
    cache = PrefixCache(TokenTexts())
    apply(cache, 0, 0.0, stored(keys("a", 8), PROMPT))
    apply(cache, 1, 1.0, stored(keys("b", 8), range(500, 564)))  # other tokens from the first on
    apply(cache, 2, 2.0, stored(keys("c", 4), range(900, 932)), origin="b:2")  # another server, its own prompt
    apply(cache, 3, 3.0, stored(["a2x"], range(700, 708), parent="a1"))  # another question after a shared start
    assert cache.notes == []


def test_an_evicted_prefix_names_when_its_age_and_hits():
    cache = PrefixCache(TokenTexts())
    apply(cache, 0, 10.0, stored(keys("a", 8), PROMPT))
    apply(cache, 1, 12.0, stored(["q1"], range(700, 708), parent="a7"))  # the request decoding on (or a later one)
    apply(cache, 2, 13.0, stored(["q2"], range(800, 808), parent="a7"))  # another went on from a7 too: a hit
    apply(cache, 3, 14.0, stored(["q3"], range(900, 908), parent="a7"))
    apply(cache, 4, 20.0, BlocksRemoved(("q1", "q2", "q3", *keys("a", 8))))  # evicted, leaves first
    apply(cache, 5, 94.5, stored(keys("a", 8), PROMPT))  # the same prompt again (the same hashes), after churn's window
    (note,) = cache.notes
    assert note.code == "evicted-prefix" and note.severity == "info" and note.where.position == 0
    assert "64 tokens from token 0 were prefilled again" in note.message
    assert "evicted 74.5 s before, 10.0 s after being stored, continued by 2 later prefill(s)" in note.message


def test_a_cleared_cache_is_named_as_cleared_not_as_churn():
    cache = PrefixCache(TokenTexts())
    apply(cache, 0, 1.0, stored(keys("a", 8), PROMPT))
    apply(cache, 1, 2.0, AllCleared())
    apply(cache, 2, 3.0, stored(keys("a", 8), PROMPT))
    (note,) = cache.notes
    assert note.code == "evicted-prefix" and "removed when the cache was cleared 1.0 s before" in note.message
    assert cache.stats("a:1").restored == 0  # an operator's clear is not the cache being too small


def test_the_same_tokens_under_another_hash_say_which_key_differs():
    cache = PrefixCache(TokenTexts())
    apply(cache, 0, 0.0, stored(keys("a", 8), PROMPT))
    apply(cache, 1, 1.0, stored(keys("l", 8), PROMPT, lora="sql-adapter"))
    apply(cache, 2, 2.0, stored(keys("s", 8), PROMPT, extra=("('salt-1',)",) * 8))
    assert codes(cache) == ["hash-mismatch", "hash-mismatch"]
    assert "the LoRA differs (none held, sql-adapter now)" in cache.notes[0].message
    assert "the extra keys differ (none held, ('salt-1',) now)" in cache.notes[1].message
    assert "64 tokens were prefilled again" in cache.notes[0].message


def test_held_on_another_replica_names_it_and_counts_the_waste():
    cache = PrefixCache(TokenTexts())
    apply(cache, 0, 5.0, stored(keys("a", 8), PROMPT), origin="10.0.0.1:8000")
    # the second server hashes with its own seed: other hashes, the same tokens; its last 2 blocks go on elsewhere
    tail = (*PROMPT[:48], *range(900, 916))
    apply(cache, 1, 7.0, stored(keys("b", 8), tail), origin="10.0.0.2:8000")
    (note,) = cache.notes
    assert note.code == "held-elsewhere" and note.where.origin == "10.0.0.2:8000"
    assert "48 tokens from token 0 were prefilled on 10.0.0.2:8000 while 10.0.0.1:8000 held them" in note.message
    assert "stored 2.0 s before" in note.message
    assert cache.stats("10.0.0.2:8000").routed_tokens == 48 and cache.stats("10.0.0.1:8000").routed_tokens == 0
    assert cache.duplicated() == {"10.0.0.1:8000": 48, "10.0.0.2:8000": 48}  # memory spent twice, per replica
    apply(cache, 2, 8.0, BlocksRemoved(tuple(keys("a", 8))), origin="10.0.0.1:8000")
    assert cache.duplicated() == {}


def test_a_data_parallel_rank_is_a_replica_too():
    cache = PrefixCache(TokenTexts())
    apply(cache, 0, 0.0, stored(keys("a", 8), PROMPT), origin="h:8000")
    apply(cache, 1, 0.0, stored(keys("b", 8), PROMPT), origin="h:8000/dp1")
    assert codes(cache) == ["held-elsewhere"] and "while h:8000 held them" in cache.notes[0].message


def reworded(cached: list[int], at: int, left: int, put: list[int]) -> list[int]:
    return cached[:at] + put + cached[at + left :]


def test_a_reworded_sentence_of_another_length_is_a_miss():
    """The issue's case: a sentence rewritten in other words of another length before 300 identical tokens."""
    cached = list(range(1000, 1320))  # 40 blocks
    cache = PrefixCache(TokenTexts())
    apply(cache, 0, 0.0, stored(keys("a", 40), cached))
    for seq, (left, put) in enumerate([(4, list(range(5000, 5007))), (0, [5100, 5101]), (5, [])], start=1):
        new = reworded(cached, 11, left, put)  # from token 11, in block 1
        blocks = len(new) // SIZE
        apply(cache, seq, 0.0, stored(keys(f"n{seq}-", blocks - 1), new[SIZE : blocks * SIZE], parent="a0"))
    misses = [n.message for n in cache.notes if n.code == "recomputed-prefix"]
    assert len(misses) == 3 and set(codes(cache)) == {"recomputed-prefix", "varying-start"}
    replaced, inserted, left_out = misses
    assert "at token 11" in replaced and "4 tokens, became" in replaced and "7 tokens" in replaced
    assert "was put before the cached text, which follows 2 tokens later" in inserted
    assert "5 tokens, " not in left_out and "was left out; the cached text follows right after" in left_out


def test_a_difference_at_a_block_boundary_is_found_among_the_parents_chains():
    cached = list(range(1000, 1320))
    cache = PrefixCache(TokenTexts())
    apply(cache, 0, 0.0, stored(keys("a", 40), cached))
    new = reworded(cached, 16, 3, [7000, 7001, 7002, 7003, 7004])  # from block 2's first token
    blocks = len(new) // SIZE
    apply(cache, 1, 0.0, stored(keys("n", blocks - 2), new[16 : blocks * SIZE], parent="a1"))
    (note,) = cache.notes
    assert note.code == "recomputed-prefix" and note.where.position == 16


def test_an_edit_beyond_the_search_bound_or_a_short_common_tail_is_no_miss():
    cached = list(range(1000, 1320))
    cache = PrefixCache(TokenTexts())
    apply(cache, 0, 0.0, stored(keys("a", 40), cached))
    far = reworded(cached, 11, 4, list(range(6000, 6000 + REALIGN_SEARCH + 10)))  # longer than the bound
    blocks = len(far) // SIZE
    apply(cache, 1, 0.0, stored(keys("f", blocks - 1), far[SIZE : blocks * SIZE], parent="a0"))
    # another question of another length, then the same turn end (shorter than REALIGN_MIN): another prompt
    end = list(range(1100, 1100 + REALIGN_MIN - 8))
    old = [*cached[:16], *range(2000, 2010), *end, *range(3000, 3040)]
    cache2 = PrefixCache(TokenTexts())
    apply(cache2, 0, 0.0, stored(keys("a", len(old) // SIZE), old[: len(old) // SIZE * SIZE]))
    new = [*cached[:16], *range(4000, 4013), *end, *range(4100, 4120)]
    blocks = len(new) // SIZE
    apply(cache2, 1, 0.0, stored(keys("n", blocks - 2), new[16 : blocks * SIZE], parent="a1"))
    assert cache.notes == [] and cache2.notes == []


def test_two_publishers_followed_by_the_subscriber_name_each_other():
    """Through the wire: two servers' publishers, one subscriber; the second server's prefill names the first."""
    cache, problems = PrefixCache(TokenTexts()), []
    with LocalPublisher() as first, LocalPublisher() as second:
        endpoints = [
            EventEndpoint(first.endpoint, first.replay_endpoint, "kv-events", 0, "127.0.0.1:8001"),
            EventEndpoint(second.endpoint, second.replay_endpoint, "kv-events", 0, "127.0.0.1:8002"),
        ]
        with following(cache, endpoints, (first, second), problems):
            first.publish(encode_batch(EventBatch(0, 1.0, (stored(keys("a", 8), PROMPT),))))
            assert wait_for(lambda: cache.stats("127.0.0.1:8001").stored >= 8, 10)
            second.publish(encode_batch(EventBatch(0, 2.0, (stored(keys("b", 8), PROMPT),))))
            wait_for(lambda: cache.notes, 10)
    assert [n.code for n in cache.notes] == ["held-elsewhere"] and not problems
    assert "prefilled on 127.0.0.1:8002 while 127.0.0.1:8001 held them" in cache.notes[0].message
    assert cache.stats("127.0.0.1:8002").routed_tokens == 64


def test_the_tree_and_the_summary_show_the_replicas_and_the_waste():
    from kvtui.engine.server.report import summary_lines
    from kvtui.engine.server.view import build_view

    cache = PrefixCache(TokenTexts())
    apply(cache, 0, 0.0, stored(keys("a", 8), PROMPT), origin="10.0.0.1:8000")
    apply(cache, 1, 1.0, stored(keys("b", 8), PROMPT), origin="10.0.0.2:8000")
    apply(cache, 2, 2.0, stored(keys("c", 2), range(900, 916)), origin="10.0.0.2:8000")  # held there only
    replicas = {row.chain: (row.top.origin, row.replicas) for row in build_view(cache).chains}
    assert replicas == {
        1: ("10.0.0.1:8000", ("10.0.0.2:8000",)),
        2: ("10.0.0.2:8000", ("10.0.0.1:8000",)),
        3: ("10.0.0.2:8000", ()),
    }
    lines = summary_lines(cache)
    assert "fleet: routing waste 64 tokens; tokens held more than once 128 (memory spent twice)" in lines
    assert any(line.startswith("10.0.0.2:8000: fleet: 64 tokens prefilled here") for line in lines)


def test_notes_on_what_came_before_attaching_are_marked_caught_up():
    """Two prefills before kvtui attached (given by the replay socket), one after: only the last is new."""
    cache, problems = PrefixCache(TokenTexts()), []
    with LocalPublisher() as publisher:
        publisher.publish(encode_batch(EventBatch(0, 1.0, (stored(keys("a", 8), PROMPT),))))
        publisher.publish(encode_batch(EventBatch(1, 2.0, (stored(keys("b", 8), PROMPT, lora="x"),))))
        endpoint = EventEndpoint(publisher.endpoint, publisher.replay_endpoint, "kv-events", 0, "local")
        with following(cache, [endpoint], [publisher], problems):
            publisher.publish(encode_batch(EventBatch(2, 3.0, (stored(keys("c", 8), PROMPT, lora="y"),))))
            wait_for(lambda: len(cache.notes) >= 2, 10)
    assert [n.code for n in cache.notes] == ["hash-mismatch", "hash-mismatch"]
    before, after = (n.message for n in cache.notes)
    assert before.startswith("(caught up: before kvtui attached) ") and not after.startswith("(caught up")
    assert cache.stats("local").caught_up == 2


def test_stream_integrity_is_counted_per_origin():
    from kvtui.engine.server.report import summary_lines

    cache = PrefixCache(TokenTexts())
    apply(cache, 0, 0.0, stored(["a0", "a1"], PROMPT[:16], medium="GPU"))
    apply(cache, 1, 0.0, stored(["a1"], PROMPT[8:16], parent="a0", medium="GPU"))  # stored again without a removal
    # (from the prompt's start, held blocks stored again are vLLM's report of a request's hits: requests.py)
    apply(cache, 3, 0.0, stored(["m0", "m1"], range(300, 316), medium="NVME_TIER"))  # a word kvtui does not know
    apply(cache, 4, 0.0, BlocksRemoved(("zz",)))  # never stored
    stats = cache.stats("a:1")
    assert (stats.stored_again, stats.unknown_medium, stats.unknown_removed, stats.lost) == (1, 2, 1, 1)
    assert any("hashes stored again while held 1; unknown medium 2" in line for line in summary_lines(cache))


def test_the_hit_rate_is_over_the_watched_interval_beside_the_servers_life():
    from kvtui.engine.server.report import summary_lines
    from kvtui.engine.server.server_http import CacheMetrics

    cache = PrefixCache(TokenTexts())
    cache.record_metrics("a:1", 0.0, CacheMetrics(queries=1000.0, hits=900.0, capacity=40, block_size=32))
    cache.record_metrics("a:1", 5.0, CacheMetrics(queries=1200.0, hits=950.0, capacity=40, block_size=32))
    (line,) = [line for line in summary_lines(cache) if "hit rate" in line]
    assert "hit rate while watched 25.0% (50 of 200 tokens); over the server's life 79.2% (950 of 1200" in line


def test_a_request_decoding_on_after_its_noted_prefill_raises_no_second_note():
    """The second replica prefilled the prompt (noted), then generates the same answer the first did: its answer's
    blocks, stored one by one after the prompt's leaf, are not another miss and no routing waste."""
    cache = PrefixCache(TokenTexts())
    answer = tuple(range(2000, 2016))
    apply(cache, 0, 0.0, stored(keys("a", 8), PROMPT), origin="r1")
    apply(cache, 1, 0.0, stored(["a8", "a9"], answer, parent="a7"), origin="r1")
    apply(cache, 2, 0.0, stored(keys("b", 8), PROMPT), origin="r2")
    apply(cache, 3, 0.0, stored(["b8"], answer[:8], parent="b7"), origin="r2")
    apply(cache, 4, 0.0, stored(["b9"], answer[8:], parent="b8"), origin="r2")
    assert codes(cache) == ["held-elsewhere"] and cache.stats("r2").routed_tokens == 64


def test_tokens_held_twice_are_kept_as_an_independent_count_says():
    """Random stores, removals, clears and a restart over three origins: the running count of tokens held on more
    than one origin equals a count made from the blocks held, by their tokens from the prompt's start."""
    import random

    rng = random.Random(7)
    cache = PrefixCache(TokenTexts())
    prompts = [tuple(rng.randrange(50) for _ in range(16)) for _ in range(6)]

    def _prefix_tokens(key: str) -> tuple:  # from the key this test gave the block: its prompt and its index
        _, p, i = key.split("-")
        return prompts[int(p)][: SIZE * (int(i) + 1)]

    for seq in range(400):
        origin = rng.choice(["r1", "r2", "r3"])
        roll = rng.random()
        if roll < 0.6:
            p = rng.randrange(len(prompts))
            keys_ = [f"{origin}-{p}-0", f"{origin}-{p}-1"]
            apply(cache, seq, 0.0, stored(keys_, prompts[p]), origin=origin)
        elif roll < 0.95:
            p = rng.randrange(len(prompts))
            apply(cache, seq, 0.0, BlocksRemoved((f"{origin}-{p}-{rng.randrange(2)}",)), origin=origin)
        elif roll < 0.98:
            apply(cache, seq, 0.0, AllCleared(), origin=origin)
        else:
            cache.restart(origin)
        expected: dict[str, int] = {}
        by_tokens: dict[tuple, set[str]] = {}
        held = [(block.origin, _prefix_tokens(block.key)) for block in cache.blocks.values()]
        for origin_, tokens in held:
            by_tokens.setdefault(tokens, set()).add(origin_)
        for origin_, tokens in held:
            if len(by_tokens[tokens]) > 1:
                expected[origin_] = expected.get(origin_, 0) + SIZE
        assert cache.duplicated() == expected, seq


def test_a_flood_lists_the_same_notes_as_a_gate_that_lists_every_note():
    """The words of a note the flood gate will only count are not built (rules._listed): what is listed must be what
    gating every fully worded note gives, the doubling summaries included."""
    from kvtui.engine.records.diagnostic_groups import FloodGate

    def flood(cache: PrefixCache) -> None:
        edited = []
        for i in range(
            140
        ):  # a prompt, then the same one with another word at another place (swap, insertion, deletion)
            held = [t + 1000 * i for t in PROMPT]
            at = 9 + i % 6  # in the first block stored anew (a later one would be the same tokens, another hash)
            edit = [[900 + i], [900 + i, 950 + i], []][i % 3]
            prompt = [*held[:at], *edit, *held[at + 1 :]][:56]
            apply(cache, i, float(i), stored(keys(f"p{i}-", 8), held))
            edited.append(stored(keys(f"r{i}-", 7)[1:], prompt[SIZE:56], parent=f"p{i}-0"))
        for n, start in enumerate(range(0, 140, 3)):  # three prompts a batch: a batch's notes are gated together
            apply(cache, 140 + n, 200.0, *edited[start : start + 3])

    gated = PrefixCache(TokenTexts())
    flood(gated)
    every = PrefixCache(TokenTexts())
    every.gate = FloodGate(listed=10**9)
    flood(every)
    assert every.note_counts == gated.note_counts and every.note_counts["recomputed-prefix"] > 128
    regate = FloodGate()
    expected = [shown for note in every.notes if (shown := regate.admit(note)) is not None]
    assert gated.notes == expected and len(expected) < len(every.notes)
    assert all(note.message for note in gated.notes)
