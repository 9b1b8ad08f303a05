"""A vLLM/SGLang server's prefix cache followed through its KV events (`kvtui attach`): the events decoded
(kv_events), subscribed to over ZeroMQ with gaps replayed or counted (subscriber), the server's HTTP endpoints
(server_http), the block index (prefix_cache) with its rules (rules), metrics over time (metrics) and text report
(report), the attach session that ties them (attach), and the server trace written and replayed (server_trace).

Imports: reading, records, support; never chat, watch or batching (pyproject's contracts).
"""
