"""Long-term memory: archived KV, summaries and the entity graph (later issues)."""
