"""The attention function the model runs under: SDPA for the output, plus (when the cache asks for it)
the attention mass each cached token receives, which importance-based eviction (H2O, hybrid) needs.

Both an attention function and a mask function are registered under one name: transformers builds the
mask from the mask registry, and without that registration causal masking would silently be lost."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
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
    if mask is None and q_len > 1:  # causal over a fresh sequence (q_len == kv_len)
        scores = scores.masked_fill(~torch.ones(q_len, kv_len, dtype=torch.bool, device=key.device).tril(), float("-inf"))
    elif mask is not None and mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask[0].unsqueeze(0), float("-inf"))
    elif mask is not None:
        scores = scores + mask[0].unsqueeze(0).float()
    return scores.softmax(dim=-1).sum(dim=(1, 2))


def palace_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """SDPA output with the KV heads shared natively (`enable_gqa`: keys are never copied out to every
    query head, which halves attention time on CPU); if a `kv_store` kwarg is recording importance, also
    accumulate attention mass. Returns ([batch, q_len, heads, dim], None) like transformers' own."""
    q_len, kv_len = query.shape[2], key.shape[2]
    if attention_mask is None and 1 < q_len < kv_len:  # SDPA's is_causal aligns to the top left: spell it out
        rows = torch.arange(q_len, device=key.device)[:, None] + (kv_len - q_len)
        attention_mask = (torch.arange(kv_len, device=key.device)[None, :] <= rows)[None, None]
    elif attention_mask is not None:
        attention_mask = attention_mask[:, :, :, -kv_len:]
    store = kwargs.get("kv_store")
    if store is not None and store.recording:
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        store.add_importance(module.layer_idx, attention_mass(query, key, attention_mask, scale))
    output = F.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, is_causal=attention_mask is None and q_len > 1,
        scale=scaling, enable_gqa=key.shape[1] != query.shape[1])
    return output.transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, palace_attention)
AttentionMaskInterface.register(NAME, sdpa_mask)


def enable_palace_attention(model: torch.nn.Module) -> None:
    model.set_attn_implementation(NAME)
