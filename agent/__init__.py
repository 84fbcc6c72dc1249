"""The conversational agent: model runtime, engine and the Agent users embed.

The names below load on first use: `agent.packed` (shared with the embedder) must import without pulling
in the Agent, which imports the memory that imports the embedder."""

from __future__ import annotations

import importlib

__all__ = ["Agent", "AgentConfig", "SamplingConfig"]
_HOMES = {"Agent": "agent.agent", "AgentConfig": "agent.agent", "SamplingConfig": "agent.engine"}


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'agent' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
