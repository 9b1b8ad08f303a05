"""What kvtui asks a vLLM/SGLang server over HTTP (read-only GETs and tokenizer calls): its model, where it
publishes KV events (`/kv_event_sources`), its prefix-cache counters and capacity (`/metrics`), and token
texts (`/detokenize`). Plain urllib: no client library for four endpoints."""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..records.snapshot import frozen

TIMEOUT_S = 5.0
EVENTS_FLAGS = (
    "--enable-prefix-caching --kv-events-config "
    '\'{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557","topic":"kv-events"}\''
)


class ServerError(Exception):
    """A server kvtui cannot attach to; the message says why and what to do. `unreachable`: nothing answered (the
    server is down or away), as opposed to an answer kvtui cannot use."""

    def __init__(self, message: str, unreachable: bool = False):
        super().__init__(message)
        self.unreachable = unreachable


@frozen
class EventEndpoint:
    """One publisher: a server's data-parallel rank."""

    endpoint: str  # tcp://host:port to subscribe to
    replay: str | None  # the replay socket, where the server has one
    topic: str
    rank: int = 0
    origin: str = ""  # how kvtui names it: host:port of the server, /dpN for ranks after the first


@dataclass
class ServerInfo:
    url: str
    model: str = "?"  # the served model's name
    root: str | None = None  # its path or hub id (vLLM's /v1/models `root`)
    max_model_len: int | None = None
    endpoints: list[EventEndpoint] = field(default_factory=list)


def _get(url: str, timeout: float = TIMEOUT_S) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310  (a URL the user gave)
            return response.read()
    except urllib.error.HTTPError as error:
        raise ServerError(f"{url}: HTTP {error.code} {error.reason}") from None
    except (urllib.error.URLError, OSError) as error:
        reason = getattr(error, "reason", error)
        raise ServerError(f"cannot reach {url}: {reason}", unreachable=True) from None


def _post(url: str, body: dict, timeout: float = TIMEOUT_S) -> dict:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"content-type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310
            return json.loads(response.read())
    except urllib.error.HTTPError as error:
        raise ServerError(f"{url}: HTTP {error.code} {error.reason}") from None
    except (urllib.error.URLError, OSError) as error:
        raise ServerError(f"cannot reach {url}: {getattr(error, 'reason', error)}", unreachable=True) from None
    except ValueError as error:
        raise ServerError(f"{url}: {error}") from None


def normalize_url(url: str) -> str:
    if "://" not in url:
        url = "http://" + url
    return url.rstrip("/")


def origin_name(url: str, rank: int = 0) -> str:
    netloc = urllib.parse.urlsplit(url).netloc or url
    return netloc if rank == 0 else f"{netloc}/dp{rank}"


def subscribe_address(endpoint: str, host: str) -> str:
    """A publisher's bind address (`tcp://*:5557`, `tcp://0.0.0.0:5557`) as a subscriber dials it."""
    for wildcard in ("*", "0.0.0.0", "[::]", "::"):
        prefix = f"tcp://{wildcard}:"
        if endpoint.startswith(prefix):
            return f"tcp://{host}:{endpoint[len(prefix) :]}"
    return endpoint


def discover(url: str) -> ServerInfo:
    """The model and the KV event publishers of the server at `url` (raises ServerError with what to do)."""
    url = normalize_url(url)
    info = ServerInfo(url)
    try:
        models = json.loads(_get(f"{url}/v1/models"))
        first = (models.get("data") or [{}])[0]
        info.model = str(first.get("id", "?"))
        info.root = first.get("root")
        info.max_model_len = first.get("max_model_len")
    except (ServerError, ValueError, AttributeError, IndexError) as error:
        if isinstance(error, ServerError) and "cannot reach" in str(error):
            raise
    host = urllib.parse.urlsplit(url).hostname or "127.0.0.1"
    try:
        sources = json.loads(_get(f"{url}/kv_event_sources"))
    except ServerError as error:
        raise ServerError(
            f"{url} does not say where it publishes KV events ({error}); give the publisher with "
            "--events tcp://HOST:PORT"
        ) from None
    except ValueError:
        sources = {}
    for rank_text, config in sorted((sources or {}).items(), key=lambda item: int(item[0])):
        if not isinstance(config, dict) or not config.get("enable_kv_cache_events"):
            continue
        if config.get("publisher") != "zmq" or not config.get("endpoint"):
            continue
        rank = int(rank_text)
        replay = config.get("replay_endpoint")
        info.endpoints.append(
            EventEndpoint(
                endpoint=subscribe_address(config["endpoint"], host),
                replay=subscribe_address(replay, host) if replay else None,
                topic=config.get("topic") or "",
                rank=rank,
                origin=origin_name(url, rank),
            )
        )
    if not info.endpoints:
        raise ServerError(
            f"the server at {url} publishes no KV cache events: start it with {EVENTS_FLAGS} "
            "(vLLM; SGLang takes the same --kv-events-config), or give a publisher with --events tcp://HOST:PORT"
        )
    return info


def given_endpoints(events: str, ranks: int, topic: str, replay: str | None = None) -> list[EventEndpoint]:
    """`--events tcp://HOST:PORT` (and `--dp-ranks N`: rank r publishes on PORT + r, as vLLM and SGLang do)."""
    match = re.fullmatch(r"(tcp://.+):(\d+)", events)
    if ranks > 1 and match is None:
        raise ServerError(f"--dp-ranks needs a tcp://HOST:PORT endpoint, not {events}")
    out = []
    for rank in range(ranks):
        if match is not None:
            endpoint = f"{match.group(1)}:{int(match.group(2)) + rank}"
        else:
            endpoint = events
        replay_rank = None
        if replay:
            m = re.fullmatch(r"(tcp://.+):(\d+)", replay)
            replay_rank = f"{m.group(1)}:{int(m.group(2)) + rank}" if m else replay
        name = endpoint.removeprefix("tcp://") if rank == 0 else f"{events.removeprefix('tcp://')}/dp{rank}"
        out.append(EventEndpoint(endpoint, replay_rank, topic, rank, name))
    return out


@dataclass
class CacheMetrics:
    """The prefix-cache counters a server's /metrics gives (summed over its engines)."""

    queries: float | None = None  # prompt tokens looked up in the prefix cache
    hits: float | None = None  # ... found there
    capacity: int | None = None  # blocks the KV cache holds
    block_size: int | None = None
    usage: float | None = None  # fraction of the KV cache in use
    started: float | None = None  # the server process's start time (`process_start_time_seconds`): its identity
    # what the events are cross-checked against (server/metric_rules.py), vLLM's names; None where not given
    requests: float | None = None  # requests finished (`vllm:request_prompt_tokens` histogram's count)
    prompt_tokens: float | None = None  # ... their prompt tokens (its sum)
    prompt_buckets: list[list[float]] | None = None  # ... [upper bound, requests with at most that many], ascending
    generated: float | None = None  # tokens generated (`vllm:generation_tokens`)
    running: float | None = None  # requests running now, and waiting (gauges)
    waiting: float | None = None
    preemptions: float | None = None  # requests preempted (their tokens computed again outside `queries`)


CROSS_CHECKED = {  # CacheMetrics field -> the vLLM sample summed over its engines
    "requests": "vllm:request_prompt_tokens_count",
    "prompt_tokens": "vllm:request_prompt_tokens_sum",
    "generated": "vllm:generation_tokens_total",
    "running": "vllm:num_requests_running",
    "waiting": "vllm:num_requests_waiting",
    "preemptions": "vllm:num_preemptions_total",
}
SUMMED = {"vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:kv_cache_usage_perc"} | set(
    CROSS_CHECKED.values()
)
_SAMPLE = re.compile(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)")


def parse_metrics(text: str) -> CacheMetrics:
    """vLLM's (`vllm:prefix_cache_queries_total` ...) and SGLang's (`sglang:cache_hit_rate`) Prometheus text."""
    metrics = CacheMetrics()
    sums: dict[str, float] = {}
    buckets: dict[float, float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None:
            continue
        name, labels, value = match.group(1), match.group(2) or "", float(match.group(3))
        if name in SUMMED:
            sums[name] = sums.get(name, 0.0) + value
        elif name == "vllm:request_prompt_tokens_bucket":
            bound = re.search(r'le="([^"]+)"', labels)
            if bound and bound.group(1) not in ("+Inf", "inf"):
                buckets[float(bound.group(1))] = buckets.get(float(bound.group(1)), 0.0) + value
        elif name == "vllm:cache_config_info":
            blocks = re.search(r'num_gpu_blocks="(\d+)"', labels)
            size = re.search(r'block_size="(\d+)"', labels)
            if blocks:
                metrics.capacity = (metrics.capacity or 0) + int(blocks.group(1))
            if size:
                metrics.block_size = int(size.group(1))
        elif name == "sglang:cache_hit_rate":
            metrics.hits, metrics.queries = value, 1.0  # a rate, not counters
        elif name == "sglang:token_usage":
            metrics.usage = value
        elif name == "process_start_time_seconds" and metrics.started is None:
            metrics.started = value
    if "vllm:prefix_cache_queries_total" in sums:
        metrics.queries = sums["vllm:prefix_cache_queries_total"]
        metrics.hits = sums.get("vllm:prefix_cache_hits_total", 0.0)
    if "vllm:kv_cache_usage_perc" in sums:
        metrics.usage = sums["vllm:kv_cache_usage_perc"]
    for field_name, metric in CROSS_CHECKED.items():
        if metric in sums:
            setattr(metrics, field_name, sums[metric])
    if buckets:
        metrics.prompt_buckets = [[bound, count] for bound, count in sorted(buckets.items())]
    return metrics


def fetch_metrics(url: str) -> CacheMetrics:
    return parse_metrics(_get(f"{normalize_url(url)}/metrics").decode("utf-8", "replace"))


_SPECIAL_PIECE = re.compile(r"^<\|?[A-Za-z_][\w.-]*\|?>$")


DETOKENIZE_RETRY_S = 10.0  # after /detokenize failed, ids are shown by number this long before it is asked again


class TextSource:
    """Token texts for the prefix cache's TokenTexts: a local tokenizer where the served model's files are on
    this machine (or --tokenizer names one), else the server's /detokenize, one id per call, remembered.
    /detokenize failing is told once (`on_state(False, error)`), and it is asked again every DETOKENIZE_RETRY_S
    (not per token: a server that times out would hold the event reader); its answering again is told once too
    (`on_state(True, the error it had)`)."""

    def __init__(self, url: str | None, model: str = "", tokenizer_path: str | None = None):
        self.url, self.model = url, model
        self.tokenizer = None
        self.special: set[int] = set()
        self.where = "none"
        self.on_state: Callable[[bool, ServerError], None] | None = None
        self._failed: ServerError | None = None  # why /detokenize failed, until it answers again
        self._retry_at = 0.0  # ... and it is not asked before this (time.monotonic())
        if tokenizer_path and Path(tokenizer_path).exists():
            from transformers import AutoTokenizer

            from ..reading.tokens import special_token_ids

            self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
            self.special = set(special_token_ids(self.tokenizer))
            self.where = tokenizer_path
        elif url:
            self.where = f"{url}/detokenize"

    def __call__(self, ids: list[int]) -> dict[int, str]:
        if self.tokenizer is not None:
            return {i: self.tokenizer.decode([i], skip_special_tokens=False) for i in ids}
        if not self.url:
            return {}
        if self._failed is not None and time.monotonic() < self._retry_at:
            return {}  # shown by their numbers; asked again next time they are needed
        out: dict[int, str] = {}
        for token_id in ids:
            try:
                reply = _post(f"{self.url}/detokenize", {"model": self.model, "tokens": [token_id]})
            except ServerError as error:
                if self._failed is None and self.on_state is not None:
                    self.on_state(False, error)
                self._failed = self._failed or error
                self._retry_at = time.monotonic() + DETOKENIZE_RETRY_S
                return out
            if self._failed is not None:
                failed, self._failed = self._failed, None
                if self.on_state is not None:
                    self.on_state(True, failed)
            piece = reply.get("prompt")
            if isinstance(piece, str):
                out[token_id] = piece
                if _SPECIAL_PIECE.match(piece):  # the server does not say which are special: <|...|> and <...>
                    self.special.add(token_id)
        return out
