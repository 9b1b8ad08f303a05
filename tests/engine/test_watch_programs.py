"""`kvtui watch --headless` on the sample programs, through the real CLI: each raises exactly the
alarms its docstring names (`kvtui-expects:`), a correct loop raises none, and the trace records it."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROGRAMS = sorted((ROOT / "samples" / "programs").glob("*.py"))


def header(path: Path, key: str) -> str:
    return re.search(rf"^{key}: (.+)$", path.read_text(), re.M).group(1).strip()


def model_dir(spec: str) -> Path:
    from kvtui.engine.loader import embedded_model_dir, tiny_model_dir

    return embedded_model_dir() if spec == "embedded" else tiny_model_dir(spec)


def watch(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "kvtui.cli", "watch", *map(str, args)], capture_output=True,
                          text=True, timeout=600, cwd=cwd)


def codes_in(trace: Path) -> set[str]:
    codes = set()
    for line in trace.read_text().splitlines():
        record = json.loads(line)
        if record["type"] == "step":
            codes.update(d["code"] for d in record["diagnostics"])
        elif record["type"] == "diagnostic":
            codes.add(record["code"])
    return codes


def test_every_program_names_its_model_and_alarms():
    assert len(PROGRAMS) >= 5
    for program in PROGRAMS:
        assert header(program, "kvtui-model") and header(program, "kvtui-expects")


@pytest.mark.parametrize("program", PROGRAMS, ids=[p.stem for p in PROGRAMS])
def test_program_raises_exactly_its_alarms(program, tmp_path):
    expected = header(program, "kvtui-expects")
    expected = set() if expected == "nothing" else {c.strip() for c in expected.split(",")}
    trace = tmp_path / "run.jsonl"
    result = watch("--headless", "--trace", trace, "--fail-on", "error", program, model_dir(header(program, "kvtui-model")))
    assert "Traceback" not in result.stderr or program.stem == "static_overflow", result.stderr[-2000:]
    found = codes_in(trace)
    assert found == expected, (found, result.stderr[-3000:])
    steps = [json.loads(line) for line in trace.read_text().splitlines() if '"type": "step"' in line]
    assert steps and all(s["source"] == "watch" and s["caller"].startswith("samples/programs/") for s in steps)
    errors = [line for line in result.stderr.splitlines() if re.match(r"\s*error step", line)]
    if program.stem == "static_overflow":  # the program itself dies with the IndexError kvtui announced
        assert "IndexError: index_copy_()" in result.stderr and result.returncode == 1
    else:
        assert result.returncode == (1 if errors else 0), result.stderr[-2000:]
    for line in result.stderr.splitlines():  # every alarm names the line of the program that made the call
        if re.match(r"\s*(info|warning|error) step", line):
            assert f"samples/programs/{program.name}:" in line, line


def test_program_output_passes_through_and_exit_code_is_kept(tmp_path):
    script = tmp_path / "plain.py"
    script.write_text("import sys\nprint('hello from the program')\nsys.exit(3)\n")
    result = watch("--headless", script)
    assert result.stdout == "hello from the program\n"
    assert result.returncode == 3
    assert "0 forwards watched" in result.stderr and "models: none" in result.stderr


@pytest.mark.parametrize("args,hint", [(["--headless", "no-such-file.py"], "SCRIPT"),
                                       (["--headless", "-m", "no_such_module_xyz"], "-m"),
                                       (["--headless", "--trace", "/no/such/dir/t.jsonl", __file__], "--trace")])
def test_bad_input_is_one_line_and_exit_2(args, hint):
    result = watch(*args)
    assert result.returncode == 2
    assert hint in result.stderr and "Traceback" not in result.stderr


def test_module_mode_runs_with_its_args(tmp_path):
    (tmp_path / "mytool").mkdir()
    (tmp_path / "mytool" / "__init__.py").write_text("")
    (tmp_path / "mytool" / "__main__.py").write_text("import sys\nprint('args', sys.argv[1:])\n")
    result = watch("--headless", "-m", "mytool", "--flag", "x", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "args ['--flag', 'x']\n"
