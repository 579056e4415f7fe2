"""Benchmarks of Tandem: engine speed and speculative decoding, measured side by side with transformers.

Run them as scripts from the repository root (``python benchmarks/spec_bench.py --help``)
or through ``make bench``; ``benchmarks/README.md`` explains every column.
"""
