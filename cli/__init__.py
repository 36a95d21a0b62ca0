"""megagraph: a declarative, graph-compiled inference engine for DeepSeek-V4-family models."""

__version__ = "0.1.0"
