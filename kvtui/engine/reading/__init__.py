"""Reading caches and judging them: the ONE place that reads transformers cache internals (introspect, a
package split by job), the ONE rulebook (diagnostics) and the memory of its state-like alarms (alarms),
and the cache's tensors copied out to a file (export).

Imports: records (the value types it produces) and support; never chat, watch or serving.
"""
