"""`kvtui samples`: the pitfall scripts shipped inside the package; `kvtui samples copy DIR` to edit them.

The samples are package data (found with importlib.resources), so this works the same from a wheel,
pipx, an editable install or a checkout.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from ..fmt import one_line
from ..locations import shipped

SUFFIXES = (".json", ".jsonl", ".yaml", ".yml", ".txt", ".ipynb")


def _files():
    return sorted((f for f in shipped("samples").iterdir() if f.name.endswith(SUFFIXES)), key=lambda f: f.name)


def _programs():
    """The sample programs for `kvtui watch` (samples/programs/*.py), with what each hides."""
    folder = shipped("samples") / "programs"
    if not folder.is_dir():
        return []
    return sorted((f for f in folder.iterdir() if f.name.endswith(".py")), key=lambda f: f.name)


def _program_expects(program) -> str:
    for line in program.read_text(encoding="utf-8").splitlines():
        if line.startswith("kvtui-expects:"):
            return line.partition(":")[2].strip()
    return "-"


def _describe(sample) -> tuple[str, str, str]:
    """(model, what it shows, what it raises) from a script's own fields."""
    try:
        data = json.loads(sample.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return "-", "(unreadable)", "-"
    if not isinstance(data, dict):
        return "-", "(not a script)", "-"
    model = (data.get("options") or {}).get("model") or "embedded SmolLM2"
    shows = str(data.get("description") or "").split(": ")[0].split(". ")[0]
    return str(model), shows, ", ".join(data.get("expect") or []) or "nothing"


@click.group("samples", invoke_without_command=True)
@click.pass_context
def samples(ctx: click.Context) -> None:
    """List the shipped pitfall samples (scripts for --script) with what each shows."""
    if ctx.invoked_subcommand is not None:
        return
    width = click.get_terminal_size()[0] if sys.stdout.isatty() else 100
    files = _files()
    for sample in files:
        if sample.name.endswith(".trace.jsonl"):
            click.echo(f"{sample.name}\n    a recorded trace: kvtui replay {sample.name}")
            continue
        if sample.name.endswith(".ipynb"):
            click.echo(
                f"{sample.name}\n    a notebook: the cache pitfalls with kvtui's inline view "
                "(pip install 'kvtui[notebook]', then open it in Jupyter, VS Code or Colab)"
            )
            continue
        model, shows, raises = _describe(sample)
        click.echo(f"{sample.name}  [{one_line(model)}]  raises: {one_line(raises)}")
        click.echo(f"    {one_line(shows, max(20, width - 4))}")
    programs = _programs()
    for program in programs:
        first = (
            program.read_text(encoding="utf-8").split('"""')[1].strip().splitlines()[0]
            if '"""' in program.read_text(encoding="utf-8")
            else ""
        )
        click.echo(f"programs/{program.name}  raises: {one_line(_program_expects(program))}")
        click.echo(f"    {one_line(first, max(20, width - 4))} (kvtui watch programs/{program.name} MODEL_DIR)")
    click.echo(
        f"\n{len(files)} scripts, {len(programs)} programs. Run one: kvtui --headless --script FILE (after "
        "`kvtui samples copy DIR`), in the TUI: kvtui --script FILE, a program: kvtui watch FILE MODEL_DIR"
    )


@samples.command("copy")
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
@click.option("--force", is_flag=True, help="Overwrite files that already exist there.")
def copy(directory: Path, force: bool) -> None:
    """Copy the samples into DIRECTORY (created if needed) to run and edit them."""
    files = _files()
    programs = _programs()
    clashes = [f.name for f in files if (directory / f.name).exists()]
    clashes += [f"programs/{f.name}" for f in programs if (directory / "programs" / f.name).exists()]
    if clashes and not force:
        click.echo(f"kvtui: error: {directory} already has {', '.join(clashes)} (--force overwrites)", err=True)
        sys.exit(2)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        for f in files:
            (directory / f.name).write_bytes(f.read_bytes())
        if programs:
            (directory / "programs").mkdir(exist_ok=True)
        for f in programs:
            (directory / "programs" / f.name).write_bytes(f.read_bytes())
    except OSError as exc:
        click.echo(f"kvtui: error: cannot copy the samples to {directory}: {exc.strerror or exc}", err=True)
        sys.exit(2)
    click.echo(f"copied {len(files)} samples and {len(programs)} programs to {directory}")
