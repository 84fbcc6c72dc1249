"""Managed KV cache: storage, metadata, re-rotation, importance and eviction policies."""
