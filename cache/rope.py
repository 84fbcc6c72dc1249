"""Re-rotation of cached keys (StreamingLLM): keys are stored with RoPE applied, so after compaction a
kept key at old position p is rotated by (p' - p) to sit at its new position p'. Rotations compose, and
only the rotation frequencies are needed (not the model's attention scaling, already in the key)."""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Rerotator:
    """Holds the model's RoPE inverse frequencies; `shift(keys, delta)` moves each key by delta positions."""

    def __init__(self, inv_freq: torch.Tensor):
        self.inv_freq = inv_freq.detach().float()

    @classmethod
    def from_model(cls, model: torch.nn.Module) -> "Rerotator":
        rotary = getattr(getattr(model, "model", model), "rotary_emb", None)
        if rotary is None or not hasattr(rotary, "inv_freq"):
            raise ValueError(f"{type(model).__name__} has no rotary embedding with inv_freq; re-rotation needs RoPE")
        return cls(rotary.inv_freq)

    def shift(self, keys: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """keys: [..., tokens, head_dim]; delta: [tokens] position change per token."""
        angles = delta.to(self.inv_freq.device).float()[:, None] * self.inv_freq[None, :]
        angles = torch.cat((angles, angles), dim=-1).to(keys.device)
        exact = keys.float()
        return (exact * angles.cos() + rotate_half(exact) * angles.sin()).to(keys.dtype)
