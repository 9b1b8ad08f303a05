"""6b. What a step costs kvtui on a GPU, where a forward takes a few ms and kvtui's fixed Python cost shows.

The same parts and paired step costs as section 6 (b_step_cost.py), and the whole-loop ratios (watched /
plain, engine / bare, interleaved, median of N), on a CUDA device, for:

  tiny llama, 3 layers (fp32)              the Python-bound model of section 6, on the GPU
  SmolLM2-shaped, 30 layers (bf16)         SmolLM2-135M's config and tokenizer, random weights
  SmolLM2-shaped, static + compile         the same with a StaticCache and a torch.compile'd forward
                                           (mode "reduce-overhead": CUDA graphs), as the caching tutorial does
  8B-class, 32 layers (bf16)               Llama-3-8B's shape (4096 hidden, 32 heads, 8 KV heads, 14336 MLP)
                                           with SmolLM2's 49,152-token vocabulary and tokenizer

Random weights are honest for a timing: a forward's cost does not depend on the values. The tokenizer
is SmolLM2's (its chat template), carried as files: `--tokenizer DIR` (tokenizer files + config.json).

Each row also runs the floor (b_step_cost.FloorHook on the plain loop: fed ids, cache length before and after,
top-10 ids and probabilities, every layer's K shape, one JSON line per forward) and prints watched / floor and
the µs a token of plain, floor and watched loops, interleaved.

Usage (on a machine with CUDA): python benchmarks/b_step_cost_gpu.py [--tokenizer DIR]
    [--rows tiny,smol,smol-compile,8b] [--n 120] [--tokens 200] [--repeats 5] [--json OUT]
    [--compile-mode reduce-overhead|default|...]
In one command from a CPU-only checkout: `python benchmarks/b_step_cost_gpu.py --prepare` here (writes
benchmarks/.gpu: the tokenizer and the tested transformers), then on the GPU machine, with benchmarks/.gpu
carried: `bash benchmarks/gpu_step_cost.sh` (see the script). Not run by `make bench`: it needs CUDA.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402,F401  (environment before torch loads)

# isort: split
import torch  # noqa: E402
from transformers import AutoTokenizer, DynamicCache, LlamaConfig, LlamaForCausalLM, StaticCache  # noqa: E402

from b_step_cost import (  # noqa: E402
    PROMPT,
    FloorHook,
    PartClock,
    _costs,
    _pairs,
    _prompt_ids,
    probe_parts,
    session_parts,
    table,
)
from common import log, summary  # noqa: E402
from kvtui.engine.chat.session import ChatSession, SessionConfig  # noqa: E402
from kvtui.engine.reading import introspect  # noqa: E402
from kvtui.engine.records import recorder
from kvtui.engine.watch import probe

MAX_LEN = 1024  # static cache length: prompt + warm-ups + every timed token fit
DEVICE = "cuda"  # --device cpu: a smoke test of this script on a machine without CUDA
SMOKE_LAYERS = 0  # --smoke: every model cut to this many layers (0: the real shapes); a check that it runs
SMOKE_BACKEND = "eager"  # --smoke: torch.compile's backend (dynamo traces the forward; no inductor code generation)


def _sync_argmax(logits: torch.Tensor) -> torch.Tensor:
    return logits[:, -1].argmax(-1, keepdim=True)  # [1, 1]; int() of it waits for the GPU


class Loop:
    """A user's greedy loop (template ids, a cache, argmax), dynamic or static; `forward` may be compiled."""

    def __init__(self, model, tokenizer, static: bool, forward=None):
        self.model, self.forward = model, forward or model
        self.cache = (
            StaticCache(config=model.config, max_cache_len=MAX_LEN) if static else DynamicCache(config=model.config)
        )
        with torch.inference_mode():
            out = model(input_ids=_prompt_ids(tokenizer).to(model.device), past_key_values=self.cache, use_cache=True)
        self.token = _sync_argmax(out.logits)

    def step(self) -> int:
        with torch.inference_mode():
            out = self.forward(input_ids=self.token, past_key_values=self.cache, use_cache=True)
        self.token = _sync_argmax(out.logits)
        return int(self.token)


class Bare:
    """The engine's forwards with nothing around them (explicit positions, logits_to_keep=1, argmax)."""

    def __init__(self, model, prompt_ids: list[int], static: bool, compiled=None):
        self.model = model
        self.cache = (
            StaticCache(config=model.config, max_cache_len=MAX_LEN) if static else DynamicCache(config=model.config)
        )
        self.decode = compiled or model
        self.extra = {"logits_to_keep": 1} if introspect.forward_accepts(model, "logits_to_keep") else {}
        self.position = len(prompt_ids)
        self.token = self._forward(model, prompt_ids, 0)

    def _forward(self, forward, ids: list[int], start: int) -> int:
        device = self.model.device
        with torch.inference_mode():
            out = forward(
                input_ids=torch.tensor([ids], device=device),
                past_key_values=self.cache,
                use_cache=True,
                position_ids=torch.arange(start, start + len(ids), device=device).unsqueeze(0),
                **self.extra,
            )
        return int(torch.argmax(out.logits[0, -1]))

    def step(self, token: int) -> int:
        self.token = self._forward(self.decode, [token], self.position)
        self.position += 1
        return self.token


COMPILE_MODE = "reduce-overhead"  # --compile-mode: on torch 2.11 this mode's Triton autotuning segfaulted (GPU.md)


def _compile(model):
    return torch.compile(model.forward, mode=COMPILE_MODE, fullgraph=False, dynamic=False)


def _session(model, tokenizer, static: bool, trace: Path):
    config = (
        SessionConfig(max_new_tokens=10**9, cache="static", max_cache_len=MAX_LEN, compile=True)
        if static
        else SessionConfig(max_new_tokens=10**9)
    )
    chat = ChatSession(model, tokenizer, config)
    chat.stop_ids = frozenset()  # random weights: never stop on an end-of-turn token
    rec = recorder.Recorder(chat, trace)
    first = chat.send(PROMPT)
    return chat, rec, first


def engine_cost(model, plain_model, tokenizer, static: bool, n: int, tmp: Path) -> dict:
    clock = PartClock()
    session_parts(clock)
    try:
        chat, rec, first = _session(model, tokenizer, static, tmp / "engine.jsonl")
        bare = Bare(plain_model, list(first.input_ids), static, _compile(plain_model) if static else None)
        feed = [first.chosen.id]
        for _ in range(3):  # warm-up (the compiled forwards build their graphs here)
            chat.step()
            feed.append(bare.step(feed[-1]))
        clock.steps.clear()
        clock.step.clear()

        def engine_step():
            chat.step()
            clock.end_step()

        engine_s, bare_s = _pairs(engine_step, lambda: feed.append(bare.step(feed[-1])), n)
        rec.close()
    finally:
        clock.remove()
    return _costs(clock, engine_s, bare_s)


def watch_cost(model, plain_model, tokenizer, static: bool, n: int, tmp: Path) -> dict:
    clock = PartClock()
    probe_parts(clock)
    watched_forward = plain_forward = None
    if static:  # the tutorial's way: model.forward = torch.compile(model.forward, mode="reduce-overhead")
        watched_forward, plain_forward = _compile(model), _compile(plain_model)
    try:
        plain = Loop(plain_model, tokenizer, static, plain_forward)
        with probe.watch(model, tokenizer, trace=tmp / "watched.jsonl"):
            if static:
                model.forward = watched_forward  # an instance attribute, as users set it; removed below
            try:
                watched = Loop(model, tokenizer, static)
                for _ in range(3):
                    watched.step()
                    plain.step()
                clock.steps.clear()
                clock.step.clear()

                def watched_step():
                    watched.step()
                    clock.end_step()

                watched_s, plain_s = _pairs(watched_step, plain.step, n)
            finally:
                model.__dict__.pop("forward", None)
    finally:
        clock.remove()
    return _costs(clock, watched_s, plain_s)


def ratios(model, plain_model, tokenizer, static: bool, tokens: int, repeats: int, tmp: Path) -> dict:
    """Whole loops of `tokens` tokens, interleaved per repeat (the first repeat is a warm-up)."""
    found: dict[str, list[float]] = {
        "watched_over_plain": [],
        "engine_over_bare": [],
        "floor_over_plain": [],
        "watched_over_floor": [],
        "plain_us": [],
        "floor_us": [],
        "watched_us": [],
    }
    compiled_plain = _compile(plain_model) if static else None
    compiled_watched = _compile(model) if static else None

    def timed(step) -> float:
        started = time.perf_counter()
        for _ in range(tokens):
            step()
        return time.perf_counter() - started

    def run_watched(repeat: int) -> float:
        with probe.watch(model, tokenizer, trace=tmp / f"ratio{repeat}.jsonl"):
            if static:
                model.forward = compiled_watched
            try:
                return timed(Loop(model, tokenizer, static).step)
            finally:
                model.__dict__.pop("forward", None)

    def run_floor(repeat: int) -> float:
        # the floor: the same plain loop with the thinnest hook that records the same facts (one JSON line)
        hook = FloorHook(plain_model, tmp / f"floor{repeat}.jsonl")
        try:
            return timed(Loop(plain_model, tokenizer, static, compiled_plain).step)
        finally:
            hook.remove()

    for repeat in range(repeats + 1):
        plain = timed(Loop(plain_model, tokenizer, static, compiled_plain).step)
        if repeat % 2:  # watched and floor alternate which goes first
            floor, watched = run_floor(repeat), run_watched(repeat)
        else:
            watched, floor = run_watched(repeat), run_floor(repeat)
        chat, rec, first = _session(model, tokenizer, static, tmp / f"engine{repeat}.jsonl")
        engine = timed(chat.step)
        rec.close()
        bare_loop = Bare(plain_model, list(first.input_ids), static, compiled_plain)
        feed = [first.chosen.id]
        bare = timed(lambda feed=feed, bare_loop=bare_loop: feed.append(bare_loop.step(feed[-1])))
        if repeat:
            found["watched_over_plain"].append(watched / plain)
            found["engine_over_bare"].append(engine / bare)
            found["floor_over_plain"].append(floor / plain)
            found["watched_over_floor"].append(watched / floor)
            for name, value in (("plain_us", plain), ("floor_us", floor), ("watched_us", watched)):
                found[name].append(value / tokens * 1e6)
            log(
                f"    repeat {repeat}: watched/plain {watched / plain:.3f}, engine/bare {engine / bare:.3f}, "
                f"floor/plain {floor / plain:.3f}, watched/floor {watched / floor:.3f}; "
                f"plain {plain / tokens * 1e3:.2f} ms/token, bare {bare / tokens * 1e3:.2f} ms/token"
            )
    return {name: summary(values) for name, values in found.items()}


# ---- the models ------------------------------------------------------------------------------------------


def _random_llama(config: LlamaConfig, dtype: torch.dtype):
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(DEVICE):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    return model.eval()


def build(row: str, tokenizer_dir: Path, tmp: Path):
    """(label, model, plain model, tokenizer, static) for a row name."""
    smol = json.loads((tokenizer_dir / "config.json").read_text())
    smol.pop("quantization_config", None)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    if row == "tiny":
        from kvtui.engine.chat.loader import load_model
        from kvtui.engine.models.tiny import build_tiny

        loaded = load_model(str(build_tiny("llama", tmp / "tiny-llama", layers=3)), dtype="float32", device=DEVICE)
        model = loaded.model.eval()
        return "tiny llama, 3 layers, fp32", model, copy.deepcopy(model), loaded.tokenizer, False
    if row in ("smol", "smol-compile"):
        config = LlamaConfig(**{k: v for k, v in smol.items() if k not in ("architectures", "torch_dtype", "dtype")})
        if SMOKE_LAYERS:
            config.num_hidden_layers = SMOKE_LAYERS
        model = _random_llama(config, torch.bfloat16)
        label = f"SmolLM2-shaped, {config.num_hidden_layers} layers, bf16" + (
            ", static + compile" if row == "smol-compile" else ", dynamic"
        )
        return label, model, _random_llama(config, torch.bfloat16), tokenizer, row == "smol-compile"
    if row == "8b":
        config = LlamaConfig(
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=smol["vocab_size"],
            rope_theta=500000.0,
            max_position_embeddings=8192,
            bos_token_id=smol.get("bos_token_id"),
            eos_token_id=smol.get("eos_token_id"),
            tie_word_embeddings=False,
        )
        if SMOKE_LAYERS:  # and narrower (the same 4:1 query:KV heads): two 8B-wide models are minutes on a CPU
            config.num_hidden_layers, config.intermediate_size, config.hidden_size = SMOKE_LAYERS, 512, 256
            config.num_attention_heads, config.num_key_value_heads, config.head_dim = 8, 2, 32
        model = _random_llama(config, torch.bfloat16)
        plain_model = _random_llama(config, torch.bfloat16)  # a second instance: the probe watches the first
        label = f"8B-class (Llama-3-8B shape{', narrowed' if SMOKE_LAYERS else ''}), {config.num_hidden_layers} layers"
        return f"{label}, bf16, dynamic", model, plain_model, tokenizer, False
    raise SystemExit(f"unknown row {row!r}")


CARRY = Path(os.environ.get("KVTUI_GPU_CARRY") or Path(__file__).resolve().parent / ".gpu")  # ignored by git;
# carried to the GPU machine (KVTUI_GPU_CARRY: elsewhere, as the suite's smoke test prepares it in a temporary dir)


def _source() -> str:
    """kvtui's commit (and whether the tree had changes), from git here, else from what --prepare wrote."""
    import subprocess

    root = Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True).stdout
        return f"`{commit}`" + (" with uncommitted changes" if dirty.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        carried = CARRY / "source.txt"
        return carried.read_text().strip() + " (as prepared)" if carried.exists() else "unknown commit"


def _card() -> str:
    """The GPU as nvidia-smi names it (driver, memory), else torch's name; the device when it is not CUDA (a smoke
    run on the CPU of a machine that has a GPU names the CPU, what it ran on)."""
    import subprocess

    if DEVICE != "cuda":
        return f"{DEVICE} (no GPU)"

    try:
        line = (
            subprocess.run(
                ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=30,
            )
            .stdout.strip()
            .splitlines()
        )
    except (OSError, subprocess.SubprocessError):
        line = []
    if line:
        name, driver, memory = (part.strip() for part in (line[0].split(",") + ["?", "?"])[:3])
        return f"{len(line)} x {name} (driver {driver}, {memory})"
    return torch.cuda.get_device_name(0) if DEVICE == "cuda" else f"{DEVICE} (no GPU)"


def markdown(result: dict, command: str) -> str:
    """The run as a GPU.md section: the card, versions, kvtui's commit, the command, every number."""
    smoke = result.get("smoke")
    lines = [
        f"## {'SMOKE RUN (not a measurement): ' if smoke else ''}{result['card']}, {result['date']}",
        "",
        f"torch {result['torch']}, transformers {result['transformers']}, kvtui at {result['source']}. Command "
        f"(from the repository root, `benchmarks/.gpu` carried): `{command}`; raw numbers: `gpu_step_cost.json`.",
        "",
    ]
    if smoke:
        lines += [
            f"A check that the script runs end to end: device {DEVICE}, models cut to {SMOKE_LAYERS} layers (the "
            f"8B-class narrowed), a few steps, torch.compile with backend {SMOKE_BACKEND!r}. Its numbers mean nothing.",
            "",
        ]
    lines += [
        "| model | plain µs a token | floor µs | watched µs | kvtui adds (µs a token) | the floor adds "
        "| watched / plain | watched / floor | floor / plain | engine / bare |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, r in result["ratios"].items():
        if "error" in r:
            lines.append(f"| {label} | failed: {r['error']} | | | | | | | | |")
            continue

        def cell(name: str, r: dict = r) -> str:
            return f"{r[name]['median']:.3f} ({r[name]['min']:.3f}–{r[name]['max']:.3f})"

        plain, floor, watched = (r[name]["median"] for name in ("plain_us", "floor_us", "watched_us"))
        lines.append(
            f"| {label} | {plain:.0f} | {floor:.0f} | {watched:.0f} | **{watched - plain:+.0f}** | "
            f"{floor - plain:+.0f} | {cell('watched_over_plain')} | **{cell('watched_over_floor')}** | "
            f"{cell('floor_over_plain')} | {cell('engine_over_bare')} |"
        )
    skipped = result.get("skipped")
    if skipped:
        lines += ["", f"Not run (the time budget was spent): {', '.join(skipped)}."]
    if result["parts"]:
        lines += ["", "Per step, part by part (µs, median; paired with the plain step):", "", *table(result)]
    return "\n".join(lines) + "\n"


def write_markdown(result: dict, command: str, out_dir: Path | None) -> None:
    """`out_dir`/gpu_step_cost.md (this run) and `out_dir`/GPU.md (benchmarks/GPU.md with this run added first
    after its title, to copy over the checkout's)."""
    if out_dir is None:
        return
    section = markdown(result, command)
    (out_dir / "gpu_step_cost.md").write_text(section)
    current = (Path(__file__).resolve().parent / "GPU.md").read_text()
    title, _, rest = current.partition("\n\n")
    (out_dir / "GPU.md").write_text(f"{title}\n\n{section}\n{rest}")


def prepare() -> None:
    """What a GPU machine without a network needs beside the checkout: SmolLM2's tokenizer files and config
    (from the embedded model kvtui converted here) and the tested transformers as a tarball (the machine's own
    may be outside kvtui's tested range). `benchmarks/gpu_step_cost.sh` unpacks and runs it."""
    import shutil
    import tarfile

    import transformers

    from kvtui.engine.models.embedded import embedded_model_dir

    CARRY.mkdir(exist_ok=True)
    (CARRY / ".gitignore").write_text("*\n")
    source = Path(embedded_model_dir())
    tokenizer = CARRY / "tokenizer"
    tokenizer.mkdir(exist_ok=True)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (source / name).exists():
            shutil.copy(source / name, tokenizer / name)
    package = Path(transformers.__file__).parent
    info = next(package.parent.glob(f"transformers-{transformers.__version__}.dist-info"), None)
    with tarfile.open(CARRY / "transformers.tar.gz", "w:gz", compresslevel=1) as tar:  # 1 s, not 25 s; 14 MiB, not 11
        skip = lambda t: None if "__pycache__" in t.name else t  # noqa: E731
        tar.add(package, arcname="transformers", filter=skip)
        if info is not None:
            tar.add(info, arcname=info.name)
    (CARRY / "source.txt").write_text(_source() + "\n")  # the GPU machine's copy has no .git
    size = (CARRY / "transformers.tar.gz").stat().st_size / 2**20
    log(f"wrote {CARRY}: tokenizer from {source}, transformers {transformers.__version__} ({size:.0f} MiB)")


def _smoke_compile() -> None:
    """--smoke: every torch.compile of this process (the script's and the chat session's) with SMOKE_BACKEND, so
    the compiled row's code paths run on a CPU in seconds; inductor's code generation is the GPU run's."""
    real = torch.compile

    def compile_smoke(model=None, **kwargs):
        kwargs.pop("mode", None)
        return real(model, backend=SMOKE_BACKEND, **kwargs)

    torch.compile = compile_smoke


def main() -> None:
    global DEVICE, COMPILE_MODE, SMOKE_LAYERS
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokenizer", type=Path, default=CARRY / "tokenizer", help="SmolLM2's tokenizer + config")
    parser.add_argument(
        "--prepare", action="store_true", help=f"write {CARRY} here (the files the GPU machine needs), run nothing"
    )
    parser.add_argument("--rows", default="tiny,smol,8b,smol-compile")  # the compiles last: the slowest
    parser.add_argument("--n", type=int, default=120)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--compile-mode", default=COMPILE_MODE, help="torch.compile mode of the smol-compile row")
    parser.add_argument(
        "--smoke", action="store_true", help="check that it runs: on the CPU, models of 2 layers, a few steps"
    )
    parser.add_argument("--budget-s", type=float, default=0, help="start no row after this many seconds (0: none)")
    parser.add_argument("--md-dir", type=Path, help="write gpu_step_cost.md and GPU.md (with this run) here")
    args = parser.parse_args()
    if args.prepare:
        prepare()
        return
    if args.smoke:
        args.device, args.n, args.tokens, args.repeats, SMOKE_LAYERS = "cpu", 3, 3, 1, 2
        _smoke_compile()
    DEVICE, COMPILE_MODE = args.device, args.compile_mode
    command = os.environ.get("KVTUI_GPU_COMMAND") or " ".join(
        ["python", "benchmarks/b_step_cost_gpu.py", *sys.argv[1:]]
    )
    if DEVICE == "cuda" and not torch.cuda.is_available():
        raise SystemExit("b_step_cost_gpu: no CUDA device here")
    result = {
        "device": torch.cuda.get_device_name(0) if DEVICE == "cuda" else DEVICE,
        "card": _card(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "source": _source(),
        "smoke": args.smoke,
        "torch": torch.__version__,
        "parts": {},
        "ratios": {},
        "skipped": [],
    }
    started = time.perf_counter()
    import transformers

    result["transformers"] = transformers.__version__
    log(f"{result['device']}, torch {torch.__version__}, transformers {transformers.__version__}")
    with tempfile.TemporaryDirectory(prefix="kvtui-gpu-") as tmp_name:
        tmp = Path(tmp_name)
        for row in args.rows.split(","):
            if args.budget_s and time.perf_counter() - started > args.budget_s:
                result["skipped"].append(row)
                log(f"{row}: not started, {args.budget_s:.0f} s spent")
                continue
            label, model, plain_model, tokenizer, static = build(row, args.tokenizer, tmp)
            log(f"{label}")
            try:
                for kind, measure in (("engine", engine_cost), ("watch", watch_cost)):
                    r = measure(model, plain_model, tokenizer, static, args.n, tmp)
                    result["parts"][f"{kind} · {label}"] = r
                    log(
                        f"  {kind}: +{r['extra_us']:.0f} µs a step (named {r['named_us']:.0f} µs; "
                        f"plain step {r['plain_us']:.0f} µs; inspected {r['step_us']:.0f} µs)"
                    )
                result["ratios"][label] = ratios(model, plain_model, tokenizer, static, args.tokens, args.repeats, tmp)
                r = result["ratios"][label]
                log(
                    f"  ratios: watched/plain {r['watched_over_plain']['median']:.3f}, "
                    f"engine/bare {r['engine_over_bare']['median']:.3f}, watched/floor "
                    f"{r['watched_over_floor']['median']:.3f}; µs a token: plain {r['plain_us']['median']:.0f}, "
                    f"floor {r['floor_us']['median']:.0f}, watched {r['watched_us']['median']:.0f}"
                )
            except Exception as error:  # noqa: BLE001  one row failing must not lose the others
                result["ratios"][label] = {"error": f"{type(error).__name__}: {error}"}
                log(f"  FAILED: {type(error).__name__}: {error}")
            if args.json:  # after every row: a run cut short by a time limit keeps the rows it finished
                args.json.write_text(json.dumps(result, indent=1))
            write_markdown(result, command, args.md_dir)
            del model, plain_model
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    write_markdown(result, command, args.md_dir)
    print("\n".join(table(result)))
    failed = [label for label, r in result["ratios"].items() if "error" in r]
    for label, r in result["ratios"].items():
        if "error" in r:
            print(f"{label}: {r['error']}")
        else:
            print(
                f"{label}: watched/plain {r['watched_over_plain']['median']:.3f} "
                f"({r['watched_over_plain']['min']:.3f}–{r['watched_over_plain']['max']:.3f}); engine/bare "
                f"{r['engine_over_bare']['median']:.3f} ({r['engine_over_bare']['min']:.3f}–"
                f"{r['engine_over_bare']['max']:.3f}); floor/plain {r['floor_over_plain']['median']:.3f}; "
                f"watched/floor {r['watched_over_floor']['median']:.3f} ({r['watched_over_floor']['min']:.3f}–"
                f"{r['watched_over_floor']['max']:.3f}); kvtui adds "
                f"{r['watched_us']['median'] - r['plain_us']['median']:.0f} µs a token, the floor "
                f"{r['floor_us']['median'] - r['plain_us']['median']:.0f}"
            )
    if failed:  # every row ran and was written; the exit status says some failed
        raise SystemExit(f"b_step_cost_gpu: {len(failed)} row(s) failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
