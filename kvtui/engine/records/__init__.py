"""Records: the frozen plain values every front end shows (snapshot), the ONE codec between those values and
the dicts of a trace, a stream or a pipe (codec), the ONE trace writer (recorder), traces read back and
replayed, the stream protocol between a live source and the viewer, diff, and the alarms grouped as the
viewers show them (diagnostic_groups).

Imports: nothing else of the engine but support; never reading, chat, watch or serving.
"""
