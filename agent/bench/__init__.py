"""Benchmarks: engine speed against transformers generate(), and KV storage strategies at long histories."""
