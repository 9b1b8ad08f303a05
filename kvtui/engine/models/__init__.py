"""Where models come from: tiny offline builds, the embedded SmolLM2, local directories and the HF cache."""
