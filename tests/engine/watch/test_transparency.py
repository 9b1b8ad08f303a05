"""Transparency: a program watched by kvtui prints, computes and exits exactly as without it.

Two halves:
- every program in samples/programs and tests/watch_corpus, run plain (`python PROG MODEL_DIR`) and
  under `python -m kvtui.cli watch --headless PROG MODEL_DIR`: identical stdout, identical exit code
  (stderr may differ: kvtui writes its report there);
- in-process, on tiny models: a watched cache or model copied (copy, deepcopy, pickle, torch.save)
  carries nothing of kvtui, a copy is edited independently of its original, and detach() leaves every
  class and instance it touched exactly as it found them.
"""

from __future__ import annotations

import copy
import gc
import io
import json
import pickle
import re
import subprocess
import sys
import threading
import weakref
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache, GenerationMixin, PreTrainedModel, StaticCache
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from kvtui.engine.reading.diagnostics import CODES
from kvtui.engine.watch.probe import watch
from program_headers import codes_in, expected_codes, expected_exit, header, model_dir, stdin_of

ROOT = Path(__file__).resolve().parents[3]
CORPUS = ROOT / "tests" / "watch_corpus"
PROGRAMS = sorted((ROOT / "samples" / "programs").glob("*.py")) + sorted(CORPUS.glob("*.py"))
FAIL_ON_LINE = re.compile(r"^\d+ alarm\(s\) at or above error$", re.M)


# ---- the corpus itself ---------------------------------------------------------------------------------


def test_corpus_programs_name_their_model_and_alarms():
    corpus = sorted(CORPUS.glob("*.py"))
    assert len(corpus) >= 20
    for program in corpus:
        assert not program.name.startswith("test_"), program
        assert header(program, "kvtui-model").startswith(("tiny:", "embedded")), program
        for key in ("kvtui-expects", "kvtui-expects-if-cache-position-drives-positions"):
            expects = header(program, key, "nothing")
            codes = [] if expects == "nothing" else [c.strip() for c in expects.split(",")]
            assert set(codes) <= set(CODES), (program, codes)


def test_pytest_collects_no_corpus_program():
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", str(CORPUS)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert result.returncode == 5, result.stdout[-2000:] + result.stderr[-2000:]  # 5: no tests collected
    assert "no tests collected" in result.stdout


# ---- plain vs watched, through the real CLI ----------------------------------------------------------


@pytest.mark.parametrize("program", PROGRAMS, ids=[f"{p.parent.name}/{p.stem}" for p in PROGRAMS])
def test_watched_program_prints_and_exits_as_plain(program, tmp_path, plain_python):
    """...and raises exactly the alarms its header names, read from the trace of the same watched run (one
    watched run serves both checks: the suite starts each program twice, not three times).

    Both runs fork from a Python that imported torch and transformers once (tests/plain_python.py: 8 s of CPU
    a start here), except the samples' watched runs: those stay real `python -m kvtui.cli watch` processes, so
    the interpreter's own start and end under kvtui are tested here too (and in test_watch_programs, test_tree)."""
    directory = str(model_dir(header(program, "kvtui-model")))
    trace = tmp_path / "run.jsonl"
    stdin = stdin_of(program) or ""  # an interactive program gets the same lines in both runs (else EOF)
    watch = ["kvtui.cli", "watch", "--headless", "--trace", str(trace), str(program), directory]
    plain_run = plain_python.start([str(program), directory], cwd=ROOT, stdin=stdin)
    if program.parent == CORPUS:
        watched = plain_python.run(watch, cwd=ROOT, stdin=stdin, module=True)
        watched_out, watched_err = watched.stdout, watched.stderr
    else:
        process = subprocess.Popen(
            [sys.executable, "-m", *watch], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, cwd=ROOT,
        )  # fmt: skip
        watched_out, watched_err = process.communicate(stdin, timeout=600)
        watched = process
    plain = plain_run.wait()
    plain_out, plain_err = plain.stdout, plain.stderr
    if program.stem != "static_overflow":  # the one sample that dies by design (IndexError)
        # 0, or what the program's header says it exits with on this transformers (a feature-tested header)
        assert plain.returncode == expected_exit(program), plain_err[-2000:]
    assert plain_out.strip(), "the program must print its token ids and cache lengths"
    assert watched_out == plain_out, watched_err[-3000:]
    seen = re.search(r"program exit code (-?\d+)", watched_err)
    assert seen and int(seen.group(1)) == plain.returncode, watched_err[-3000:]
    # The process exit code is the program's, except for `--fail-on error` (the default), which
    # documents exit 1 when an error-level alarm fired and says so on its own line.
    if FAIL_ON_LINE.search(watched_err) and plain.returncode == 0:
        assert watched.returncode == 1, watched_err[-3000:]
    else:
        assert watched.returncode == plain.returncode, watched_err[-3000:]
    # exactly the alarms its header names on this transformers, read from the trace of this same watched run
    # (a program that ends before its first forward leaves no trace: no alarm, which its header must say)
    found = codes_in(trace) if trace.exists() else set()
    assert found == expected_codes(program), watched_err[-3000:]
    if program.parent == CORPUS:
        return
    # the samples: every forward is recorded as the watched program's, and every alarm names its line
    assert "Traceback" not in watched_err or program.stem == "static_overflow", watched_err[-2000:]
    steps = [r for r in map(json.loads, trace.read_text().splitlines()) if r["type"] == "step"]
    assert steps and all(s["source"] == "watch" and s["caller"].startswith("samples/programs/") for s in steps)
    errors = [line for line in watched_err.splitlines() if re.match(r"\s*error step", line)]
    if program.stem == "static_overflow":  # the program itself dies with the IndexError kvtui announced
        assert "IndexError: index_copy_()" in watched_err and watched.returncode == 1
    else:
        assert watched.returncode == (1 if errors else 0), watched_err[-2000:]
    for line in watched_err.splitlines():
        if re.match(r"\s*(info|warning|error) step", line):
            assert f"samples/programs/{program.name}:" in line, line


# ---- in-process: copies of watched objects -----------------------------------------------------------

HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_load_state_dict_pre_hooks",
)


def _from_kvtui(value) -> bool:
    modules = [type(value).__module__ or ""]
    try:
        modules.append(getattr(value, "__module__", "") or "")
    except Exception:  # noqa: BLE001  an object whose __module__ raises: its type's module is enough
        pass
    owner = getattr(value, "__self__", None)  # a bound method: whose object is it bound to?
    if owner is not None:
        modules.append(type(owner).__module__ or "")
    return any(isinstance(m, str) and m.startswith("kvtui") for m in modules)


def kvtui_refs(obj) -> list[str]:
    """Where kvtui left something on `obj`, walked shallowly: its instance __dict__, its cache layers'
    __dict__s, and for a module every submodule's __dict__ and hook dicts."""
    found = []

    def scan(where: str, mapping) -> None:
        for key, value in list(mapping.items()):
            if _from_kvtui(key) or _from_kvtui(value):
                found.append(f"{where}[{key!r}] = {value!r}")

    if isinstance(obj, torch.nn.Module):
        for name, module in obj.named_modules():
            scan(f"{name or 'model'}.__dict__", vars(module))
            for hooks in HOOK_DICTS:
                scan(f"{name or 'model'}.{hooks}", getattr(module, hooks, None) or {})
    else:
        scan("__dict__", vars(obj))
        for i, layer in enumerate(getattr(obj, "layers", None) or []):
            scan(f"layers[{i}].__dict__", vars(layer))
    return found


def _hook_counts(model) -> dict[str, int]:
    return {
        f"{name}.{hooks}": len(getattr(module, hooks, None) or {})
        for name, module in model.named_modules()
        for hooks in HOOK_DICTS
    }


def _prefill(model, tokenizer, text="Once upon a time, a small cat lived in a quiet house.", cache=None):
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    cache = DynamicCache() if cache is None else cache
    with torch.no_grad():
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
    return ids, cache, out


def _copy(kind: str, obj):
    if kind == "copy":
        return copy.copy(obj)
    if kind == "deepcopy":
        return copy.deepcopy(obj)
    if kind == "pickle":
        return pickle.loads(pickle.dumps(obj))
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.fixture
def qwen2(tiny_model):
    model, tokenizer = tiny_model("qwen2")
    before = _hook_counts(model)
    yield model, tokenizer
    assert _hook_counts(model) == before  # a failing test must not leave hooks on the shared model


def test_deepcopy_then_crop_shortens_only_the_copy(qwen2):
    model, tokenizer = qwen2
    _, plain, _ = _prefill(model, tokenizer)
    plain_copy = copy.deepcopy(plain)
    plain_copy.crop(-2)
    with watch(model, tokenizer):
        _, cache, _ = _prefill(model, tokenizer)
        length = int(cache.get_seq_length())
        branch = copy.deepcopy(cache)
        branch.crop(-2)
        assert int(branch.get_seq_length()) == length - 2
        assert int(cache.get_seq_length()) == length, "crop on the deepcopy shortened the original"
    assert (int(cache.get_seq_length()), int(branch.get_seq_length())) == (
        int(plain.get_seq_length()),
        int(plain_copy.get_seq_length()),
    )


def test_deepcopy_of_a_watched_cache_has_the_keys_of_an_unwatched_one(qwen2):
    model, tokenizer = qwen2
    _, plain, _ = _prefill(model, tokenizer)
    with watch(model, tokenizer):
        _, cache, _ = _prefill(model, tokenizer)
        watched_copy = copy.deepcopy(cache)
    plain_copy = copy.deepcopy(plain)
    assert sorted(vars(watched_copy)) == sorted(vars(plain_copy))
    assert [sorted(vars(layer)) for layer in watched_copy.layers] == [
        sorted(vars(layer)) for layer in plain_copy.layers
    ]


@pytest.mark.parametrize("kind", ["copy", "deepcopy", "pickle", "torch.save"])
def test_a_copied_watched_cache_carries_nothing_of_kvtui(qwen2, kind):
    model, tokenizer = qwen2
    with watch(model, tokenizer):
        _, cache, _ = _prefill(model, tokenizer)
        copied = _copy(kind, cache)
        assert kvtui_refs(copied) == []
        assert int(copied.get_seq_length()) == int(cache.get_seq_length())
    assert kvtui_refs(copied) == [] and kvtui_refs(cache) == []


@pytest.mark.parametrize("kind", ["deepcopy", "pickle", "torch.save"])
def test_a_copied_watched_model_carries_nothing_of_kvtui(qwen2, kind):
    model, tokenizer = qwen2
    ids = tokenizer("What is the capital of France?", return_tensors="pt")["input_ids"]
    expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    with watch(model, tokenizer) as watcher:
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False)
        copied = _copy(kind, model)
        assert kvtui_refs(copied) == []
        steps = watcher.steps
        out = copied.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
        assert watcher.steps == steps, "the copy's forwards reached the watcher of the original"
    assert torch.equal(out, expected)


def test_a_watched_model_the_program_lets_go_of_is_freed(qwen2):
    """Watching holds no model alive: a program that drops its model (to load the next checkpoint) gets
    its memory back, as it would unwatched; a verify after that says why it cannot run."""
    _, tokenizer = qwen2
    model = copy.deepcopy(qwen2[0])  # a model only this test holds
    with watch(model, tokenizer) as watcher:
        _, cache, out = _prefill(model, tokenizer)
        model_ref, cache_ref = weakref.ref(model), weakref.ref(cache)
        del model, cache, out
        gc.collect()
        assert model_ref() is None and cache_ref() is None
        with pytest.raises(ValueError, match="let go of its model"):
            watcher.verify()
        assert watcher.header()["model_class"] == "Qwen2ForCausalLM"  # what it was is still known


def test_a_copy_made_while_attached_behaves_after_detach_like_an_unwatched_copy(qwen2):
    model, tokenizer = qwen2

    def branch_and_continue(cache):
        branch = copy.deepcopy(cache)
        branch.crop(-2)
        with torch.no_grad():
            out = model(input_ids=torch.tensor([[17, 23]]), past_key_values=branch, use_cache=True)
        branch.crop(-1)
        return out.logits, int(branch.get_seq_length()), int(cache.get_seq_length())

    _, plain, _ = _prefill(model, tokenizer)
    plain_copy = copy.deepcopy(plain)
    expected = branch_and_continue(plain_copy)
    with watch(model, tokenizer):
        _, cache, _ = _prefill(model, tokenizer)
        made_while_attached = copy.deepcopy(cache)
    got = branch_and_continue(made_while_attached)
    assert got[1:] == expected[1:]
    assert torch.equal(got[0], expected[0])
    assert sorted(vars(made_while_attached)) == sorted(vars(plain_copy))


# ---- in-process: detach restores everything ---------------------------------------------------------


def _class_state(classes) -> dict[type, dict]:
    return {cls: dict(cls.__dict__) for cls in classes}


def _changed(before: dict[type, dict]) -> list[str]:
    changes = []
    for cls, old in before.items():
        now = dict(cls.__dict__)
        for key in sorted(set(old) | set(now), key=str):
            if key not in now:
                changes.append(f"{cls.__name__}.{key} removed")
            elif key not in old:
                changes.append(f"{cls.__name__}.{key} added")
            elif now[key] is not old[key]:
                changes.append(f"{cls.__name__}.{key} replaced")
    return changes


def _touched_classes(model, tokenizer, caches) -> list[type]:
    from transformers.cache_utils import Cache

    classes = {
        type(model),
        PreTrainedModel,
        GenerationMixin,
        PreTrainedTokenizerBase,
        type(tokenizer),
        threading.Thread,
        Cache,
        DynamicCache,
        StaticCache,
    }
    classes |= {type(m) for m in model.modules() if "Rotary" in type(m).__name__}
    for cache in caches:
        classes |= set(type(cache).__mro__) - {object}
        classes |= {type(layer) for layer in cache.layers}
        classes |= set().union(*(set(type(layer).__mro__) - {object} for layer in cache.layers))
    return sorted(classes, key=lambda c: (c.__module__, c.__qualname__))


def _exercise(model, tokenizer, cache):
    """What programs do under watch: tokenizer calls, a forward, a crop, generate() in a thread."""
    ids = tokenizer("What is 12 plus 30?", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache, use_cache=True)
    cache.crop(-1)
    full = ids
    results = []
    thread = threading.Thread(
        target=lambda: results.append(
            model.generate(
                full, attention_mask=torch.ones_like(full), past_key_values=cache, max_new_tokens=3, do_sample=False
            )
        )
    )
    thread.start()
    thread.join()
    tokenizer.encode("k multiplied by 3")
    return results[0]


def test_detach_leaves_classes_hooks_and_instances_as_they_were(qwen2):
    model, tokenizer = qwen2
    probe_cache = DynamicCache()
    _prefill(model, tokenizer, cache=probe_cache)  # layer classes exist only once a cache is filled
    static = StaticCache(config=model.config, max_cache_len=32)
    _prefill(model, tokenizer, cache=static)
    classes = _touched_classes(model, tokenizer, [probe_cache, static])
    before = _class_state(classes)
    hooks = _hook_counts(model)
    plain_cache = DynamicCache()
    plain_out = _exercise(model, tokenizer, plain_cache)  # generate() itself adds keys to a passed cache
    model_keys, tokenizer_keys, cache_keys = sorted(vars(model)), sorted(vars(tokenizer)), sorted(vars(plain_cache))
    cache = DynamicCache()

    watcher = watch(model, tokenizer)
    try:
        watched_out = _exercise(model, tokenizer, cache)
        _prefill(model, tokenizer, cache=StaticCache(config=model.config, max_cache_len=32))
    finally:
        watcher.detach()
    assert watcher.steps > 0
    assert _changed(before) == []
    assert _hook_counts(model) == hooks
    assert sorted(vars(model)) == model_keys
    assert sorted(vars(tokenizer)) == tokenizer_keys
    assert sorted(vars(cache)) == cache_keys
    assert kvtui_refs(model) == [] and kvtui_refs(cache) == []
    assert torch.equal(watched_out, plain_out)


def test_run_watched_leaves_classes_as_they_were(tiny_dir, tmp_path):
    """`kvtui watch` in-process: AutoAttach patches model construction and tokenizer loading; after the
    program every class is back and the models it built carry no hook."""
    from kvtui.engine.watch.probe import Watcher, run_watched

    directory = tiny_dir("qwen2")
    script = tmp_path / "prog.py"
    script.write_text(
        "import copy, sys, torch\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache\n"
        "tok = AutoTokenizer.from_pretrained(sys.argv[1])\n"
        "model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)\n"
        "cache = DynamicCache()\n"
        "out = model.generate(**tok('What is k?', return_tensors='pt'), past_key_values=cache, max_new_tokens=3,"
        " do_sample=False)\n"
        "c2 = copy.deepcopy(cache); c2.crop(-2)\n"
        "KEEP.append((model, tok, cache, c2))\n"
    )
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32)
    filled = DynamicCache()
    _prefill(model, tokenizer, cache=filled)
    # The program deep-copies a cache, and Python's copyreg then caches `__slotnames__` on each class copied,
    # watched or not; copy once first so that the comparison sees only what kvtui would leave.
    copy.deepcopy(filled)
    classes = _touched_classes(model, tokenizer, [filled])
    before = _class_state(classes)
    import builtins

    builtins.KEEP = []
    try:
        watcher = Watcher()
        code, models = run_watched(watcher, str(script), [str(directory)])
        kept = builtins.KEEP
    finally:
        del builtins.KEEP
    assert code == 0 and len(models) == 1 and watcher.steps > 0
    assert _changed(before) == []
    built, _, cache, branch = kept[0]
    assert kvtui_refs(built) == [] and kvtui_refs(cache) == [] and kvtui_refs(branch) == []
    assert int(cache.get_seq_length()) - int(branch.get_seq_length()) == 2


# ---- in-process: same ids, bit for bit ----------------------------------------------------------------


def _reuse_prompt_cache(model, tokenizer):
    prefix = "You are a helpful assistant."
    _, prompt_cache, _ = _prefill(model, tokenizer, prefix)
    results = []
    for prompt in [" What is k?", " Please tell me a short story about a cat."]:
        inputs = tokenizer(prefix + prompt, return_tensors="pt")
        cache = copy.deepcopy(prompt_cache)
        out = model.generate(
            **inputs,
            past_key_values=cache,
            max_new_tokens=6,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
        results.append((out.sequences.tolist(), [logits.clone() for logits in out.logits], int(cache.get_seq_length())))
    return results, int(prompt_cache.get_seq_length())


def _crop_and_continue(model, tokenizer):
    ids, cache, out = _prefill(model, tokenizer, "Count from 0 to 9: 0, 1, 2, 3,")
    tokens, logits, lengths = [], [], []
    with torch.no_grad():
        for _ in range(6):
            token = int(out.logits[0, -1].argmax())
            tokens.append(token)
            guess = torch.tensor([[token, token, token]])  # feed two guesses, keep none of them
            out = model(input_ids=guess, past_key_values=cache, use_cache=True)
            cache.crop(-2)
            branch = copy.deepcopy(cache)
            branch.crop(-1)
            lengths.append((int(cache.get_seq_length()), int(branch.get_seq_length())))
            logits.append(out.logits[:, :1].clone())
            out = type(out)(logits=out.logits[:, :1])
    return tokens, logits, lengths


@pytest.mark.parametrize(
    "run", [_reuse_prompt_cache, _crop_and_continue], ids=["generate-deepcopied-prompt-cache", "crop-and-continue"]
)
def test_same_ids_with_and_without_watching(qwen2, run):
    model, tokenizer = qwen2
    expected = run(model, tokenizer)
    with watch(model, tokenizer) as watcher:
        got = run(model, tokenizer)
    assert watcher.steps > 0
    assert repr(_plain(got)) == repr(_plain(expected))
    for a, b in zip(_tensors(got), _tensors(expected)):
        assert torch.equal(a, b)


def _plain(value):
    if isinstance(value, torch.Tensor):
        return "tensor"
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)
