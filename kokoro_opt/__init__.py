"""kokoro-opt: build, measure and serve the fastest Kokoro-82M that still sounds like the original."""

__version__ = "0.1.0"
