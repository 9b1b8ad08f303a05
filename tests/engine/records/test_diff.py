"""`kvtui diff`: the first step where two traces diverge, on real headless traces of a tiny qwen2."""

import copy
import json
import subprocess
import sys

import pytest
from click.testing import CliRunner
from plain_python import run_kvtui

from kvtui.commands.diff_cmd import diff as diff_command
from kvtui.engine.records.diff import diff_traces
from kvtui.engine.records.trace import read_trace

TURNS = ["What is k?", "And m?"]
OTHER_TURNS = ["What is k?", "And x equal to 7?"]  # the second turn differs


@pytest.fixture(scope="module")
def traces(tiny_dir, tiny_model, tmp_path_factory):
    """Headless runs of a tiny qwen2: name -> trace path. Four through the CLI (forked from a Python that imported
    torch and transformers once: tests/plain_python.py), and the different chat through the same runner in this
    process."""
    model = tiny_dir("qwen2")
    root = tmp_path_factory.mktemp("diff")
    same, other = root / "chat.json", root / "other.json"
    same.write_text(json.dumps({"turns": TURNS, "system": "You are terse."}))
    other.write_text(json.dumps({"turns": OTHER_TURNS, "system": "You are terse."}))
    runs = {
        "a": [],
        "a2": [],
        "static": ["--cache", "static", "--max-cache-len", "512"],
        "none": ["--cache", "none"],
    }
    paths = {"other": run_in_process(tiny_model, model, other, root / "other.jsonl")}
    for name, extra in runs.items():  # one after another, each forked from the pre-imported Python
        out = root / f"{name}.jsonl"
        args = [model, "--headless", "--script", same, "--trace", out, "--max-new-tokens", "5", *extra]
        run = run_kvtui(*args, timeout=300)
        assert run.returncode == 0, run.stdout + run.stderr
        paths[name] = out
    return paths


def run_in_process(tiny_model, model_dir, script_path, trace_path):
    """What `kvtui MODEL --headless --script S --trace T --max-new-tokens 5` does, without a new interpreter."""
    import io

    from rich.console import Console

    from kvtui.engine import ChatSession
    from kvtui.engine.chat.script import load_script
    from kvtui.headless import run_script
    from kvtui.options import DEFAULT_OPTIONS, build_session_config

    model, tokenizer = tiny_model("qwen2")
    script = load_script(script_path)
    options = {**DEFAULT_OPTIONS, "max_new_tokens": 5, "system": script.system, "mode": script.mode}
    session = ChatSession(model, tokenizer, build_session_config(options, tokenizer))
    code = run_script(
        session,
        script,
        trace_path=trace_path,
        model_source=str(model_dir),
        model_path=str(model_dir),
        console=Console(file=io.StringIO()),
    )
    assert code == 0
    return trace_path


def run_diff(*args, columns: int = 80):
    result = CliRunner().invoke(diff_command, [str(a) for a in args], env={"COLUMNS": str(columns)})
    return result.exit_code, result.stdout, result.stderr


def flat(text: str) -> str:
    return " ".join(text.split())


def test_the_same_script_twice_agrees(traces):
    a, b = read_trace(traces["a"]), read_trace(traces["a2"])
    result = diff_traces(a, b)
    assert result.agree and result.step is None and result.field is None
    assert result.steps_compared == len(a.steps) == len(b.steps) > 2
    assert result.logit_gap == 0.0
    code, out, err = run_diff(traces["a"], traces["a2"])
    assert code == 0, out + err
    assert "agree" in out and f"all {len(a.steps)} steps" in flat(out)


def test_dynamic_and_static_caches_agree_and_the_cache_kind_is_a_note(traces):
    a, s = read_trace(traces["a"]), read_trace(traces["static"])
    # greedy fp32: the same tokens fed and chosen, logits equal up to float noise
    assert [x["input_ids"] for x in a.steps] == [x["input_ids"] for x in s.steps]
    assert [x["chosen"]["id"] for x in a.steps] == [x["chosen"]["id"] for x in s.steps]
    assert {layer["kind"] for x in s.steps for layer in x["layers"]} == {"static"}
    result = diff_traces(a, s)
    assert result.agree, result.detail
    assert result.steps_compared == len(a.steps)
    assert result.logit_gap is not None and result.logit_gap <= 1e-4
    notes = "\n".join(result.notes)
    assert "header cache: A 'dynamic', B 'static'" in notes
    assert "header capacity: A None, B 512" in notes
    assert "full in A, static in B" in notes  # layer kind and preallocated slots
    code, out, _ = run_diff(traces["a"], traces["static"])
    assert code == 0 and "static" in out and "agree" in out


def test_a_different_second_turn_diverges_at_its_prefill(traces):
    a, other = read_trace(traces["a"]), read_trace(traces["other"])
    turn2 = next(x["step"] for x in a.steps if x["turn"] == 2)
    assert a.steps[turn2 - 1]["phase"] == "prefill"
    result = diff_traces(a, other)
    assert not result.agree
    assert result.step == turn2 and result.field == "input_ids"
    assert result.steps_compared == turn2 - 1
    assert result.logit_gap is not None and all(v is not None for v in result.chosen_logits)
    assert "first difference at index" in result.detail
    code, out, _ = run_diff(traces["a"], traces["other"])
    assert code == 1
    assert f"diverge at step {turn2}" in flat(out) and "input_ids" in out


def test_a_trace_cut_mid_line_by_a_crash_is_read_as_replay_reads_it(traces, tmp_path):
    lines = traces["a"].read_text().splitlines(keepends=True)
    assert [json.loads(line)["type"] for line in lines[:4]] == ["header"] + ["step"] * 3
    cut = tmp_path / "cut.jsonl"
    cut.write_text("".join(lines[:4]) + lines[4][: len(lines[4]) // 2])  # a crash in the middle of line 5
    replayed = read_trace(cut)  # what `kvtui replay` reads
    assert replayed.truncated and [s["step"] for s in replayed.steps] == [1, 2, 3]
    result = diff_traces(read_trace(traces["a"]), replayed)
    assert not result.agree and result.field == "steps" and result.step == 4 and result.steps_compared == 3
    assert "trace B ends at step 3 (a crash cut its next line short)" in result.detail
    assert "trace B was cut short by a crash (line 5 unfinished, dropped as replay drops it): it ends at step 3" in (
        result.notes
    )
    code, out, err = run_diff(traces["a"], cut)
    assert code == 1, out + err
    assert "cut short by a crash (line 5 unfinished" in flat(out) and "trace B ends at step 3" in flat(out)
    # the same trace against itself cut: the steps both hold agree, and the cut one says where it ends
    code, out, _ = run_diff(cut, cut)
    assert code == 0 and "it ends at step 3" in flat(out)
    code, _, err = run_diff(tmp_path / "missing.jsonl", traces["a"])
    assert code == 2 and "no such trace file" in err


def test_no_cache_and_a_dynamic_cache_decide_the_same_and_the_strategy_is_a_note(traces):
    """--cache none holds no cache at all; the decisions (tokens, positions, chosen, top-k) must agree with a
    dynamic cache's, and the difference of caches is a note: exit 0."""
    n, d = read_trace(traces["none"]), read_trace(traces["a"])
    # the independent truth: what each run fed and chose, read straight from the records
    assert [s["cache_seq_length"] for s in n.steps][0] != [s["cache_seq_length"] for s in d.steps][0]
    assert [(s["input_ids"], s["positions"], s["chosen"]["id"]) for s in n.steps] == [
        (s["input_ids"], s["positions"], s["chosen"]["id"]) for s in d.steps
    ]
    result = diff_traces(n, d)
    assert result.agree, result.detail
    assert result.steps_compared == len(d.steps)
    assert any(note.startswith("cache strategy differs: none in A, dynamic in B") for note in result.notes)
    code, out, _ = run_diff(traces["none"], traces["a"])
    assert code == 0 and "cache strategy differs" in flat(out) and "agree" in out


def test_the_cache_fill_still_diverges_between_traces_of_one_strategy(traces):
    a = read_trace(traces["a"])
    b = copy.deepcopy(a)
    b.steps[2]["cache_seq_length"] += 1
    result = diff_traces(a, b)
    assert not result.agree and result.field == "cache_seq_length" and result.step == a.steps[2]["step"]


def test_the_chosen_token_is_shown_with_its_raw_logit_beside_the_raw_topk(traces, tmp_path):
    """A sampler's processors (here a temperature of 0.5) change the logits the chosen token was picked by;
    the report shows raw logits in both the chosen row and the top-k, and names the processed one."""
    trace = read_trace(traces["a"])
    a = copy.deepcopy(trace)
    for step in a.steps:
        step["topk_processed"] = [{**t, "logit": t["logit"] / 0.5} for t in step["topk"]]
        step["chosen"] = {**step["chosen"], "logit": step["chosen"]["logit"] / 0.5}
    b = copy.deepcopy(a)
    at = 3
    top = b.steps[at]["topk"]
    b.steps[at]["chosen"] = {**top[1], "logit": top[1]["logit"] / 0.5, "forced": False}  # B chose rank 2
    result = diff_traces(a, b)
    assert result.field == "chosen" and result.step == a.steps[at]["step"]
    raw_a, raw_b = a.steps[at]["topk"][0]["logit"], top[1]["logit"]
    assert result.chosen_logits == (raw_a, raw_b)
    assert result.chosen_processed == (raw_a / 0.5, raw_b / 0.5)
    pa, pb = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    for path, t in ((pa, a), (pb, b)):
        path.write_text("".join(json.dumps(r) + "\n" for r in [t.header, *t.steps]))
    code, out, _ = run_diff(pa, pb, columns=240)  # wide: each table cell on one line
    assert code == 1
    text = flat(out)
    assert f"chosen token's raw logit: A {raw_a:.6g}, B {raw_b:.6g}" in text
    assert f"after the sampler's processors: A {raw_a / 0.5:.6g}, B {raw_b / 0.5:.6g}" in text
    assert f"id {top[1]['id']} logit {raw_b:.6g} (processed {raw_b / 0.5:.6g})" in text  # B's chosen row
    assert "top-k (raw)" in text and "top-k (processed)" in text


def test_a_trace_cut_at_a_line_ends_early(traces, tmp_path):
    a = read_trace(traces["a"])
    lines = traces["a"].read_text().splitlines(keepends=True)
    assert [json.loads(line)["type"] for line in lines[:5]] == ["header"] + ["step"] * 4
    cut = tmp_path / "cut.jsonl"
    cut.write_text("".join(lines[:5]))  # header + 4 steps: a run killed between two steps
    result = diff_traces(a, read_trace(cut))
    assert not result.agree and result.field == "steps" and result.step == 5
    assert "trace B ends at step 4" in result.detail and result.steps_compared == 4
    swapped = diff_traces(read_trace(cut), a)
    assert "trace A ends at step 4" in swapped.detail
    code, out, _ = run_diff(traces["a"], cut)
    assert code == 1 and "trace B ends at step 4" in flat(out)


def _with_swapped_ranks(trace, step_index: int, gap: float):
    """Traces A', B' equal to `trace` but for one step's top-k ranks 2 and 3: B' lists them the other
    way round; both give the two tokens logits `gap` apart (the chosen token, rank 1, stays)."""
    a, b = copy.deepcopy(trace), copy.deepcopy(trace)
    for t in (a, b):
        top = t.steps[step_index]["topk"]
        top[1]["logit"] = top[0]["logit"] - 0.1
        top[2]["logit"] = top[1]["logit"] - gap
    top = b.steps[step_index]["topk"]
    top[1]["id"], top[2]["id"] = top[2]["id"], top[1]["id"]
    return a, b


@pytest.mark.parametrize("gap,agree", [(1e-5, True), (0.5, False)])
def test_swapped_near_ties_are_not_a_divergence(traces, tmp_path, gap, agree):
    trace = read_trace(traces["a"])
    a, b = _with_swapped_ranks(trace, 3, gap)
    result = diff_traces(a, b, tie_tolerance=1e-3)
    assert result.agree is agree, result.detail
    if not agree:
        assert result.step == trace.steps[3]["step"] and result.field == "topk"
        assert "rank 2" in result.detail and "0.5 apart" in result.detail
        # the same through the command, from files
        pa, pb = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
        for path, t in ((pa, a), (pb, b)):
            path.write_text("".join(json.dumps(r) + "\n" for r in [t.header, *t.steps]))
        code, out, _ = run_diff(pa, pb)
        assert code == 1 and "topk" in out
        # a tolerance wider than the gap makes it a tie
        code, _, _ = run_diff(pa, pb, "--tie-tolerance", "0.6")
        assert code == 0


def test_topk_tie_at_the_cut_off_and_a_chain_of_ties():
    from kvtui.engine.records.diff import _compare_topk

    def top(pairs):
        return [{"id": i, "logit": v} for i, v in pairs]

    # token 4 and token 5 tie for the last place: each list keeps a different one
    assert (
        _compare_topk(top([(1, 3.0), (2, 2.0), (4, 1.0)]), top([(1, 3.0), (2, 2.0), (5, 1.0000001)]), 1e-3, {}) is None
    )
    assert _compare_topk(top([(1, 3.0), (2, 2.0), (4, 1.0)]), top([(1, 3.0), (2, 2.0), (5, 0.5)]), 1e-3, {}) is not None
    # three tokens tied: any order of them is the same ranking
    a = top([(1, 3.0), (2, 2.0), (3, 2.0), (4, 2.0)])
    b = top([(1, 3.0), (4, 2.0), (3, 2.0), (2, 2.0)])
    assert _compare_topk(a, b, 1e-3, {}) is None
    c = top([(1, 3.0), (4, 2.0), (2, 2.0), (3, 1.0)])
    d = top([(1, 3.0), (3, 1.0), (4, 2.0), (2, 2.0)])
    assert _compare_topk(c, d, 1e-3, {}) is not None


def test_diff_is_wired_into_the_kvtui_command(traces):
    from kvtui.cli import main

    assert "diff" in main.commands
    result = CliRunner().invoke(main, ["diff", str(traces["a"]), str(traces["other"])])
    assert result.exit_code == 1 and "input_ids" in result.stdout


def test_the_diff_and_export_engines_import_no_ui_libraries():
    code = (
        "import sys, kvtui.engine.records.diff, kvtui.engine.reading.export\n"
        "print(','.join(sorted(m for m in sys.modules if m.split('.')[0] in ('textual', 'rich'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_attention_that_looks_elsewhere_is_a_note(tmp_path):
    """Two traces with --attention: where the newest token looked differs from a step on: said as a note
    (attention rows differ in the last bits between implementations, so never a divergence)."""

    def trace(name, layers_per_step):
        path = tmp_path / name
        lines = [{"type": "header", "schema": 1}]
        for step, layers in enumerate(layers_per_step, 1):
            lines.append(
                {
                    "type": "step",
                    "step": step,
                    "input_ids": [step],
                    "positions": [step],
                    "fed": [],
                    "cursor": step + 1,
                    "cache_seq_length": step + 1,
                    "layers": [],
                    "topk": [],
                    "attention": {"layers": layers},
                }
            )
        path.write_text("".join(json.dumps(line) + "\n" for line in lines))
        return read_trace(path)

    same = [[[0, 0.7], [1, 0.3]], None]
    a = trace("a.jsonl", [[[[0, 0.6]], None], [same[0], None]])
    b = trace("b.jsonl", [[[[0, 0.6]], None], [[[1, 0.55], [0, 0.45]], None]])
    result = diff_traces(a, b)
    assert result.agree
    assert "attention: from step 2, layer 0 looks most at #0 (70%) in A, #1 (55%) in B" in result.notes
    assert not [n for n in diff_traces(a, a).notes if n.startswith("attention")]
