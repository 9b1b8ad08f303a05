"""Paged caches of servers, read per request (continuous batching watched; vLLM/SGLang KV events attached next).

Imports: reading, records, support; never chat or watch. watch imports it (pyproject's layers contract:
"chat | watch" above "serving" above "reading"): the watcher shows a packed forward per request with
packed.py, lanes.py and checks.py, and issue 38's vLLM events will reuse the lanes from here.
"""
