"""generate_batch watched in-process: every forward shown per request, no false alarm, recorded and replayed."""

from __future__ import annotations

import pytest
from serving_runs import run_watched_manager

from kvtui.engine.records.codec import from_record, step_record
from kvtui.engine.records.snapshot import StepSnapshot
from kvtui.engine.watch.probe import Watcher

try:
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
except ImportError:  # 4.57: continuous batching sizes its cache from accelerator memory, it does not run on CPU
    ContinuousBatchingConfig = None

SYSTEM = {"role": "system", "content": "You are a helpful assistant who answers briefly and politely."}
QUESTIONS = ["What is a cache?", "Why do positions matter?", "Name a color."]


@pytest.fixture(scope="module")
def watched(tiny_dir):
    if ContinuousBatchingConfig is None:
        pytest.skip("continuous batching runs on CPU from transformers 5.x (4.57 sizes its cache from GPU memory)")
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    path = tiny_dir("llama")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa")
    prompts = [
        list(
            tokenizer.apply_chat_template([SYSTEM, {"role": "user", "content": q}], add_generation_prompt=True)[
                "input_ids"
            ]
        )
        for q in QUESTIONS
    ]
    config = ContinuousBatchingConfig(page_size=16, max_batch_tokens=64, num_blocks=64)
    generation = GenerationConfig(max_new_tokens=3, do_sample=False)
    plain = model.generate_batch(inputs=prompts, generation_config=generation, continuous_batching_config=config)
    snapshots: list[StepSnapshot] = []
    watcher = Watcher(tokenizer=tokenizer, on_snapshot=snapshots.append)
    watcher.attach(model)
    try:
        outputs = model.generate_batch(inputs=prompts, generation_config=generation, continuous_batching_config=config)
    finally:
        watcher.detach()
    return plain, outputs, snapshots, watcher, prompts


def test_results_are_those_of_the_plain_run(watched):
    plain, outputs, *_ = watched
    assert {k: list(v.generated_tokens) for k, v in outputs.items()} == {
        k: list(v.generated_tokens) for k, v in plain.items()
    }


def test_every_forward_is_shown_per_request_without_false_alarm(watched):
    _, outputs, snapshots, watcher, prompts = watched
    assert snapshots and not [d for d in watcher.diagnostics if d.code == "position-gap"]
    assert not [d for d in watcher.diagnostics if d.severity == "error"]
    for snapshot in snapshots:
        assert snapshot.requests is not None and snapshot.paged and snapshot.rows
        fed = [r.request_id for r in snapshot.rows]
        assert [v.request_id for v in snapshot.requests[: len(fed)]] == fed  # the fed ones first, in packing order
        for row, view in zip(snapshot.rows, snapshot.requests):
            assert row.buffer[-1].position == view.held - 1 and len(row.buffer) == view.held
            assert [t.position for t in row.buffer][-len(row.input_ids) :] == list(row.positions)
        assert snapshot.for_row(len(fed) - 1).buffer is snapshot.rows[-1].buffer
    seen = {v.request_id for s in snapshots for v in s.requests}
    assert seen == set(outputs)
    last = {rid: view for (_, rid), view in watcher.requests.items()}
    for rid, out in outputs.items():
        assert last[rid].prompt_length == len(out.prompt_ids) and last[rid].blocks
    # the request sampled by a forward has its top-k; its first is the token transformers chose (greedy)
    sampled = [(s, row) for s in snapshots for row in s.rows if row.topk]
    assert sampled


def test_the_trace_carries_requests_and_replays_them(watched):
    from kvtui.engine.records.replay import SnapshotBuilder

    _, _, snapshots, _, _ = watched
    builder = SnapshotBuilder()
    for snapshot in snapshots:
        record = step_record(snapshot)
        assert "requests" in record and all("request_id" in row for row in record["rows"])
        again = builder.add(record)
        assert again.requests == snapshot.requests and again.paged == snapshot.paged
        assert [r.request_id for r in again.rows] == [r.request_id for r in snapshot.rows]
        assert [_tokens(r.buffer) for r in again.rows] == [_tokens(r.buffer) for r in snapshot.rows]
        assert (
            from_record(StepSnapshot, record, buffer=snapshot.buffer, rows=snapshot.rows).requests == snapshot.requests
        )


def _tokens(buffer) -> list[tuple[int, int, str]]:
    return [(t.position, t.id, t.piece) for t in buffer]


def test_a_prefix_shared_at_first_sight_is_in_the_trace_once(tiny_dir):
    """A request whose first forward starts past blocks another request fed (a prefix hit on a serving manager):
    its buffer holds the shared tokens live, and the trace carries them once, so a replay (or a viewer fed the
    records) shows the same buffer; a trace written without them shows unknown tokens at those positions."""
    if ContinuousBatchingConfig is None:
        pytest.skip("continuous batching runs on CPU from transformers 5.x (4.57 sizes its cache from GPU memory)")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvtui.engine.records.replay import SnapshotBuilder

    path = tiny_dir("llama")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa")
    system = " ".join(f"Rule {n}: answer in plain words." for n in range(6))
    prompts = {rid: list(tokenizer(f"{system} {q}")["input_ids"]) for rid, q in (("a", "What?"), ("b", "Why not?"))}
    snapshots: list[StepSnapshot] = []
    run_watched_manager(model, tokenizer, prompts, page_size=16, num_blocks=64, on_snapshot=snapshots.append)
    first_b = next(s for s in snapshots if s.rows[0].request_id == "b")
    row = first_b.rows[0]
    shared = row.positions[0]  # its first forward starts past the blocks request a fed
    assert shared >= 16 and row.shared_prefix == shared
    assert [t.id for t in row.buffer] == prompts["b"][: len(row.buffer)]  # live: the whole prompt, in order

    replayed, older = SnapshotBuilder(), SnapshotBuilder()
    for snapshot in snapshots:
        record = step_record(snapshot)
        again = replayed.add(record)
        assert [_tokens(r.buffer) for r in again.rows] == [_tokens(r.buffer) for r in snapshot.rows]
        for view in record["rows"]:
            view.pop("shared_prefix", None)
        before = older.add(record)  # a trace written before the shared prefix was recorded
        for live, old in zip(snapshot.rows, before.rows):
            assert [t.position for t in old.buffer] == [t.position for t in live.buffer]
            assert all(t.origin == "unknown" for t in old.buffer[: live.shared_prefix])
    records = [step_record(s) for s in snapshots]
    assert sum(len(v.get("shared_prefix", ())) for r in records for v in r["rows"]) == shared  # once


def test_a_real_per_request_position_error_still_fires(tiny_dir, monkeypatch):
    """A forward whose second request's positions are moved by 5 (edited on its way into the watched model)."""
    if ContinuousBatchingConfig is None:
        pytest.skip("continuous batching runs on CPU from transformers 5.x (4.57 sizes its cache from GPU memory)")
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    path = tiny_dir("llama")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa")
    prompts = [list(range(5, 40)), list(range(50, 70))]
    watcher = Watcher(tokenizer=tokenizer)
    watcher.attach(model)
    watched_call = type(model).__call__
    planted: list[str] = []

    def edited(self, *args, **kwargs):
        bounds = kwargs["cu_seq_lens_q"].tolist()
        if not planted and len(bounds) > 2 and bounds[2] > bounds[1]:
            kwargs = dict(kwargs, position_ids=kwargs["position_ids"].clone())
            kwargs["position_ids"][0, bounds[1]] += 5
            planted.append("second")
        return watched_call(self, *args, **kwargs)

    monkeypatch.setattr(type(model), "__call__", edited)
    try:
        model.generate_batch(
            inputs=prompts,
            generation_config=GenerationConfig(max_new_tokens=2, do_sample=False),
            continuous_batching_config=ContinuousBatchingConfig(page_size=16, max_batch_tokens=64, num_blocks=32),
        )
    finally:
        monkeypatch.undo()
        watcher.detach()
    gaps = [d for d in watcher.diagnostics if d.code == "position-gap"]
    assert planted and len(gaps) == 1
    assert "token 0 was applied at position 5 but 0 tokens of that request precede it (offset +5)" in gaps[0].message


def test_the_feed_rules_run_per_request(tiny_dir):
    """A prompt ending in its end token: eos-in-context names that request (the other one is clean)."""
    if ContinuousBatchingConfig is None:
        pytest.skip("continuous batching runs on CPU from transformers 5.x (4.57 sizes its cache from GPU memory)")
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    path = tiny_dir("llama")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa")
    watcher = Watcher(tokenizer=tokenizer)
    watcher.attach(model)
    try:
        model.generate_batch(
            inputs=[list(range(10, 30)), list(range(40, 60)) + [tokenizer.eos_token_id]],
            generation_config=GenerationConfig(max_new_tokens=2, do_sample=False, eos_token_id=-1),
            continuous_batching_config=ContinuousBatchingConfig(page_size=16, max_batch_tokens=64, num_blocks=32),
        )
    finally:
        watcher.detach()
    ends = [d for d in watcher.diagnostics if d.code == "eos-in-context"]
    assert len(ends) == 1 and "(request req_1)" in ends[0].message
    assert not [d for d in watcher.diagnostics if d.code != "eos-in-context"]


def test_requests_sent_back_to_waiting_are_lane_events(tiny_dir, tmp_path):
    """A paged cache too small for six requests at once: the scheduler sends some back to waiting and they resume
    later, computed again from nothing (soft reset). Each is one `request-requeued` note saying when and how much,
    checked against the per-request states the trace holds; the tokens are those of an unwatched run."""
    if ContinuousBatchingConfig is None:
        pytest.skip("continuous batching runs on CPU from transformers 5.x (4.57 sizes its cache from GPU memory)")
    import json

    from transformers import AutoModelForCausalLM, GenerationConfig

    from kvtui.engine.watch.probe import watch
    from kvtui.headless import request_summary, requests_of

    model = AutoModelForCausalLM.from_pretrained(tiny_dir("llama"), attn_implementation="sdpa")
    # texts apart (a run shifted by one token is another's text with one token left out: recomputed-prefix)
    prompts = [[1] + [10 + 40 * i + j for j in range(30)] for i in range(6)]
    config = ContinuousBatchingConfig(page_size=16, num_blocks=12, max_batch_tokens=64)
    generation = GenerationConfig(max_new_tokens=40, do_sample=False, eos_token_id=None)
    plain = model.generate_batch(inputs=prompts, generation_config=generation, continuous_batching_config=config)
    trace = tmp_path / "requeued.jsonl"
    with watch(model, None, trace=trace) as watcher:
        outputs = model.generate_batch(inputs=prompts, generation_config=generation, continuous_batching_config=config)
    assert {k: list(v.generated_tokens) for k, v in outputs.items()} == {
        k: list(v.generated_tokens) for k, v in plain.items()
    }
    notes = [d for d in watcher.diagnostics if d.code == "request-requeued"]
    assert notes and {d.code for d in watcher.diagnostics} == {"request-requeued"}
    # independently, from the trace's per-request states: fed, then waiting, then fed again from nothing
    steps = [r for r in map(json.loads, trace.read_text().splitlines()) if r.get("type") == "step"]
    expected = []
    last: dict[str, tuple[str, int, int]] = {}  # request -> (status, held, step it was first seen so)
    for record in steps:
        for view in record["requests"]:
            rid, status, held = view["request_id"], view["status"], view["held"]
            before = last.get(rid)
            if before and before[0] == "waiting" and status == "prefilling" and before[1] > 0:
                assert view["held"] == view["fed"]  # a soft reset: everything it holds was fed by this forward
                expected.append(
                    f"request {rid} went back to waiting at step {before[2]} (the paged cache had no "
                    f"free block for it) and resumed at step {record['step']}, computed again the "
                    f"{before[1]} tokens its cache had held (soft reset)"
                )
            if before is None or before[0] != status:
                last[rid] = (status, held, record["step"])
    assert [d.message.split(":")[0] for d in notes] == expected
    lines = request_summary(requests_of(steps))
    assert any("requeued 1 (computed again" in line for line in lines), lines
    # a soft reset moves a request's generated tokens into transformers' prompt: the lane still counts them
    assert all(" · generated 39 · " in line for line in lines), lines  # 40 sampled, the last never fed
    again = sum(int(message.split("computed again the ")[1].split(" ")[0]) for message in expected)
    assert f"; {again} tokens computed again by requests sent back to waiting" in watcher.summary()


def test_blocks_used_are_the_live_requests_tables(watched):
    """The paged groups' `used` (read in O(1): total - free - cached) equals the union of the block tables of the
    requests each forward fed, counted here from the request views."""
    _, _, snapshots, *_ = watched
    checked = 0
    for snapshot in snapshots:
        fed = [view for view in snapshot.requests if view.fed]
        if len(fed) != len([view for view in snapshot.requests if view.status in ("prefilling", "decoding")]):
            continue  # a live request this forward did not feed: its table may have moved since
        for group in snapshot.paged:
            tables = {b for view in fed for name, table in view.blocks if name == group.name for b in table}
            assert group.used == len(tables), (snapshot.step, group)
            checked += 1
    assert checked >= 3


def test_a_conversation_rendered_differently_is_template_drift(tiny_dir):
    """One manager, requests one after another (a program that continues its conversations): a request that holds
    an earlier one's prompt and answer but puts a special token inside that answer re-rendered the conversation
    (template-drift, at that token); one that continues it faithfully, or says other words, raises nothing."""
    if ContinuousBatchingConfig is None:
        pytest.skip("continuous batching runs on CPU from transformers 5.x (4.57 sizes its cache from GPU memory)")
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    path = tiny_dir("llama")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa")
    prompt = list(
        tokenizer.apply_chat_template(
            [SYSTEM, {"role": "user", "content": "Name a color."}], add_generation_prompt=True
        )["input_ids"]
    )
    generation = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=-1)
    config = ContinuousBatchingConfig(page_size=16, max_batch_tokens=64, num_blocks=64)
    watcher = Watcher(tokenizer=tokenizer)
    watcher.attach(model)
    manager = model.init_continuous_batching(generation_config=generation, continuous_batching_config=config)
    manager.start()
    try:

        def ask(ids: list[int], rid: str) -> list[int]:
            manager.add_request(ids, request_id=rid, max_new_tokens=6)
            return list(manager.get_result(request_id=rid, timeout=120).generated_tokens)

        answer = ask(prompt, "first")
        special = tokenizer.eos_token_id
        text = next(t for t in range(40, 400) if t != answer[1] and tokenizer.decode([t]).strip())
        more = list(tokenizer("And another?", add_special_tokens=False)["input_ids"])
        ask([*prompt, *answer, *more], "faithful")
        ask([*prompt, answer[0], text, *answer[2:], *more], "reworded")
        ask([*prompt, answer[0], special, *answer[1:], *more], "drifted")
    finally:
        manager.stop(block=True, timeout=60)
        watcher.detach()
    drifts = [d for d in watcher.diagnostics if d.code == "template-drift"]
    assert len(drifts) == 1, [d.message for d in watcher.diagnostics]
    position = len(prompt) + 1
    assert drifts[0].message.startswith(
        f"request drifted continues request first's conversation but renders it differently at token {position}"
    )
    assert f"this prompt has {tokenizer.decode([special])!r} (id {special})" in drifts[0].message
