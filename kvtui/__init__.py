"""kvtui: a terminal inspector for the live KV cache of Hugging Face transformers models."""

__version__ = "0.1.0"
