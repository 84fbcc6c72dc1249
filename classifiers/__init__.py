"""Classifiers that steer cache decisions: topic boundaries and referents (later issues)."""
