"""Benchmark helpers shared by benchmarks/{speed,quality,studies}/: machine stamp, repository paths, results."""
