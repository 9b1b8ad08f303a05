"""The documented path of a cache exported to a file (`from kvtui.engine.export import load_cache`): it lives in
reading/export.py since the engine was grouped by part; this name keeps users' code working."""

from .reading.export import CacheExport, ExportError, export_cache, load_cache, to_dynamic_cache

__all__ = ["CacheExport", "ExportError", "export_cache", "load_cache", "to_dynamic_cache"]
