"""The `tandem` command: runs one service, the embedded stack, or a quick local generation."""

__version__ = "0.1.0"
