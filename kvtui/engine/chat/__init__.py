"""kvtui's own chat: the session (the ONE place that calls the model with kvtui's cache), sampling,
scripts, the engine process (host), its configuration and the model loader.

Imports: reading, records, models, support; never watch or serving.
"""
