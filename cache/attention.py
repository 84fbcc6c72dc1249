"""The attention function the model runs under: SDPA for the output, plus (when the cache asks for it)
the attention mass each cached token receives, which importance-based eviction (H2O, hybrid) needs.

Both an attention function and a mask function are registered under one name: transformers builds the
mask from the mask registry, and without that registration causal masking would silently be lost."""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "palace"


def attention_mass(query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
    """Softmax attention mass received by each key, summed over the queries and over the query heads of
    each KV group: shape [kv_heads, kv_len]. GQA-aware: keys are never expanded to query heads."""
    _, q_heads, q_len, dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    grouped = query[0].reshape(kv_heads, q_heads // kv_heads * q_len, dim)
    scores = torch.matmul(grouped, key[0].transpose(-1, -2)).float() * scaling  # [kv, g*q, kv_len]
    scores = scores.view(kv_heads, q_heads // kv_heads, q_len, kv_len)
    if mask is None:
        if q_len > 1:  # causal, aligned to the end: query i sees keys up to kv_len - q_len + i
            rows = torch.arange(q_len, device=key.device)[:, None] + (kv_len - q_len)
            allowed = torch.arange(kv_len, device=key.device)[None, :] <= rows
            scores = scores.masked_fill(~allowed, float("-inf"))
    elif mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask[0, :, :, -kv_len:].unsqueeze(0), float("-inf"))
    else:
        scores = scores + mask[0, :, :, -kv_len:].unsqueeze(0).float()
    return scores.softmax(dim=-1).sum(dim=(1, 2))


def palace_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """SDPA output; if a `kv_store` kwarg is recording importance, also accumulate attention mass."""
    store = kwargs.pop("kv_store", None)
    if store is not None and store.recording:
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        store.add_importance(module.layer_idx, attention_mass(query, key, attention_mask, scale))
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


AttentionInterface.register(NAME, palace_attention)
AttentionMaskInterface.register(NAME, sdpa_mask)


def enable_palace_attention(model: torch.nn.Module) -> None:
    model.set_attn_implementation(NAME)
