"""The attention function the model runs under: SDPA for the output, plus (when a store asks for it)
the attention mass each cached token receives, which importance-based eviction (H2O, hybrid) needs.

Tokens of several sequences may be packed into one forward (`kv_pieces`): every linear layer then reads
its weights once for all of them, and only attention, done here, keeps the sequences apart, each against
its own store. Both an attention function and a mask function are registered under one name:
transformers builds the mask from the mask registry, and without that registration causal masking
would silently be lost."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from cache import native

if TYPE_CHECKING:
    from cache.storage import FloatChunk, LayerStorage
    from cache.store import KVStore

NAME = "palace"


@dataclass
class Piece:
    """One sequence's share of a packed forward: the next `count` packed tokens are appended to `store`.
    `mask` ([1, 1, count, kv_len] bool, on the model's device) is the causal mask, or another one, e.g. to
    score several choices at once; built once per forward, not once per layer."""

    store: "KVStore"
    count: int
    mask: torch.Tensor | None = None


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


def causal_mask(q_len: int, kv_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[1, 1, q_len, kv_len] bool: the queries are the newest q_len of kv_len tokens. (SDPA's is_causal
    aligns to the top left, which is wrong as soon as a cache precedes the queries.)"""
    rows = torch.arange(q_len, device=device)[:, None] + (kv_len - q_len)
    return (torch.arange(kv_len, device=device)[None, :] <= rows)[None, None]


def attend(query, key, value, mask, scaling, store: "KVStore | None" = None, layer_idx: int = 0) -> torch.Tensor:
    """SDPA of one sequence's queries over its keys, [1, q_len, heads, dim]. The KV heads are shared
    natively (`enable_gqa`: never copied out to every query head, which halves attention time on CPU).
    A store that is recording importance also receives the attention mass."""
    q_len, kv_len = query.shape[2], key.shape[2]
    if mask is None and 1 < q_len < kv_len:
        mask = causal_mask(q_len, kv_len, key.device)
    elif mask is not None:
        mask = mask[:, :, :, -kv_len:]
    recording = store is not None and store.recording and not store.frozen
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if (q_len == 1 and mask is None and key.dtype == torch.float32 and key.shape[-1] == native.ATTEND_DIM
            and native.attend_fast() and native.available(key)):
        done = native.attend_one(query, key, value, scale, recording)  # one decode token: a tenth of SDPA's set-up
        if done is not None:
            if recording:
                store.add_importance(layer_idx, done[1])
            return done[0]
    if recording:
        store.add_importance(layer_idx, attention_mass(query, key, mask, scale))
    dtype = query.dtype
    if q_len == 1 and dtype == torch.bfloat16 and key.device.type == "cpu":
        # torch's CPU kernel takes one bfloat16 query five times as long as float32 with the casts (1.48 against
        # 0.29 ms over 1,500 keys, one thread, an AVX-512 BF16 EPYC): a bfloat16 decode step's attention in float32
        query, key, value = query.float(), key.float(), value.float()
        mask = mask if mask is None or mask.dtype == torch.bool else mask.float()
    output = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, is_causal=mask is None and q_len > 1,
                                            scale=scaling, enable_gqa=key.shape[1] != query.shape[1])
    return output.transpose(1, 2).to(dtype)


def attend_chunks(query: torch.Tensor, chunks: Iterable[tuple[int, "FloatChunk"]], kv_len: int,
                  mask: torch.Tensor | None, scaling: float | None, want_mass: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention read chunk by chunk with an online softmax (flash-decoding's combine), so a compact store
    never materializes its whole float KV. `chunks` yields (first token, chunk), oldest first, covering
    0..kv_len-1; a chunk computes its scores and weighted values in its own format (a quantized one
    folds its scales into the queries and the weights instead of dequantizing, see `QuantChunk`).
    Grouped queries read their KV head directly (GQA, no copies). Returns the output [1, q_len, heads,
    dim] and, with `want_mass`, the attention mass each key receives, [kv_heads, kv_len], as
    `attention_mass` gives it (kept per chunk, normalized once the final softmax is known)."""
    _, heads, q_len, dim = query.shape
    scale = scaling if scaling is not None else dim**-0.5
    if mask is None and q_len > 1:
        mask = causal_mask(q_len, kv_len, query.device)
    visible = None if mask is None else mask[0, 0, :, -kv_len:]  # [q_len, kv_len] bool
    best = total = out = grouped = None
    kept: list[tuple[torch.Tensor, torch.Tensor]] = []
    for first, chunk in chunks:
        if grouped is None:
            kv_heads = chunk.kv_heads
            grouped = query[0].reshape(kv_heads, heads // kv_heads * q_len, dim)  # head h = kv * group + j
        scores = chunk.scores(grouped).mul_(scale)  # [kv, group*q, n], float32
        if visible is not None:
            part = visible[:, first:first + scores.shape[-1]]
            scores = scores.view(kv_heads, -1, q_len, part.shape[-1]).masked_fill_(~part, float("-inf")).view_as(scores)
        peak = scores.amax(dim=-1)
        new_best = peak if best is None else torch.maximum(best, peak)
        shift = torch.where(torch.isfinite(new_best), new_best, torch.zeros_like(new_best))
        weights = scores.sub_(shift[..., None]).exp_()  # in place: scores are not needed again
        chunk_out = chunk.weighted(weights)
        if best is None:
            total, out = weights.sum(dim=-1), chunk_out
        else:
            carry = (best - shift).exp()  # rescale what earlier chunks summed to the new maximum
            total = total.mul_(carry).add_(weights.sum(dim=-1))
            out = out.mul_(carry[..., None]).add_(chunk_out)
        if want_mass:
            kept.append((weights, shift))
        best = new_best
    if grouped is None:
        raise ValueError("attention over an empty cache")
    out = (out / total.clamp_min(torch.finfo(torch.float32).tiny)[..., None]).to(query.dtype)
    output = out.view(kv_heads, heads // kv_heads, q_len, dim).reshape(heads, q_len, dim).transpose(0, 1)[None]
    mass = None
    if want_mass:
        final = torch.where(torch.isfinite(best), best, torch.zeros_like(best))
        norm = total.clamp_min(torch.finfo(torch.float32).tiny)
        mass = torch.cat([(w * ((s - final).exp() / norm)[..., None]).sum(dim=1) for w, s in kept], dim=-1)
    return output, mass


def attend_store(query, storage: "LayerStorage", mask, scaling, store: "KVStore", layer_idx: int) -> torch.Tensor:
    """Attention of one sequence's new queries over its store's layer, read in the storage's own format:
    a float layer held in the compute dtype goes to SDPA over a view of it; every other layer is read by
    its chunks (a quantized one without dequantizing, a paged one straight from its blocks)."""
    view = storage.view(query.dtype)
    if view is not None:
        return attend(query, *view, mask, scaling, store, layer_idx)
    recording = store.recording and not store.frozen
    output, mass = attend_chunks(query, storage.chunks(query.dtype), storage.length, mask, scaling, recording)
    if recording:
        store.add_importance(layer_idx, mass)
    return output


def palace_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """With `kv_pieces`: append each piece's new keys/values to its store and attend within it, reading
    the store's format directly (nothing is copied out whole, nothing retained). Without: plain
    attention over whatever cache transformers passed (e.g. a DynamicCache).
    Returns ([batch, q_len, heads, dim], None) like transformers' own."""
    pieces: list[Piece] | None = kwargs.get("kv_pieces")
    if pieces is None:
        return attend(query, key, value, attention_mask, scaling).contiguous(), None
    outputs, start = [], 0
    for piece in pieces:
        end = start + piece.count
        layer = piece.store.layers[module.layer_idx]
        layer.append(key[:, :, start:end], value[:, :, start:end])
        outputs.append(attend_store(query[:, :, start:end], layer.storage, piece.mask, scaling, piece.store,
                                    module.layer_idx))
        start = end
    return (outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)).contiguous(), None


AttentionInterface.register(NAME, palace_attention)
AttentionMaskInterface.register(NAME, sdpa_mask)


def enable_palace_attention(model: torch.nn.Module) -> None:
    model.set_attn_implementation(NAME)
