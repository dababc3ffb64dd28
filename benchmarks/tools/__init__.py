"""Diagnostics: one-off measurements behind figures and tests (`python -m benchmarks.tools.<name>`)."""
