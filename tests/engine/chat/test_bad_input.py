"""Bad input found by trying kvtui as a new user (issue 10): one clear line and exit 2, never a traceback;
control characters from users and models shown escaped, never interpreted by the terminal."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from plain_python import run_kvtui

from kvtui.engine.chat.script import ScriptError, load_script
from kvtui.fmt import one_line, positions, printable, size

ESC_TEXT = "clear\x1b[2Jred\x1b[31m bidi\u202eevil\x07bell"


def kvtui(*args, columns=80, timeout=300, preimported=False):
    """The CLI in a fresh Python; `preimported`: forked from one that imported torch and transformers once
    (tests/plain_python.py), where only what kvtui prints to stdout is checked (8 s of imports less a run)."""
    env = {**os.environ, "COLUMNS": str(columns), "OMP_NUM_THREADS": "1"}
    if preimported:
        return run_kvtui(*args, env=env, timeout=timeout)
    return subprocess.run(
        [sys.executable, "-m", "kvtui.cli", *map(str, args)], capture_output=True, text=True, timeout=timeout, env=env
    )


def test_printable_escapes_controls_and_bidi_but_keeps_text():
    shown = printable(ESC_TEXT)
    assert "\x1b" not in shown and "\u202e" not in shown and "\x07" not in shown
    assert "\\x1b[2J" in shown and "\\u202e" in shown and "\\x07" in shown
    assert printable("a\nb\tc", newlines=True) == "a\nb\tc" and printable("a\nb") == "a\\x0ab"
    assert printable("héllo 🙂 日本") == "héllo 🙂 日本"
    assert one_line("a  b\n c  " * 20, 10) == "a b c a b…" and len(one_line("x" * 50, 10)) == 10
    assert size(1536) == "1.5 KiB" and positions([3, 4, 5]) == "3..5" and positions([1, 3]) == "1 3"


def test_turns_as_a_string_is_refused(tmp_path):
    script = tmp_path / "s.json"
    script.write_text(json.dumps({"turns": "hello"}))
    with pytest.raises(ScriptError, match="'turns' must be a list"):
        load_script(script)
    run = kvtui("tiny:qwen2", "--headless", "--script", script)
    assert run.returncode == 2, run.stdout + run.stderr
    assert run.stderr.count("\n") == 1 and "'turns' must be a list" in run.stderr and '["hello"]' in run.stderr
    assert "Traceback" not in run.stderr


@pytest.mark.parametrize(
    "content, says",
    [
        ({"turns": ["hi"], "options": {"max_new_tokens": "ten"}}, "max_new_tokens"),
        ({"turns": ["hi"], "options": {"cache": "weird"}}, "cache"),
        ({"turns": ["hi"], "options": {"model": 5}}, "model"),
        ({"turns": ["hi"]}, "no theme named"),  # with --theme nope, before any screen
    ],
)
def test_bad_options_are_one_line_and_exit_2(tmp_path, content, says):
    script = tmp_path / "s.json"
    script.write_text(json.dumps(content))
    args = ["tiny:qwen2", "--script", script] + (["--theme", "nope"] if says == "no theme named" else ["--headless"])
    run = kvtui(*args)
    assert run.returncode == 2, run.stdout + run.stderr
    assert run.stderr.count("\n") == 1 and says in run.stderr and "Traceback" not in run.stderr


def test_a_broken_user_theme_names_itself(tmp_path):
    themes = tmp_path / "config" / "themes"
    themes.mkdir(parents=True)
    (themes / "mine.toml").write_text('name = "mine"\nprimary = "not-a-colour"\n')
    env = {**os.environ, "KVTUI_CONFIG_DIR": str(tmp_path / "config")}
    run = subprocess.run(
        [sys.executable, "-m", "kvtui.cli", "themes"], capture_output=True, text=True, env=env, timeout=120
    )
    assert run.returncode == 2 and "mine.toml" in run.stderr and run.stderr.count("\n") == 1


@pytest.fixture(scope="module")
def escaped_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("esc")
    script = tmp / "s.json"
    long = "Let's start by defining a variable k equal to 5 and then talk about it for a long while. " * 3
    script.write_text(json.dumps({"turns": [ESC_TEXT, long, "What is k?"], "options": {"max_new_tokens": 12}}))
    return script, tmp


@pytest.mark.version_free("kvtui's own summary text escaped: the chat under it is checked on both versions")
def test_headless_summary_escapes_and_is_one_line_per_turn(escaped_run):
    script, tmp = escaped_run
    run = kvtui("tiny:qwen2", "--headless", "--script", script, "--trace", tmp / "a.jsonl", preimported=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "\x1b" not in run.stdout and "\u202e" not in run.stdout and "\x07" not in run.stdout
    assert "\\x1b[2J" in run.stdout
    rows = [line for line in run.stdout.splitlines() if line.startswith("│") and line.split("│")[1].strip().isdigit()]
    assert [line.split("│")[1].strip() for line in rows] == ["1", "2", "3"], run.stdout  # one line per turn
    assert "…" in run.stdout
    verbose = kvtui("tiny:qwen2", "--headless", "--script", script, "--verbose", preimported=True)
    assert verbose.returncode == 0 and "\x1b" not in verbose.stdout
    assert len(verbose.stdout.splitlines()) > len(run.stdout.splitlines()) + 3  # replies whole, wrapped


@pytest.mark.version_free("kvtui diff's text escaped: the chat that wrote the traces runs on both versions elsewhere")
def test_diff_escapes_what_the_traces_hold(escaped_run):
    script, tmp = escaped_run
    a, b = tmp / "d1.jsonl", tmp / "d2.jsonl"
    for path, extra in ((a, []), (b, ["--system", "Be brief."])):
        assert (
            kvtui("tiny:qwen2", "--headless", "--script", script, "--trace", path, *extra, preimported=True).returncode
            == 0
        )
    header = json.loads(a.read_text().splitlines()[0])
    lines = a.read_text().splitlines()
    header["model"] = "evil\x1b[2J\u202emodel"
    a.write_text("\n".join([json.dumps(header), *lines[1:]]) + "\n")
    run = kvtui("diff", a, b, columns=120, preimported=True)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "\x1b" not in run.stdout and "\u202e" not in run.stdout and "\\x1b[2J" in run.stdout
