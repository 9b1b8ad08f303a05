"""Watching a user's program or a command's process tree, never changing it: the probe (the Watcher) and its
parts (hooks: a model's entry and its forwards in flight; callers: the user's line; tokenizers; auto_attach),
the class patches restored on detach, cache lineage, the step builder (watch_step; packed_step for a
continuous-batching forward), the silent-bug hooks (silent_*), a watched program's child process, the process
tree (tree, tree_source).

Imports: batching, reading, records, models, support; never chat or server.
"""
