"""Watching a user's program or a command's process tree: the probe (observes, never changes), the class
patches restored on detach, cache lineage, the step builder, the process tree.

Imports: reading, records, models, support; never chat or serving.
"""
