"""A segment's KV as an archive payload: one dict of contiguous CPU tensors (what the memory tier holds and
a KV file stores), either exact ("float") or int8 ("int8").

Layers are stacked into one [layers, kv_heads, tokens, head_dim] tensor per side: one allocation and one
file section instead of 2 x layers, and a fresh copy, so an archived segment never pins the live cache's
storage through a view.

int8 is symmetric (codes in [-127, 127], scale = max|x| / 127, float32 scales), grouped the way KIVI found
KV error behaves:
- keys per channel (one scale per layer, head and channel, over the segment's tokens): keys have outlier
  channels, and a per-token scale would spend most of the 8 bits on those few channels;
- values per token (one scale per layer, head and token, over head_dim): values have no channel outliers,
  and attention reads them as a weighted sum over tokens.
Every element is then within scale / 2 of its original, i.e. within 1/254 of the largest magnitude of its
channel (keys) or token (values). For SmolLM2's 3 KV heads x 64 dims, 40 tokens x 30 layers, a segment is
0.27 of its float32 bytes (codes 461 KB + scales 37 KB against 1.84 MB)."""

from __future__ import annotations

import torch

CODECS = ("float", "int8")
LEVELS = 127
TINY = torch.finfo(torch.float32).tiny  # an all-zero group must not divide by zero

Payload = dict[str, torch.Tensor]


def encode(keys: torch.Tensor, values: torch.Tensor, codec: str) -> Payload:
    """Contiguous CPU copies of [layers, kv_heads, tokens, head_dim] keys and values, quantized if `codec` is int8."""
    if codec not in CODECS:
        raise ValueError(f"KV codec {codec!r}: expected one of {', '.join(CODECS)}")
    stacked_keys = keys.detach().to("cpu", memory_format=torch.contiguous_format, copy=True)
    stacked_values = values.detach().to("cpu", memory_format=torch.contiguous_format, copy=True)
    if codec == "float":
        return {"keys": stacked_keys, "values": stacked_values}
    key_codes, key_scale = quantize(stacked_keys, dim=2)  # over tokens: one scale per channel
    value_codes, value_scale = quantize(stacked_values, dim=3)  # over channels: one scale per token
    return {"keys.codes": key_codes, "keys.scale": key_scale, "values.codes": value_codes, "values.scale": value_scale}


def decode(payload: Payload, kind: str, dtype: torch.dtype, device: torch.device | str,
           copy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """[layers, kv_heads, tokens, head_dim] keys and values of a `kind` ("float" or "int8") payload, in `dtype` on `device`. int8
    codes move to the device before they are dequantized (a quarter of the bytes to transfer). `copy`
    when the payload is still held elsewhere, so the caller may modify what it gets (e.g. re-rotate keys
    in place) without touching the archive. KeyError if the payload lacks a tensor of its kind."""
    if kind == "float":
        keys = payload["keys"].to(device, dtype, copy=copy)
        values = payload["values"].to(device, dtype, copy=copy)
    else:
        keys = dequantize(payload["keys.codes"], payload["keys.scale"], dtype, device)
        values = dequantize(payload["values.codes"], payload["values.scale"], dtype, device)
    return keys, values


def nbytes(payload: Payload) -> int:
    return sum(tensor.numel() * tensor.element_size() for tensor in payload.values())


def quantize(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 codes and the float32 scales of the slices along `dim` (kept as a size-1 axis)."""
    x = x.float()
    scale = (x.abs().amax(dim, keepdim=True) / LEVELS).clamp_min(TINY)
    return (x / scale).round_().clamp_(-LEVELS, LEVELS).to(torch.int8), scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    return (codes.to(device).float() * scale.to(device)).to(dtype)
