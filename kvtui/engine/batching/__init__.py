"""transformers' continuous batching read from a watched forward: what each packed request fed (packed), the
requests followed across forwards (lanes), and the checks judged per request (checks).

Imports: reading, records, support; never chat, watch or server. watch imports it.
"""
