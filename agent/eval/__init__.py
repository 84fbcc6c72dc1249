"""Evaluation: scripted dialogues driven through an Agent by teacher forcing, scored per probe, with the
no-cache baseline, worker processes and the report."""
