"""The declared transformers range: `kvtui --version` names the one in use and whether it is tested."""

from __future__ import annotations

import subprocess
import sys

import transformers
from click.testing import CliRunner

from kvtui.cli import main
from kvtui.engine import support


def test_version_names_transformers_and_whether_tested():
    result = CliRunner().invoke(main, ["--version"])
    assert result.exit_code == 0, result.output
    assert f"transformers {transformers.__version__}" in result.output
    # The suite runs only on tested versions (CI: 5.24 and 4.57), so this one must say so.
    assert "(tested)" in result.output


def test_the_range_itself():
    assert support.is_tested("4.57.1") and support.is_tested("5.23.0") and support.is_tested("5.24.0")
    assert not support.is_tested("4.56.2") and not support.is_tested("5.10.0") and not support.is_tested("6.0.0")
    assert support.version_line("5.24.0") == "transformers 5.24.0 (tested)"
    assert "not tested" in support.version_line("5.10.0") and "4.57.x and 5.23–5.24" in support.version_line("5.10.0")
    assert support.warning_line("5.24.0") is None
    warning = support.warning_line("4.50.0")
    assert warning is not None and "\n" not in warning and "outside the tested range" in warning


def test_one_warning_line_at_start_outside_the_range():
    # A fake installed version outside the range: the command runs on, with one warning line on stderr.
    code = (
        "import kvtui.engine.support as s; s.installed = lambda: '5.10.0'; "
        "from kvtui.cli import main; main(['samples'])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert lines == [support.warning_line("5.10.0")]
    assert "eos-appended.json" in out.stdout


def test_make_test_installs_the_newest_and_the_oldest_tested():
    """The Makefile's two environments are the ends of the declared range (support.TESTED)."""
    import re
    from pathlib import Path

    makefile = (Path(__file__).resolve().parents[2] / "Makefile").read_text()
    pins = dict(re.findall(r"^TRANSFORMERS_(NEWEST|OLDEST) := transformers>=([\d.]+),<[\d.]+$", makefile, re.M))
    assert support._parse(pins["NEWEST"]) == max(high for _, high in support.TESTED)
    assert support._parse(pins["OLDEST"]) == min(low for low, _ in support.TESTED)
    assert "'$(TRANSFORMERS_NEWEST)'" in makefile and "'$(TRANSFORMERS_OLDEST)'" in makefile
