"""Reading caches and judging them: the ONE place that reads transformers cache internals (introspect, a
package split by job), the ONE rulebook (diagnostics, and silent_rules: its chapter on the silent bugs users
report) and the memory of its state-like alarms (alarms); verify (cached logits against a full recompute),
topk, tokens (what a tokenizer marks special or adds), and the cache's tensors copied out to a file (export).

Imports: records (the value types it produces) and support; never chat, watch or serving.
"""
