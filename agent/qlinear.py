"""Weight-only quantized replacements for `nn.Linear` on CPU (the `--weights int4` / `--weights int8` paths).

Why weight-only: decode on CPU is bound by the bytes of weight read per token, and this model has huge
activation outliers (down_proj inputs reach ~2800 against a mean of ~0.1), so quantizing activations
too (torch.ao dynamic int8, one scale per tensor) loses half the top-1 agreement with float32. Here
only the weights are quantized; activations are rounded to bfloat16 (not quantized) for torch's fused
CPU kernels, which accumulate in float32.

Why group-wise int4: the embedded model was shipped as GGUF Q4_1 (groups of 32 input weights, each with
its own scale and minimum), so its linear weights are exactly 4-bit codes per group of 32. `Int4Linear`
recovers those codes losslessly and runs `aten._weight_int4pack_mm_for_cpu`; the only rounding left is
bfloat16 on the activations, the per-group scale/offset and the outputs. `Int8Linear` is the plain
weight-only int8 option (one scale per output channel, `torch._weight_int8pack_mm`), for models whose
weights are not 4-bit to begin with.

The lm_head is left in float32 by `quantize_linear` (its tied embedding is GGUF Q8_0, not Q4_1, and
bfloat16 logits flip near-ties): that keeps top-1 agreement near 100% at a small cost in speed."""

from __future__ import annotations

import torch
from torch import nn

from cache import native

GROUP = 32  # Q4_1's group size along the input dimension
DECODE_ROWS = 8  # at most this many rows go to the output layer's int8 kernel (decode); more use the float matmul
ACT = torch.bfloat16  # the activation dtype torch's fast int4/int8 CPU kernels take (float32 falls back to a slow path)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).to(ACT)


class Int4Linear(nn.Module):
    """Group-wise asymmetric 4-bit weights: w = code * scale + minimum per group of `group` inputs.
    Exact for weights that came from GGUF Q4_1 (codes are recovered, not re-rounded)."""

    def __init__(self, linear: nn.Linear, group: int = GROUP):
        super().__init__()
        weight = linear.weight.detach().float()
        out_features, in_features = weight.shape
        if in_features % group or in_features % 2:
            raise ValueError(f"in_features {in_features} is not a multiple of the group size {group}")
        groups = weight.reshape(out_features, in_features // group, group)
        low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
        scale = (high - low) / 15
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        codes = ((groups - low) / safe).round().clamp(0, 15).to(torch.int32).reshape(out_features, in_features)
        self.in_features, self.out_features, self.group = in_features, out_features, group
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1))
        # The kernel computes (code - 8) * scale + zero, in [in_features // group, out_features, 2] layout.
        zero = low + 8 * scale
        self.register_buffer("scales_zeros", torch.stack([scale.squeeze(-1).t(), zero.squeeze(-1).t()], -1).to(ACT).contiguous())
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.product(x, self.packed, self.scales_zeros, self.group)
        return y if self.bias is None else y + self.bias

    @staticmethod
    def product(x: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor, group: int) -> torch.Tensor:
        """x times packed int4 weights (torch's CPU layout), in x's dtype and shape but the last axis."""
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(_rows(x), packed, group, scales_zeros)
        return y.to(x.dtype).reshape(*x.shape[:-1], packed.shape[0])

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group={self.group}, bias={self.bias is not None}"


class Int8Linear(nn.Module):
    """Symmetric int8 weights with one scale per output channel (weight-only; activations stay unquantized)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        weight = linear.weight.detach().float()
        scale = weight.abs().amax(1) / 127
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.register_buffer("weight_int8", (weight / safe[:, None]).round().clamp(-127, 127).to(torch.int8))
        self.register_buffer("scales", scale.to(ACT))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch._weight_int8pack_mm(_rows(x), self.weight_int8, self.scales)
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Q8Head(nn.Module):
    """The output layer read from int8 codes with one scale per group of 32 inputs (GGUF Q8_0's layout),
    for the few rows decode asks for; more rows (scoring, surprisal) use the float weight it shares with
    the embedding. Only built where it is lossless: the embedded model's tied embedding was stored as
    Q8_0, so codes * scales give back its float32 weights exactly, and reading 1 byte a weight instead of
    4 takes about 3 of the 18 ms a token costs (int4 weights, 2 threads)."""

    def __init__(self, linear: nn.Linear, codes: torch.Tensor, scales: torch.Tensor):
        super().__init__()
        self.weight = linear.weight  # shared, not copied: it is also the embedding
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("codes", codes)
        self.register_buffer("scales", scales)

    @classmethod
    def lossless(cls, linear: nn.Linear) -> "Q8Head | None":
        """The int8 form of a float32 linear layer without bias whose weights it holds exactly, else None."""
        weight = linear.weight.detach()
        if weight.dtype != torch.float32 or linear.bias is not None or weight.shape[1] % GROUP:
            return None
        groups = weight.reshape(weight.shape[0], -1, GROUP)
        scales = groups.abs().amax(-1) / 127
        codes = (groups / torch.where(scales > 0, scales, torch.ones_like(scales))[..., None]).round()
        if codes.abs().max() > 127 or not torch.equal(codes * scales[..., None], groups):
            return None
        return cls(linear, codes.to(torch.int8).reshape(weight.shape).contiguous(), scales.contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] > DECODE_ROWS or not native.available(x):
            return nn.functional.linear(x, self.weight)
        return native.q8_matmul(rows, self.codes, self.scales).to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group={GROUP}"


KINDS: dict[str, type[nn.Module]] = {"int4": Int4Linear, "int8": Int8Linear}


def quantize_linear(model: nn.Module, kind: str, skip: tuple[str, ...] = ("lm_head",)) -> nn.Module:
    """Replace every nn.Linear (except those named in `skip`, and any the kernel's shapes rule out) with
    the `kind` module, in place; returns the model."""
    cls = KINDS[kind]
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            full = f"{parent_name}.{name}" if parent_name else name
            if type(child) is nn.Linear and full not in skip and name not in skip:
                if kind == "int4" and child.in_features % GROUP:
                    continue
                setattr(parent, name, cls(child))
    return model


def module_bytes(module: nn.Module) -> int:
    """Bytes held by a module's parameters and buffers."""
    tensors = list(module.parameters()) + list(module.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)
