"""Long-term memory. Storage half (issue 10): `segment` (what is archived), `embedder` (offline MiniLM
vectors), `index` (FAISS, scoped by user and session), `codec` (exact or int8 KV payloads), `tiers` (KV in
memory up to a cap, then files), `archive` (SQLite metadata tying them together; save/open a session
directory), `bench` (per-turn cost). Summaries and the entity graph come later."""
