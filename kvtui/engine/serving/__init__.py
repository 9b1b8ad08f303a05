"""Paged caches of servers (continuous batching watched; vLLM/SGLang KV events attached): the next part.

Imports: reading, records, support; never chat or watch.
"""
