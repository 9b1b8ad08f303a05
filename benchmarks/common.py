"""Shared helpers for the kvtui benchmarks: environment, statistics, machine info, progress."""

from __future__ import annotations

import os
import platform
import statistics
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"

# Reuse the converted SmolLM2 the test suite keeps under .cache/ (converted once if missing).
os.environ.setdefault("KVTUI_CACHE_DIR", str(ROOT / ".cache" / "test-models"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

STARTED = time.perf_counter()

SEED_TURNS = [
    "Let's start by defining a variable k equal to 5. What is k?",
    "Now set a new variable m equal to k multiplied by 11. What is m?",
    "If we increment k by 1, what is the new value of m?",
    "Okay, forget k and m. Let x = 100 and y = 25. What is x divided by y?",
    "Now, a new variable z is the product of x and y. Calculate z.",
    "If we subtract 500 from z, what is the result?",
    "What was the value of m from our earlier conversation?",
    "Final question: what was the first variable we defined in this entire chat?",
]


def log(message: str) -> None:
    print(f"[{time.perf_counter() - STARTED:6.1f}s] {message}", flush=True)


def elapsed() -> float:
    return time.perf_counter() - STARTED


# ---- statistics -----------------------------------------------------------------------------------


def summary(values) -> dict:
    """N, median, min, max, and the interquartile range of a list of numbers."""
    values = sorted(float(v) for v in values)
    if not values:
        return {
            "n": 0,
            "median": float("nan"),
            "min": float("nan"),
            "max": float("nan"),
            "q1": float("nan"),
            "q3": float("nan"),
        }
    if len(values) >= 4:
        q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    else:
        q1, q3 = values[0], values[-1]
    return {
        "n": len(values),
        "median": statistics.median(values),
        "min": values[0],
        "max": values[-1],
        "q1": q1,
        "q3": q3,
    }


def fmt(value: float, digits: int = 2) -> str:
    if value != value:  # nan
        return "–"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.{digits}f}"


def fmt_stat(s: dict, digits: int = 2, unit: str = "") -> str:
    """'median (min–max)' for small N, 'median (IQR q1–q3)' for N >= 8."""
    if not s or s["n"] == 0:
        return "–"
    if s["n"] == 1:
        return f"{fmt(s['median'], digits)}{unit}"
    if s["n"] >= 8:
        return f"{fmt(s['median'], digits)}{unit} (IQR {fmt(s['q1'], digits)}–{fmt(s['q3'], digits)})"
    return f"{fmt(s['median'], digits)}{unit} ({fmt(s['min'], digits)}–{fmt(s['max'], digits)})"


def median(values) -> float:
    values = list(values)
    return statistics.median(values) if values else float("nan")


# ---- machine ---------------------------------------------------------------------------------------


def machine_info() -> dict:
    import psutil

    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        model = platform.processor() or "unknown"
    return {
        "cpus": os.cpu_count(),
        "cpu_model": model,
        "ram_gib": psutil.virtual_memory().total / 2**30,
        "platform": platform.platform(),
    }


def versions() -> dict:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for name in ("torch", "transformers", "textual", "rich", "tokenizers", "kvtui"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = "not installed"
    import torch

    out["torch threads"] = str(torch.get_num_threads())
    return out


class BackgroundLoad:
    """Samples the CPU used by *other* processes while a section runs (the machine may be shared):
    a number > 0 means the timings were taken with competition for the 2 cores."""

    def __init__(self, interval: float = 1.0):
        import psutil

        self._psutil = psutil
        self.interval = interval
        self.samples: list[float] = []  # other processes' CPU, in cores
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="bench-load-sampler")
        self._me = {os.getpid()}

    def _loop(self) -> None:
        psutil = self._psutil
        last_total = psutil.cpu_times()
        me = psutil.Process()
        last_mine = self._mine(me)
        last_t = time.monotonic()
        while not self._stop.wait(self.interval):
            total = psutil.cpu_times()
            mine = self._mine(me)
            now = time.monotonic()
            busy = (
                total.user + total.system + total.nice + getattr(total, "irq", 0) + getattr(total, "softirq", 0)
            ) - (
                last_total.user
                + last_total.system
                + last_total.nice
                + getattr(last_total, "irq", 0)
                + getattr(last_total, "softirq", 0)
            )
            dt = now - last_t
            if dt > 0:
                self.samples.append(max(0.0, (busy - (mine - last_mine)) / dt))
            last_total, last_mine, last_t = total, mine, now

    @staticmethod
    def _mine(proc) -> float:
        t = proc.cpu_times()
        total = t.user + t.system
        try:  # children we spawned (subprocess benchmarks) are ours too: reaped ones...
            total += t.children_user + t.children_system
        except AttributeError:
            pass
        for child in proc.children(recursive=True):  # ...and running ones
            try:
                c = child.cpu_times()
                total += c.user + c.system
            except Exception:  # noqa: BLE001 - it just exited
                pass
        return total

    def start(self) -> BackgroundLoad:
        self._thread.start()
        return self

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join(timeout=2)
        s = summary(self.samples)
        s["load1"] = os.getloadavg()[0]
        return s


def rss_bytes() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def in_worker(fn, *args, **kwargs):
    """Run fn in a fresh thread and return its result (re-raising its exception), the way the TUI runs every
    engine action in a fresh worker thread. See `thread_probe` for why this matters on some machines."""
    out: dict = {}

    def target():
        try:
            out["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            out["error"] = exc

    thread = threading.Thread(target=target, name="bench-worker")
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


def _matmul_gflops(seconds: float) -> float:
    import torch

    a, w = torch.randn(200, 576), torch.randn(1536, 576)  # a SmolLM2 MLP matmul over 200 tokens
    a @ w.T
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ w.T
        n += 1
    return n * 2 * 200 * 576 * 1536 / (time.perf_counter() - t0) / 1e9


def thread_probe(rounds: int = 6, seconds: float = 0.5) -> dict:
    """torch matmul throughput from the main thread vs from a fresh thread, alternated."""
    main, worker = [], []
    for _ in range(rounds):
        main.append(_matmul_gflops(seconds))
        worker.append(in_worker(_matmul_gflops, seconds))
    return {"main_gflops": summary(main), "worker_gflops": summary(worker)}
