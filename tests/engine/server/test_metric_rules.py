"""The rules judged on a server's /metrics beside its events (server/metric_rules.py), on a fake metrics source: the
events cross-checked against the prefix-cache counters (a disagreement is a note with both numbers; a busy or
unsettled interval, late events, preemptions, lost batches are no disagreement), and prompts shorter than one
block counted from the prompt-length histogram (a floor: never a prompt that filled a block)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from kvtui.engine.reading.token_texts import TokenTexts
from kvtui.engine.server.kv_events import BlocksStored, EventBatch
from kvtui.engine.server.metric_rules import CONFIRM_S
from kvtui.engine.server.prefix_cache import PrefixCache
from kvtui.engine.server.server_http import CacheMetrics, parse_metrics
from kvtui.engine.server.server_trace import ServerTraceWriter, load_server_trace

pytestmark = pytest.mark.version_free("a server's events, HTTP and traces, read by kvtui alone: no transformers code")

ORIGIN = "127.0.0.1:8000"
BLOCK = 16
BOUNDS = (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0)  # vLLM's 1-2-5 buckets


@dataclass
class FakeServer:
    """What a vLLM server's /metrics says, moved by requests as vLLM moves it; its events go to the cache."""

    cache: PrefixCache
    queries: float = 0.0
    hits: float = 0.0
    generated: float = 0.0
    prompts: list[int] = field(default_factory=list)
    running: float = 0.0
    preemptions: float = 0.0
    seq: int = 0
    keys: int = 0
    ts: float = 0.0
    writer: ServerTraceWriter | None = None  # where its batches are written too

    def serve(self, prompt: int, hit: int = 0, generated: int = 4, events: bool = True) -> None:
        """A request of `prompt` tokens, `hit` of them found cached: its full blocks are announced (unless not)."""
        self.queries += prompt
        self.hits += hit
        self.generated += generated
        self.prompts.append(prompt)
        blocks = (prompt + generated - 1) // BLOCK - hit // BLOCK  # the full blocks of what it computed
        if events and blocks > 0:
            self.send(blocks)

    def send(self, blocks: int) -> None:
        keys = tuple(f"k{self.keys + i}" for i in range(blocks))
        self.keys += blocks
        tokens = tuple(range(self.keys * BLOCK, (self.keys + blocks) * BLOCK))
        batch = EventBatch(self.seq, self.ts, (BlocksStored(keys, None, tokens, BLOCK),))
        notes = self.cache.apply(batch, ORIGIN)
        if self.writer is not None:
            self.writer.batch(ORIGIN, batch, notes)
        self.seq += 1

    def metrics(self) -> CacheMetrics:
        return CacheMetrics(
            queries=self.queries,
            hits=self.hits,
            block_size=BLOCK,
            requests=float(len(self.prompts)),
            prompt_tokens=float(sum(self.prompts)),
            prompt_buckets=[[b, float(sum(p <= b for p in self.prompts))] for b in BOUNDS],
            generated=self.generated,
            running=self.running,
            waiting=0.0,
            preemptions=self.preemptions,
        )

    def poll(self, metrics: CacheMetrics | None = None) -> list:
        self.ts += 1.0
        notes: list = []
        self.cache.record_metrics(ORIGIN, self.ts, metrics or self.metrics(), notes)
        return notes


def server() -> FakeServer:
    fake = FakeServer(PrefixCache(TokenTexts()))
    fake.send(1)  # its publisher has spoken before kvtui compares anything
    return fake


def settle(fake: FakeServer) -> list:
    """Polls (one a second) until settled (the counters unchanged, nothing running) and a disagreement confirmed."""
    return [note for _ in range(int(CONFIRM_S) + 3) for note in fake.poll()]


def test_events_that_agree_with_the_counters_raise_nothing_and_are_counted_as_compared():
    fake = server()
    settle(fake)
    fake.serve(100)
    fake.serve(100, hit=96)  # the same prompt again: 6 blocks found, the last partial block computed
    fake.serve(40, generated=30)
    assert settle(fake) == [] and fake.cache.notes == []
    checked = fake.cache.metric_rules.servers[ORIGIN]
    assert (checked.compared, checked.disagreed) == (1, 0)


def test_blocks_a_report_re_announces_are_hits_for_the_cross_check_too():
    """Two requests share a three-block system prompt, sent with kv_cache_report_mode full: vLLM re-announces the
    second one's reused blocks (a BlockStored of the held hashes from the prompt's first block). They are its hit,
    as the request rows count them, not tokens stored: the cross-check against /metrics raises nothing."""
    fake = server()
    settle(fake)
    shared = 3 * BLOCK
    system = tuple(range(10_000, 10_000 + shared))
    keys = ("sys0", "sys1", "sys2")
    tail = 10  # each request's own text after the system prompt: less than a block
    for number in range(2):
        fake.queries += shared + tail
        fake.hits += shared if number else 0
        fake.generated += 4
        fake.prompts.append(shared + tail)
        # the first request stores the system prompt's blocks; the second's report re-announces the same ones
        batch = EventBatch(fake.seq, fake.ts, (BlocksStored(keys, None, system, BLOCK),))
        fake.cache.apply(batch, ORIGIN)
        fake.seq += 1
    stats = fake.cache.stats(ORIGIN)
    assert (stats.reports, stats.reported_hits) == (1, shared)  # the request rows' count: a hit of 48 tokens
    assert settle(fake) == [] and fake.cache.notes == []
    checked = fake.cache.metric_rules.servers[ORIGIN]
    assert (checked.compared, checked.disagreed) == (1, 0)


def test_missing_events_are_a_note_with_both_numbers():
    fake = server()
    settle(fake)
    fake.serve(200, events=False)  # the server computed 12 full blocks and announced none
    fake.serve(64)
    notes = settle(fake)
    (note,) = [n for n in notes if n.code == "metrics-disagree"]
    assert note.severity == "warning" and note.where.origin == ORIGIN
    # independently: 264 queried, 0 hit, 2 requests: at least 264 - 2 * 15 = 234 tokens of whole blocks; 64 + 4
    # generated fill 4 blocks of 16, announced: 64 tokens
    assert "announced 64 tokens stored in blocks of 16" in note.message
    assert "counted 2 requests, 264 prompt tokens queried and 0 found in the prefix cache" in note.message
    assert "fewer than the at least 234 tokens of whole blocks its prefills computed: events are missing" in (
        note.message
    )


def test_more_stored_than_computed_is_a_note_too():
    fake = server()
    settle(fake)
    fake.serve(32)
    fake.send(10)  # 160 tokens more than anything computed
    (note,) = settle(fake)
    assert note.code == "metrics-disagree" and "more than the at most 36 tokens it computed" in note.message


def test_late_events_get_one_more_settled_poll_and_a_busy_interval_is_never_judged():
    fake = server()
    settle(fake)
    fake.serve(200, events=False)
    fake.running = 1.0
    assert fake.poll() == [] and fake.poll() == []  # busy: not judged, however far apart the numbers
    fake.running = 0.0
    # settled, disagreeing for most of CONFIRM_S: the events may be on their way (a loaded host delays them seconds)
    assert [note for _ in range(int(CONFIRM_S)) for note in fake.poll()] == []
    fake.send(12)  # ... and here they are (late): they agree now
    assert settle(fake) == [] and fake.cache.notes == []
    assert fake.cache.metric_rules.servers[ORIGIN].compared == 1


def test_a_disagreement_is_noted_once_it_lasted_confirm_s_at_settled_polls():
    fake = server()
    settle(fake)
    fake.serve(200, events=False)
    polls = [fake.poll() for _ in range(int(CONFIRM_S) + 3)]
    noted = [i for i, notes in enumerate(polls) if notes]
    # settled at the second poll after serving (counters unchanged since the first): disagreeing from there, noted at
    # the first settled poll CONFIRM_S after that (the fake's clock: a second a poll), once
    assert noted == [1 + int(CONFIRM_S)] and polls[noted[0]][0].code == "metrics-disagree"


def test_preemptions_lost_batches_or_no_own_publisher_are_not_compared():
    fake = server()
    settle(fake)
    fake.serve(200, events=False)
    fake.preemptions = 1.0  # a preempted request's tokens are computed again outside `queries`
    assert settle(fake) == []
    fake.serve(200, events=False)
    fake.cache.count_lost(ORIGIN, 1)  # kvtui knows it missed a batch: not the server's disagreement
    assert settle(fake) == []
    lone = FakeServer(PrefixCache(TokenTexts()))  # no batch of its own yet (or events given from elsewhere)
    lone.serve(200, events=False)
    assert settle(lone) == [] and lone.cache.notes == []


def test_prompts_shorter_than_a_block_are_counted_from_the_histogram_never_one_that_filled_a_block():
    fake = server()
    fake.serve(8)  # before kvtui attached: not counted
    fake.poll()
    fake.serve(12)  # bucket 10..20 straddles the block of 16: alone in its poll, its exact length (the sum) tells
    notes = fake.poll()
    fake.serve(16)  # fills a block: no note
    fake.serve(17)
    notes += fake.poll()
    for _ in range(4):  # in one poll: four under 10 (counted) and one of 13 in 10..20, which is not: the 25 tokens
        fake.serve(3)  # would leave it room for 21 (the count is a floor)
    fake.serve(13)
    notes += fake.poll()
    short = [n for n in notes if n.code == "short-prompt"]
    assert [n.message.split(" since")[0] for n in short] == [f"1 request on {ORIGIN}", f"5 requests on {ORIGIN}"]
    assert "shorter than one block of 16 tokens" in short[0].message
    assert fake.cache.metric_rules.servers[ORIGIN].short == 5
    fake.serve(12)
    fake.serve(19)  # two in the 10..20 bucket, 31 tokens: one of them may fill a block: neither is counted
    assert fake.poll() == [] and fake.cache.metric_rules.servers[ORIGIN].short == 5


def test_vllm_metrics_text_is_read_and_a_trace_replays_the_notes(tmp_path):
    text = "\n".join(
        [
            'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 300.0',
            'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 96.0',
            'vllm:request_prompt_tokens_bucket{engine="0",le="10.0",model_name="m"} 1.0',
            'vllm:request_prompt_tokens_bucket{engine="0",le="20.0",model_name="m"} 2.0',
            'vllm:request_prompt_tokens_bucket{engine="0",le="+Inf",model_name="m"} 3.0',
            'vllm:request_prompt_tokens_count{engine="0",model_name="m"} 3.0',
            'vllm:request_prompt_tokens_sum{engine="0",model_name="m"} 300.0',
            'vllm:generation_tokens_total{engine="0",model_name="m"} 12.0',
            'vllm:num_requests_running{engine="0",model_name="m"} 0.0',
            'vllm:num_requests_waiting{engine="0",model_name="m"} 0.0',
            'vllm:num_preemptions_total{engine="0",model_name="m"} 0.0',
        ]
    )
    metrics = parse_metrics(text)
    assert (metrics.requests, metrics.prompt_tokens, metrics.generated) == (3.0, 300.0, 12.0)
    assert metrics.prompt_buckets == [[10.0, 1.0], [20.0, 2.0]] and (metrics.running, metrics.waiting) == (0.0, 0.0)
    fake = FakeServer(PrefixCache(TokenTexts()))
    trace = tmp_path / "server.jsonl"
    writer = fake.writer = ServerTraceWriter(trace, [], fake.cache)
    fake.send(1)
    for step in range(5 + int(CONFIRM_S)):  # served at the third poll; noted CONFIRM_S after it first disagreed
        if step == 2:
            fake.serve(200, events=False)
        fake.ts += 1.0
        notes: list = []
        metrics = fake.metrics()
        fake.cache.record_metrics(ORIGIN, fake.ts, metrics, notes)
        writer.metrics(ORIGIN, fake.ts, metrics, notes)
    writer.close()
    assert [n.code for n in fake.cache.notes] == ["metrics-disagree"]
    run = load_server_trace(trace)
    assert [n.message for n in run.cache.notes] == [r["message"] for r in run.recorded_notes]
    assert [n.message for n in run.cache.notes] == [n.message for n in fake.cache.notes]
