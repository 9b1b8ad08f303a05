"""Reading caches and judging them: the ONE module that reads transformers cache internals (introspect),
the ONE rulebook (diagnostics), and the cache's tensors copied out to a file (export).

Imports: records (the value types it produces) and support; never chat, watch or serving.
"""
