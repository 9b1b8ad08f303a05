"""kvtui's own chat: the session (the ONE place that calls the model with kvtui's cache; its forward and loop in
session.py, its rewind/force/reset/restore in edits.py, its turns in turns.py, what each forward yields in
step_snapshot.py, torch.compile and threads in forward_speed.py, rendering a chat into tokens in render.py),
sampling, scripts, the engine process (host), its configuration and the model loader.

Imports: reading, records, models, support; never watch, batching or server.
"""
