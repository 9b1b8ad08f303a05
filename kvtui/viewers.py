"""What each command opens: the source it builds, on the screen that shows it, in the one app (app.py). The
commands, tests and benchmarks open the app through these; the app itself names no source."""

from __future__ import annotations

from pathlib import Path

from .app import KvtuiApp
from .options import AppConfig


def chat(config: AppConfig | None = None, *, loaded=None, clock=None, loader=None, engine_setup=None) -> KvtuiApp:
    """`kvtui [MODEL]`: kvtui's own chat on config.model, in the engine process, where these go and so must
    pickle: `loaded`, an already loaded model; `loader`, a function returning one (instead of loading
    config.model); `clock`, the session's clock; `engine_setup(session)`, called there once the session exists."""
    from .drivers.chat import ChatDriver
    from .screens.step import StepScreen

    config = config or AppConfig()
    driver = ChatDriver(config, loaded=loaded, clock=clock, loader=loader, engine_setup=engine_setup)
    return KvtuiApp(StepScreen(config, driver), theme=config.theme)


def steps(source, config: AppConfig | None = None) -> KvtuiApp:
    """The step viewer on a source of the caller's (a Driver: tests post their own steps)."""
    from .screens.step import StepScreen

    config = config or AppConfig()
    return KvtuiApp(StepScreen(config, source), theme=config.theme)


def replay(trace_path: Path, theme_name: str | None = None, *, follow: bool = False) -> KvtuiApp:
    """`kvtui replay [--follow] TRACE` (a TraceError, file:line, before any screen unless following)."""
    from .drivers.trace import TraceDriver

    return steps(TraceDriver(trace_path, follow=follow), _config(theme_name))


def watch(target: str | None = None, args: list[str] | None = None, *, theme_name=None, **how) -> KvtuiApp:
    """`kvtui watch`: a program to start (`target`, `args`, module=...) or a started source=... (drivers/
    program.py ProgramDriver takes the rest)."""
    from .drivers.program import ProgramDriver

    return steps(ProgramDriver(target, args, **how), _config(theme_name))


def server(session=None, run=None, theme_name: str | None = None) -> KvtuiApp:
    """`kvtui attach` (`session`: a started AttachSession) or `kvtui replay` of a server trace (`run`)."""
    from .screens.server import ServerScreen

    return KvtuiApp(ServerScreen(session=session, run=run), theme=theme_name)


def compare(
    model: str | None,
    strategies,
    options: dict,
    trace_dir: Path,
    script,
    theme_name: str | None = None,
    comparison=None,
) -> KvtuiApp:
    """`kvtui compare`: one engine per strategy (`comparison`: one of the caller's), in lockstep."""
    from .compare import Comparison
    from .screens.compare import CompareScreen

    comparison = comparison or Comparison(model, tuple(strategies), options, Path(trace_dir))
    name = model or "embedded SmolLM2-135M-Instruct"
    return KvtuiApp(CompareScreen(comparison, script, name), theme=theme_name)


def _config(theme_name: str | None) -> AppConfig:
    return AppConfig(theme=theme_name) if theme_name else AppConfig()
