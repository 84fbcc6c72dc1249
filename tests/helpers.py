"""Test helpers: a tiny random GQA Llama for fast unit tests (no weights on disk)."""

from __future__ import annotations

import torch

from agent.model import prepare


def tiny_llama(seed: int = 0, layers: int = 2, vocab: int = 512):
    """A tiny random GQA Llama (4 query heads, 2 KV heads) built from a config, routed through our attention."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, rope_theta=10000.0)
    return prepare(LlamaForCausalLM(config), torch.device("cpu"))


def store_for(model, policy: str = "full", budget: int | None = None, storage=None, **extra):
    """A KVStore under a named policy (PolicyConfig fields in `extra`; a HybridConfig as `hybrid=`)."""
    from cache.policies import PolicyConfig, make_policy
    from cache.storage import StorageConfig
    from cache.store import KVStore

    hybrid = extra.pop("hybrid", None)
    return KVStore.for_model(model, make_policy(policy, PolicyConfig(budget=budget, **extra), hybrid),
                             storage or StorageConfig())


def recording_store(model, storage=None):
    """A store that records attention importance and surprisal and never evicts (hybrid, no budget)."""
    return store_for(model, "hybrid", None, storage)


def teacher_force(agent, user: str, reply: str | None) -> None:
    """One scripted turn through the Agent's own steps: the user's message, then the given reply as history."""
    turn = agent.observe(user)
    agent.recall(turn)
    agent.prefill(turn)
    agent.remember(turn, reply)


def ask(agent, user: str):
    """Prefill a user message without replying (the store's next-token logits then start the reply)."""
    turn = agent.observe(user)
    agent.recall(turn)
    agent.prefill(turn)
    return turn


def tiny_model_dir(path) -> str:
    """A tiny random GQA Llama saved with the embedded model's tokenizer, as a local model directory: the
    whole Agent and `palace chat --model DIR` run on it in a fraction of the embedded model's time."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from agent.model import convert_embedded

    tokenizer = AutoTokenizer.from_pretrained(convert_embedded(), local_files_only=True)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                         rope_theta=10000.0, eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)
