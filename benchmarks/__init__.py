"""savedhooks benchmarks: ``python -m benchmarks`` (run from the repository root)."""
