"""Reading caches and judging them: where kvtui reads transformers cache internals (introspect, a package split
by job; the paged cache of continuous batching in introspect/paged), the step rules (diagnostics, and silent_rules:
the silent bugs users report; their codes are the one registry in records/codes.py) and the memory of the
state-like alarms (alarms); the one common-prefix function and template-drift judgement (prefixes), the one
token-text cache (token_texts); verify (cached logits against a full recompute),
topk, tokens (what a tokenizer marks special or adds), and the cache's tensors copied out to a file (export).

Imports: records (the value types it produces) and support; never chat, watch, batching or server.
"""
