"""Tandem: distributed speculative decoding (shared library and the `tandem` command)."""

__version__ = "0.1.0"
