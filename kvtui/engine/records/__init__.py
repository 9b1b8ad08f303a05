"""Records: the frozen plain values every front end shows (snapshot), the ONE trace writer (recorder),
traces read back and replayed, the stream protocol between a live source and the viewer, and diff.

Imports: nothing else of the engine but support; never reading, chat, watch or serving.
"""
