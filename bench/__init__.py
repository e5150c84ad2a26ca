"""Benchmarks: `python -m bench` (the evidence protocol), `python -m bench.generation`, `torchrun ... -m bench.transport`."""
