"""`kvtui tiny --arch ARCH --out DIR`: a tiny random model with a real tokenizer and chat template, offline."""

from __future__ import annotations

from pathlib import Path

import click

from ..options import ARCHES
from . import bad_input as _bad_input


@click.command("tiny")
@click.option("--arch", type=click.Choice(ARCHES), required=True)
@click.option("--bos/--no-bos", default=None, help="Post-processor adds BOS (default: the architecture's habit).")
@click.option("--eos/--no-eos", default=False, show_default=True, help="Post-processor appends EOS (the 862→863 bug).")
@click.option("--sliding-window", type=click.IntRange(2), default=None, help="Window for mistral / gemma3.")
@click.option("--layers", type=click.IntRange(1), default=None)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True)
def tiny(arch, bos, eos, sliding_window, layers, seed, out):
    """Build a tiny random model with a real tokenizer and chat template, offline."""
    from ..engine.models.tiny import build_tiny

    try:
        path = build_tiny(arch, out, bos=bos, eos=eos, sliding_window=sliding_window, layers=layers, seed=seed)
    except ValueError as exc:
        _bad_input(str(exc))
    click.echo(f"built a tiny {arch} model in {path}")
