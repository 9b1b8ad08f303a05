"""Two miss causes judged on a server's KV events, each in the encoding vLLM 0.32 sends (msgspec tagged structs with
omit_defaults, in a `[ts, [events...]]` array: vllm/distributed/kv_events.py), packed here with msgpack and decoded
as the subscriber decodes them:

- `prefix-under-block`: a prompt shares its start with a chain the server holds or held, fewer tokens than one block
  (a hybrid attention + Mamba model's attention block is hundreds of tokens): no block could match;
- `offloaded-prefix`: a store on the GPU of blocks the server held only on its CPU or disk tier (vLLM's offloading
  connector: kv_transfer/kv_connector/v1/offloading/events.py publishes its tiers' stores and removals in the same
  batches, medium "CPU" / "STORAGE"; without `self_describing_kv_events` a store names the hash only, block_size 0).
Neither fires on a prompt never seen, nor on an eviction within one medium."""

from __future__ import annotations

import msgpack
import pytest

from kvtui.engine.reading.edits import UNDER_BLOCK_MIN
from kvtui.engine.reading.token_texts import TokenTexts
from kvtui.engine.server.kv_events import UndecodablePayload, decode_payload
from kvtui.engine.server.prefix_cache import PrefixCache
from kvtui.engine.server.report import summary_lines
from kvtui.engine.server.server_trace import event_from_record, event_record

pytestmark = pytest.mark.version_free("a server's events, HTTP and traces, read by kvtui alone: no transformers code")

SIZE = 64  # tokens per block (a hybrid model's would be larger still: the rule reads the events' block_size)
SYSTEM = list(range(1000, 1040))  # a 40-token system prompt: under one block
ORIGIN = "127.0.0.1:8000"


def h(name: str, i: int) -> int:
    """A block hash as vLLM sends it by default (an int, uint64)."""
    return (hash(name) & 0xFFFF_FFFF) * 1000 + i


def stored(name, tokens, parent=None, medium="GPU", group=None, kind=None, size=SIZE, n=None) -> dict:
    """vLLM 0.32's BlockStored as msgspec encodes it: required fields always, defaults (None) left out."""
    blocks = n if n is not None else len(tokens) // size
    event = {
        "type": "BlockStored",
        "block_hashes": [h(name, i) for i in range(blocks)],
        "parent_block_hash": parent,
        "token_ids": list(tokens[: blocks * size]),
        "block_size": size,
        "lora_id": None,
        "medium": medium,
        "lora_name": None,
    }
    if group is not None:
        event["group_idx"] = group
    if kind is not None:
        event["kv_cache_spec_kind"] = kind
    return event


def placeholder(hashes, medium="CPU", group=0) -> dict:
    """The offloading connector's store without self-describing metadata (events.py `_placeholder_stored`)."""
    return {
        "type": "BlockStored",
        "block_hashes": list(hashes),
        "parent_block_hash": None,
        "token_ids": [],
        "block_size": 0,
        "lora_id": None,
        "medium": medium,
        "lora_name": None,
        "group_idx": group,
    }


def removed(hashes, medium="GPU", group=None) -> dict:
    event = {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": medium}
    if group is not None:
        event["group_idx"] = group
    return event


class Server:
    """One origin's publisher: each batch packed as vLLM sends it and decoded as the subscriber does."""

    def __init__(self, cache: PrefixCache | None = None, origin: str = ORIGIN):
        self.cache = cache or PrefixCache(TokenTexts())
        self.origin = origin
        self.seq = 0

    def send(self, ts: float, *events: dict):
        batch = decode_payload(msgpack.packb([ts, list(events)]), self.seq)
        self.seq += 1
        return self.cache.apply(batch, self.origin)

    def codes(self) -> list[str]:
        return [n.code for n in self.cache.notes]


def prompt(question: int, system=SYSTEM, length: int = 2 * SIZE) -> list[int]:
    return system + list(range(question, question + length - len(system)))


# ---- prefix-under-block ---------------------------------------------------------------------------------------


def test_a_shared_start_under_one_block_is_named_with_its_tokens_and_the_block_size():
    server = Server()
    server.send(0.0, stored("a", prompt(2000)))
    notes = server.send(1.0, stored("b", prompt(3000)))  # the same system prompt, another question: a new root
    (note,) = notes
    assert note.code == "prefix-under-block" and note.severity == "info"
    assert (note.where.chain, note.where.position) == (1, len(SYSTEM))
    assert "shares its first 40 tokens with it, fewer than one block of 64 tokens" in note.message
    assert "cached chain #1 (held)" in note.message
    assert server.cache.requests.newest(1)[0].cause == "prefix-under-block"


def test_no_note_for_a_prompt_never_seen_a_template_sized_start_a_whole_shared_block_or_small_blocks():
    server = Server()
    server.send(0.0, stored("a", prompt(2000)))
    server.send(1.0, stored("b", list(range(5000, 5128))))  # never seen
    header = SYSTEM[: UNDER_BLOCK_MIN - 1]  # the few tokens every chat template starts with
    server.send(2.0, stored("c", prompt(6000, system=header)))
    long_system = list(range(4000, 4080))  # 80 shared tokens: the first block matches (the chain goes on from a0)
    server.send(3.0, stored("d", prompt(7000, system=long_system)))
    server.send(4.0, stored("e", prompt(8000, system=long_system)[SIZE:], parent=h("d", 0), n=1))
    assert server.codes() == []
    small = Server()  # blocks of 16: a shared start under one block is the template's, never this cause
    small.send(0.0, stored("a", prompt(2000, system=SYSTEM[:12]), size=16))
    small.send(1.0, stored("b", prompt(3000, system=SYSTEM[:12]), size=16))
    assert small.codes() == []


def test_an_edit_after_a_short_shared_start_is_the_edit_not_the_block_size():
    """The cached text goes on after the difference: recomputed-prefix names it (one cause per prefill)."""
    server = Server()
    held = prompt(2000)
    server.send(0.0, stored("a", held))
    server.send(1.0, stored("b", held[:30] + [9999] + held[31:]))  # one token swapped at token 30
    assert server.codes() == ["recomputed-prefix"]


def test_a_chain_removed_lately_or_held_on_another_replica_is_named():
    server = Server()
    server.send(0.0, stored("a", prompt(2000)))
    server.send(5.0, removed([h("a", 0), h("a", 1)]))  # evicted within one medium
    (note,) = server.send(7.5, stored("b", prompt(3000)))
    assert note.code == "prefix-under-block" and "cached chain #1 (removed 2.5 s before)" in note.message

    fleet = PrefixCache(TokenTexts())
    first, second = Server(fleet, "10.0.0.1:8000"), Server(fleet, "10.0.0.2:8000")
    first.send(0.0, stored("a", prompt(2000)))
    (note,) = second.send(1.0, stored("b", prompt(3000)))
    assert note.code == "prefix-under-block" and note.where.origin == "10.0.0.2:8000"
    assert "cached chain #1 on 10.0.0.1:8000 (held)" in note.message


def test_a_hybrid_models_two_groups_give_one_note_that_says_why_its_blocks_are_large():
    """vLLM stores a hybrid prefill once per KV cache group (attention, Mamba), same block size, one batch."""
    server = Server()
    big = 528  # the attention block vLLM sizes to a Mamba state's page
    first = prompt(2000, length=big)
    server.send(
        0.0,
        stored("a", first, group=0, kind="full_attention", size=big),
        stored("am", first, group=1, kind="mamba", size=big),
    )
    again = prompt(3000, length=big)
    notes = server.send(
        1.0,
        stored("b", again, group=0, kind="full_attention", size=big),
        stored("bm", again, group=1, kind="mamba", size=big),
    )
    (note,) = notes
    assert "fewer than one block of 528 tokens" in note.message and "hybrid model" in note.message


def test_a_server_that_stores_partial_blocks_matches_them_and_the_rule_reads_its_smaller_unit():
    """vLLM 0.32 with a `prefix_match_unit` finer than a Mamba group's block stores partial blocks too (block_pool.py
    cache_partial_block: block_size = the partial entry's tokens): a 40-token shared start fills one of 32."""
    server = Server()
    big = 128
    server.send(0.0, stored("p", list(range(9000, 9032)), size=32))  # a partial entry of 32 tokens
    server.send(1.0, stored("a", prompt(2000, length=big), size=big))
    server.send(2.0, stored("b", prompt(3000, length=big), size=big))
    assert server.codes() == []


def test_a_flood_is_counted_one_note_then_one_per_doubling():
    server = Server()
    server.send(0.0, stored("a", prompt(2000)))
    for i in range(9):
        server.send(1.0 + i, stored(f"q{i}", prompt(3000 + 200 * i)))
    notes = [n for n in server.cache.notes if n.code == "prefix-under-block"]
    assert [n.message.split("(")[2].split(" such")[0] for n in notes] == ["1", "2", "4", "8"]


# ---- offloaded-prefix ------------------------------------------------------------------------------------------


CHAIN = prompt(2000, length=4 * SIZE)  # 4 blocks


@pytest.mark.parametrize("describing", [True, False], ids=["self-describing", "hashes-only"])
def test_blocks_loaded_back_from_the_cpu_tier_are_named_not_evicted(describing):
    server = Server()
    server.send(0.0, stored("a", CHAIN))
    cpu = stored("a", CHAIN, medium="CPU", group=0) if describing else placeholder([h("a", i) for i in range(4)])
    server.send(1.0, cpu)  # the offloading connector copied them to its CPU tier
    server.send(2.0, removed([h("a", i) for i in range(4)], group=0))  # the GPU let them go; the CPU holds them
    stats = server.cache.stats(ORIGIN)
    assert (stats.held, stats.removed, stats.kept_elsewhere, stats.stored_again, stats.unknown_removed) == (
        4,
        0,
        4,
        0,
        0,
    )
    (note,) = server.send(3.0, stored("a", CHAIN, group=0))  # a prompt with that prefix: back on the GPU
    assert note.code == "offloaded-prefix" and note.where.position == 0
    assert "256 tokens from token 0 were stored on GPU while the server held them on CPU only" in note.message
    assert (stats.stored_again, stats.reports, stats.offloaded_back) == (0, 0, 4)
    assert stats.live_tokens == 2 * 4 * SIZE  # the GPU's stores only: what /metrics counts (the CPU copy is none)
    # the request whose whole prompt came back is a row too: its prompt found held (on the CPU), none computed new
    newest = server.cache.requests.newest(2)
    assert stats.requests == 2 and [(r.hit, r.new, r.cause) for r in newest] == [
        (4 * SIZE, 0, "offloaded-prefix"),
        (0, 4 * SIZE, None),
    ]
    (line,) = [line for line in summary_lines(server.cache) if "another held them" in line]
    assert "removed from one medium while another held them 4, stored back on a faster medium 4" in line
    server.send(4.0, removed([h("a", i) for i in range(4)], medium="CPU", group=0))
    assert stats.held == 4  # held on the GPU still


def test_a_hash_only_store_after_the_gpu_evicted_it_keeps_it_from_evicted_prefix():
    server = Server()
    server.send(0.0, stored("a", CHAIN))
    server.send(1.0, removed([h("a", i) for i in range(4)]))  # GPU first: kvtui drops the blocks
    server.send(1.5, placeholder([h("a", i) for i in range(4)]))  # then the CPU tier's store completes
    notes = server.send(3.0, stored("a", CHAIN))
    assert [n.code for n in notes] == ["offloaded-prefix"] and "on CPU only" in notes[0].message
    server.send(4.0, removed([h("a", i) for i in range(4)], medium="CPU", group=0))  # the tier's own removal
    assert server.cache.stats(ORIGIN).unknown_removed == 0


def test_an_eviction_within_one_medium_is_still_evicted_prefix_and_a_prompt_never_seen_raises_nothing():
    server = Server()
    server.send(0.0, stored("a", CHAIN))
    server.send(1.0, stored("x", list(range(7000, 7256))))  # never seen: nothing
    server.send(2.0, removed([h("a", i) for i in range(4)]))
    server.send(3.0, stored("a", CHAIN))
    assert server.codes() == ["evicted-prefix"]

    both = Server()  # offloaded, then removed from the CPU tier too: gone from every medium, so evicted
    both.send(0.0, stored("a", CHAIN))
    both.send(1.0, stored("a", CHAIN, medium="CPU"))
    both.send(2.0, removed([h("a", i) for i in range(4)]))
    both.send(2.5, removed([h("a", i) for i in range(4)], medium="CPU"))
    both.send(3.0, stored("a", CHAIN))
    assert both.codes() == ["evicted-prefix"] and both.cache.stats(ORIGIN).held == 4


def test_an_offload_tier_counts_its_repeated_announcements_and_unknown_media_are_counted():
    """events.py: chunks overlapping a shared prefix re-announce its hashes once per chunk; consumers count them."""
    server = Server()
    server.send(0.0, stored("a", CHAIN))
    server.send(1.0, placeholder([h("a", 0)]), placeholder([h("a", 0)]))  # two chunks hold block 0
    server.send(2.0, removed([h("a", 0)]))  # the GPU let it go
    server.send(3.0, removed([h("a", 0)], medium="CPU", group=0))  # one chunk of two
    stats = server.cache.stats(ORIGIN)
    assert (stats.held, stats.stored_again) == (4, 0)
    server.send(4.0, removed([h("a", 0)], medium="CPU", group=0))  # the other: gone from every medium
    assert stats.held == 3 and stats.removed == 1
    server.send(5.0, stored("n", list(range(9000, 9128)), medium="NVME_TIER"))
    assert stats.unknown_medium == 2


def test_a_store_naming_hashes_only_decodes_and_a_zero_block_size_with_tokens_does_not():
    (event,) = decode_payload(msgpack.packb([1.0, [placeholder([7, 8])]])).events
    assert (event.block_size, event.token_ids, event.medium, len(event.hashes)) == (0, (), "CPU", 2)
    assert event_from_record(event_record(event)) == event  # a trace replays it as it came
    bad = dict(placeholder([7]), token_ids=[1, 2])
    with pytest.raises(UndecodablePayload, match="block_size is 0"):
        decode_payload(msgpack.packb([1.0, [bad]]))


def test_a_removal_from_a_medium_that_never_held_the_block_is_counted_and_a_server_naming_none_is_as_before():
    server = Server()
    server.send(0.0, stored("a", CHAIN))
    server.send(1.0, removed([h("a", 0)], medium="CPU"))  # the CPU tier never announced it
    stats = server.cache.stats(ORIGIN)
    assert (stats.held, stats.unknown_removed, stats.removed) == (4, 1, 0)
    plain = Server()  # stores naming no medium (SGLang's arrays may not): any removal removes
    plain.send(0.0, stored("a", CHAIN, medium=None))
    plain.send(1.0, removed([h("a", 0)], medium="GPU"))
    assert (plain.cache.stats(ORIGIN).held, plain.cache.stats(ORIGIN).removed) == (3, 1)


def test_a_self_describing_copy_after_the_gpu_let_go_is_no_prefill_and_a_server_on_one_unknown_medium_is_followed():
    server = Server()
    server.send(0.0, stored("a", CHAIN))
    server.send(1.0, removed([h("a", i) for i in range(4)]))  # the GPU let them go first
    assert server.send(1.5, stored("a", CHAIN, medium="CPU", group=0)) == []  # the tier's copy: no prefill, no note
    stats = server.cache.stats(ORIGIN)
    assert (stats.held, stats.requests, stats.live_tokens) == (0, 1, 4 * SIZE)
    notes = server.send(3.0, stored("a", CHAIN))
    assert [n.code for n in notes] == ["offloaded-prefix"]
    other = Server()  # a server whose one medium kvtui does not know: its stores are its prefills
    other.send(0.0, stored("a", CHAIN, medium="HBM"))
    other.send(1.0, stored("b", CHAIN, medium="HBM"))  # the same tokens under another hash
    assert other.cache.stats(ORIGIN).held == 8 and other.codes() == ["hash-mismatch"]


@pytest.mark.parametrize("cause", ["recomputed-prefix", "evicted-prefix"])
def test_a_hybrid_prefill_stored_once_per_group_is_one_miss_not_one_per_group(cause):
    """Every cause, not only the block size: a hybrid model's one prefill (a chain per KV cache group, one batch, the
    same tokens) is one note; each group alone would raise it (checked on a one-group server first)."""
    big = 128
    held = list(range(5000, 5000 + 3 * big))
    edited = held[:3] + [9] + held[4:]  # one token in place of another: the cached text goes on after it

    def run(groups: int) -> list[str]:
        server = Server()
        server.send(0.0, *(stored(f"a{g}", held, group=g, size=big) for g in range(groups)))
        if cause == "recomputed-prefix":
            notes = server.send(1.0, *(stored(f"b{g}", edited, group=g, size=big) for g in range(groups)))
        else:
            server.send(2.0, *(removed([h(f"a{g}", i) for i in range(3)], group=g) for g in range(groups)))
            notes = server.send(3.0, *(stored(f"a{g}", held, group=g, size=big) for g in range(groups)))
        return [note.code for note in notes]

    assert run(1) == [cause]
    assert run(2) == [cause]
    two = Server()  # two prefills in one batch (two requests), one group: two notes, each its own
    other = [t + 1000 for t in held]
    two.send(0.0, stored("a", held, size=big), stored("c", other, size=big))
    notes = two.send(1.0, stored("b", edited, size=big), stored("d", other[:5] + [9] + other[6:], size=big))
    assert [n.code for n in notes] == ["recomputed-prefix", "recomputed-prefix"]
