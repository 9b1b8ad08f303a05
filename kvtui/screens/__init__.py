"""The screens of the one app (kvtui/app.py), one per kind of source, each with its own CSS file:

- step.py: the step viewer, a sequence of forward steps (kvtui's own chat, a trace, a watched program or
  process tree), the source a driver (kvtui/drivers);
- server.py: the server view, a vLLM/SGLang server's prefix cache (`kvtui attach`, `kvtui replay` of a server
  trace);
- compare.py: `kvtui compare`, cache strategies side by side.

base.py holds what every screen shares: the chrome keys (pause, help, theme, screenshot, quit) with one
meaning each, dimmed keys a source cannot honour, and the status line.
"""
