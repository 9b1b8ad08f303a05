"""Ship it like a Python tool: build the wheel, install it into a fresh virtualenv, and use it there.

Honest about where kvtui comes from: the wheel is built from a copy of the sources (no stale build/),
installed with `pip install --no-deps` into a new venv, and every command runs with no PYTHONPATH, from
a directory outside the source tree. The venv reuses this environment's torch/transformers/textual
through a `.pth` line that is added after kvtui is installed (a directory named in a .pth is only put on
sys.path: this environment's editable-install hook is not run, and the venv's own site-packages comes
first). The first check is that `kvtui` imports from the venv: if the wheel lacks its themes, samples
or stylesheet, the commands below fail.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("kvtui", "themes", "samples", "pyproject.toml", "README.md")


def _run(args, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=600, **kwargs)


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(venv bin dir, env, work dir) with the freshly built wheel installed."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in SOURCES:  # symlinks stay links: kvtui/data/* point at ../../themes, ../../samples
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, src / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(source, src / name)
    built = _run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", tmp / "dist", src]
    )
    assert built.returncode == 0, built.stderr[-3000:]
    wheels = list((tmp / "dist").glob("kvtui-*.whl"))
    assert len(wheels) == 1, wheels

    venv = tmp / "venv"
    made = _run([sys.executable, "-m", "venv", venv])
    assert made.returncode == 0, made.stderr
    bin_dir = venv / ("Scripts" if os.name == "nt" else "bin")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(
        KVTUI_CACHE_DIR=str(tmp / "cache"),
        KVTUI_CONFIG_DIR=str(tmp / "config"),
        HF_HUB_OFFLINE="1",
        PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}",
        OMP_NUM_THREADS="1",
        TERM="xterm-256color",
    )
    pip = _run(
        [bin_dir / "python", "-m", "pip", "install", "--no-deps", "--no-index", "-q", wheels[0]], env=env, cwd=tmp
    )
    assert pip.returncode == 0, pip.stderr[-3000:]
    site = _run([bin_dir / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], env=env)
    shared = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (Path(site.stdout.strip()) / "zz-kvtui-test-deps.pth").write_text("\n".join(sorted(shared)) + "\n")
    work = tmp / "work"
    work.mkdir()
    return bin_dir, env, work


def test_kvtui_imports_from_the_venv_with_its_data(installed):
    bin_dir, env, work = installed
    code = (
        "import json, kvtui, kvtui.locations as l; "
        "print(json.dumps([kvtui.__file__, str(l.shipped('themes')), "
        "sorted(f.name for f in l.shipped('samples').iterdir())]))"
    )
    out = _run([bin_dir / "python", "-c", code], env=env, cwd=work)
    assert out.returncode == 0, out.stderr[-3000:]
    package_file, themes_dir, samples = json.loads(out.stdout)
    venv = bin_dir.parent.resolve()
    assert Path(package_file).resolve().is_relative_to(venv), f"kvtui came from {package_file}, not the venv"
    assert not Path(package_file).resolve().is_relative_to(ROOT)
    assert Path(themes_dir).is_dir() and not Path(themes_dir).is_symlink()  # copied into the wheel
    assert {"eos-appended.json", "seed-conversation.trace.jsonl", "cache-pitfalls.ipynb"} <= set(samples)


def test_version_samples_and_copy(installed):
    bin_dir, env, work = installed
    kvtui = bin_dir / "kvtui"
    version = _run([kvtui, "--version"], env=env, cwd=work)
    assert version.returncode == 0 and "0.1.0" in version.stdout, version.stderr
    listed = _run([kvtui, "samples"], env=env, cwd=work)
    assert listed.returncode == 0, listed.stderr
    for name in ("eos-appended.json", "double-bos.json", "static-overflow.json"):
        assert name in listed.stdout
    assert "raises: tokenizer-added-special, eos-in-context" in listed.stdout
    copied = _run([kvtui, "samples", "copy", work / "mine"], env=env, cwd=work)
    assert copied.returncode == 0, copied.stderr
    shipped = sorted(p.name for p in (ROOT / "samples").iterdir())
    assert sorted(p.name for p in (work / "mine").iterdir()) == shipped
    again = _run([kvtui, "samples", "copy", work / "mine"], env=env, cwd=work)
    assert again.returncode == 2 and again.stderr.count("\n") == 1 and "--force" in again.stderr


def test_a_headless_sample_on_a_tiny_model(installed):
    bin_dir, env, work = installed
    _run([bin_dir / "kvtui", "samples", "copy", work / "run"], env=env, cwd=work)
    trace = work / "eos.jsonl"
    run = _run(
        [bin_dir / "kvtui", "--headless", "--script", work / "run" / "eos-appended.json", "--trace", trace],
        env={**env, "COLUMNS": "100"},
        cwd=work,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "eos-in-context" in run.stdout and "Traceback" not in run.stderr
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    assert records[0]["type"] == "header" and any(r["type"] == "buffer" for r in records)


FIRST_FRAME = textwrap.dedent("""
    import asyncio, sys
    from kvtui import viewers
    from kvtui.options import AppConfig
    from kvtui.widgets.step.layers_pane import LayersPane

    async def main():
        app = viewers.chat(AppConfig(model="tiny:qwen2", options={"max_new_tokens": 3}, theme="wheel-test"))
        async with app.run_test(size=(120, 40)) as pilot:
            for _ in range(1200):
                await pilot.pause(0.1)
                if app.view.session is not None:
                    break
            assert app.view.session is not None, app.view.model_text
            print("THEME", app.theme)
            print("FRAME", "layers" in app.export_screenshot())
            print("ROWS", app.query_one(LayersPane).table.row_count)
    asyncio.run(main())
""")


def test_the_tui_draws_a_first_frame_in_a_user_theme(installed):
    bin_dir, env, work = installed
    themes = Path(env["KVTUI_CONFIG_DIR"]) / "themes"
    themes.mkdir(parents=True, exist_ok=True)
    (themes / "wheel-test.toml").write_text('name = "wheel-test"\nprimary = "#00aa88"\ndark = true\n')
    listed = _run([bin_dir / "kvtui", "themes"], env=env, cwd=work)
    assert listed.returncode == 0 and "wheel-test" in listed.stdout and "kvtui-dark" in listed.stdout, listed.stderr
    script = work / "first_frame.py"
    script.write_text(FIRST_FRAME)
    out = _run([bin_dir / "python", script], env=env, cwd=work)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "THEME wheel-test" in out.stdout and "FRAME True" in out.stdout, out.stdout
