"""Apps: what sits on top of the library — the CLI, benchmarks, the demo, pictures and built-in models."""
