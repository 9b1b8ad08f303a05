"""The step viewer's sources: what screens/step.py shows and what its keys drive. `ChatDriver` runs kvtui's own
chat in the engine process, `TraceDriver` steps through a recorded trace (finished, or followed as it grows),
`ProgramDriver`
watches a program or a command's tree of processes. Each wraps an engine-layer `Source`
(engine/records/stream.py). A driver asks of the screen only what `Viewer` (base.py) lists, and the screen asks of a
driver only what `Driver` declares."""
