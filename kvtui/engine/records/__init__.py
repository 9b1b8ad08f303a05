"""Records: the frozen plain values every front end shows (snapshot), the codec between those values and
the dicts of a trace, a stream or a pipe (codec), the step trace's writer (recorder; a server's trace is
server/server_trace's), traces read back and replayed, the stream protocol between a live source and the viewer,
diff, the registry of alarm codes (codes), and the alarms grouped and flood-bounded as the viewers show them
(diagnostic_groups).

Imports: nothing else of the engine but support; never reading, chat, watch, batching or server.
"""
