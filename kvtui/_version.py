"""The version, alone in a module the engine can read without importing the package's API."""

__version__ = "0.1.0"
