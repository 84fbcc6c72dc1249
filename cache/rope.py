"""Re-rotation of cached keys (StreamingLLM): keys are stored with RoPE applied, so after compaction a
kept key at old position p is rotated by (p' - p) to sit at its new position p'. Rotations compose, and
only the rotation frequencies are needed (not the model's attention scaling, already in the key)."""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Rerotator:
    """Holds the model's RoPE inverse frequencies; `shift(keys, rotation(delta))` moves each key by delta positions."""

    def __init__(self, inv_freq: torch.Tensor):
        self.inv_freq = inv_freq.detach().float()

    @classmethod
    def from_model(cls, model: torch.nn.Module) -> "Rerotator":
        rotary = getattr(getattr(model, "model", model), "rotary_emb", None)
        if rotary is None or not hasattr(rotary, "inv_freq"):
            raise ValueError(f"{type(model).__name__} has no rotary embedding with inv_freq; re-rotation needs RoPE")
        return cls(rotary.inv_freq)

    def rotation(self, delta: torch.Tensor, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [tokens, head_dim] of the rotation by `delta` positions per token; the same for
        every layer, so a compaction computes it once."""
        angles = delta.to(self.inv_freq.device).float()[:, None] * self.inv_freq[None, :]
        angles = torch.cat((angles, angles), dim=-1).to(device)
        return angles.cos(), angles.sin()

    @staticmethod
    def shift(keys: torch.Tensor, rotation: tuple[torch.Tensor, torch.Tensor], in_place: bool = False) -> torch.Tensor:
        """keys: [..., tokens, head_dim], rotated in float32 and returned in their own dtype. On a CPU this
        runs at memory speed, so every full-size temporary costs: float32 keys the caller owns
        (`in_place`) are rotated half by half in place, with one half-size temporary."""
        cos, sin = rotation
        if not (in_place and keys.dtype == torch.float32):
            exact = keys.float()
            return rotate_half(exact).mul_(sin).addcmul_(exact, cos).to(keys.dtype)
        half = keys.shape[-1] // 2
        cos, sin = cos[..., :half], sin[..., :half]  # the two halves turn by the same angles
        first, second = keys[..., :half], keys[..., half:]
        carried = first * sin
        first.mul_(cos).addcmul_(second, sin, value=-1)
        second.mul_(cos).add_(carried)
        return keys
