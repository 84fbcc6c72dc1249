"""The conversational agent: model runtime, engine and the Agent users embed."""

from agent.agent import Agent, AgentConfig
from agent.engine import SamplingConfig

__all__ = ["Agent", "AgentConfig", "SamplingConfig"]
