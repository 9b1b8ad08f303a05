"""`kvtui attach URL` while the server's HTTP side fails and its events flow (a fake server's HTTP beside kvtui's
LocalPublisher): /metrics answering 500, /detokenize failing, the HTTP side unreachable and back. Each is said in
one line when it starts and one when it ends, never per poll or per token, and no batch is lost meanwhile."""

from __future__ import annotations

import http.server
import json
import threading
import time

import pytest

from kvtui.engine.server import attach as attach_module
from kvtui.engine.server import server_http
from kvtui.engine.server.attach import AttachOptions, AttachSession, connect
from kvtui.engine.server.kv_events import BlocksStored, EventBatch, encode_batch
from local_publisher import LocalPublisher
from waiting import wait_for

pytestmark = pytest.mark.version_free("a server's events, HTTP and traces, read by kvtui alone: no transformers code")


class FakeServer:
    """A vLLM-like HTTP side: /v1/models, /kv_event_sources (the local publisher), /metrics, /detokenize; each can
    be made to fail (`failing`)."""

    def __init__(self, publisher: LocalPublisher, port: int = 0):
        self.failing: set[str] = set()
        self.asked: dict[str, int] = {}
        self.started = 1_700_000_000.0
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def reply(self, body: bytes, kind: str = "application/json") -> None:
                path = self.path.split("?")[0]
                fake.asked[path] = fake.asked.get(path, 0) + 1
                if path in fake.failing:
                    self.send_error(500, "boom")
                    return
                self.send_response(200)
                self.send_header("content-type", kind)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):  # noqa: N802  (http.server's name)
                if self.path == "/v1/models":
                    self.reply(json.dumps({"data": [{"id": "tiny", "root": "/nowhere/tiny"}]}).encode())
                elif self.path == "/kv_event_sources":
                    config = {
                        "enable_kv_cache_events": True,
                        "publisher": "zmq",
                        "endpoint": f"tcp://*:{publisher.port}",
                        "replay_endpoint": f"tcp://*:{publisher.replay_port}",
                        "topic": "kv-events",
                    }
                    self.reply(json.dumps({"0": config}).encode())
                elif self.path == "/metrics":
                    text = f"process_start_time_seconds {fake.started}\nvllm:prefix_cache_queries_total 10\n"
                    self.reply(text.encode(), "text/plain")
                else:
                    self.send_error(404)

            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                self.reply(json.dumps({"prompt": f"<{body['tokens'][0]}>"}).encode())

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.port = self.httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def payload(seq: int) -> bytes:
    return encode_batch(EventBatch(seq, float(seq), (BlocksStored((f"{seq:016x}",), None, (seq, 100 + seq), 2),)))


@pytest.fixture
def quick(monkeypatch):
    monkeypatch.setattr(attach_module, "METRICS_EVERY_S", 0.1)
    monkeypatch.setattr(server_http, "DETOKENIZE_RETRY_S", 0.5)


def attached(url: str, publisher: LocalPublisher) -> tuple[AttachSession, list[str]]:
    options = AttachOptions(urls=[url])
    session = AttachSession(options, connect(options))
    lines: list[str] = []
    session.on_problem.append(lambda problem: lines.append(problem.message))
    session.start()
    origin = session.endpoints[0].origin
    assert wait_for(lambda: origin in session.subscriber._epochs and session.subscriber._epochs[origin].connected)
    assert publisher.wait_subscribed()
    return session, lines


def test_metrics_and_detokenize_failing_while_events_flow(quick):
    publisher = LocalPublisher()
    fake = FakeServer(publisher)
    session, lines = attached(fake.url, publisher)
    origin = session.endpoints[0].origin
    try:
        fake.failing = {"/metrics", "/detokenize"}
        for seq in range(5):
            publisher.publish(payload(seq))
            time.sleep(0.2)
        assert wait_for(lambda: session.cache.stats(origin).batches == 5)
        time.sleep(0.5)  # several polls and retries fail meanwhile
        failing_lines = list(lines)
        fake.failing = set()
        publisher.publish(payload(5))
        assert wait_for(lambda: len(lines) == 4), lines
        time.sleep(0.5)
    finally:
        session.stop()
        publisher.close()
        fake.close()
    assert len(failing_lines) == 2, failing_lines  # one line each, not one per poll or per token
    assert any(line.startswith("metrics: ") and "HTTP 500" in line for line in failing_lines)
    assert any(line.startswith("token texts: ") and "shown by number" in line for line in failing_lines)
    assert "metrics: 127.0.0.1:" in lines[2] + lines[3] and "/metrics answers again" in lines[2] + lines[3]
    assert any(line == "token texts: /detokenize answers again" for line in lines[2:])
    assert len(lines) == 4 and not session.unreachable()  # an HTTP error is no outage: the server answered
    stats = session.cache.stats(origin)
    assert stats.batches == 6 and stats.lost == 0 and stats.held == 6 and stats.restarts == 0
    assert fake.asked["/metrics"] > 10  # polled on through the failures
    texts = session.cache.texts
    assert texts.piece(105) == "<105>" and texts.piece(100) == "#100"  # asked while failing: shown by number


def test_an_unreachable_http_side_is_one_outage_and_one_return(quick):
    """The HTTP side goes away while the publisher goes on (and comes back on its port, the same process): one
    line, the state for the screen while it lasts, one line back; events flow throughout, no restart."""
    publisher = LocalPublisher()
    fake = FakeServer(publisher)
    session, lines = attached(fake.url, publisher)
    origin = session.endpoints[0].origin
    try:
        publisher.publish(payload(0))
        assert wait_for(lambda: fake.asked.get("/metrics", 0) >= 2)
        port = fake.port
        fake.close()
        assert wait_for(lambda: session.unreachable())
        for seq in range(1, 4):
            publisher.publish(payload(seq))
        assert wait_for(lambda: session.cache.stats(origin).batches == 4)
        time.sleep(0.5)
        assert len(lines) == 1 and f"{origin} unreachable since" in lines[0] and "cannot reach" in lines[0], lines
        fake = FakeServer(publisher, port)
        assert wait_for(lambda: not session.unreachable())
        time.sleep(0.3)
    finally:
        session.stop()
        publisher.close()
        fake.close()
    assert len(lines) == 2 and f"{origin} answers again" in lines[1], lines
    stats = session.cache.stats(origin)
    assert stats.batches == 4 and stats.lost == 0 and stats.restarts == 0 and stats.held == 4


def test_start_returns_once_what_came_before_attaching_is_applied():
    """The front ends say "attached" when start() returns: by then the replay socket's batches are applied (marked
    caught up), so a request a user sends next is seen live, never taken for one made before kvtui came."""
    with LocalPublisher() as publisher:
        server = FakeServer(publisher)
        try:
            publisher.publish(payload(0))
            publisher.publish(payload(1))
            options = AttachOptions(urls=[server.url], metrics=False)
            session = AttachSession(options, connect(options))
            session.start()
            try:
                origin = session.endpoints[0].origin
                with session.cache.lock:
                    assert session.cache.stats(origin).stored == 2  # both, before start() returned
                    assert session.subscriber.caught_up.is_set()
            finally:
                session.stop()
        finally:
            server.close()
