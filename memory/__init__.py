"""Long-term memory. `recall` is the loop the Agent runs (archive what the cache evicts, recall archived
turns and re-inject their KV); under it, `segment` (what is archived), `embedder` (offline MiniLM
vectors), `index` (FAISS, scoped by user and session), `codec` (exact or int8 KV payloads), `tiers` (KV in
memory up to a cap, then files), `archive` (SQLite metadata tying them together; save/open a session
directory), `bench` (per-turn cost of the storage half). Summaries and the entity graph come later."""
