"""Benchmarks: speed/, quality/, studies/ scripts, lib/ helpers, results/ JSONs (see benchmarks/README.md)."""
