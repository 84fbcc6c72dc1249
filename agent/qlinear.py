"""Weight-only quantized replacements for `nn.Linear` on CPU (the `--weights int4` / `--weights int8` paths).

Why weights first: decode on CPU is bound by the bytes of weight read per token. This model has huge
activation outliers (down_proj inputs reach ~2800 against a mean of ~0.1), so quantizing activations with
one scale per tensor (torch.ao dynamic int8) loses half the top-1 agreement with float32, and even one int8
level per group of 32 (llama.cpp's Q8) moves 2.4 % of the top-1 tokens.

Why group-wise int4: the embedded model was shipped as GGUF Q4_1 (groups of 32 input weights, each with
its own scale and minimum), so its linear weights are exactly 4-bit codes per group of 32. `Int4Linear`
recovers those codes losslessly. Where the native kernel has integer dot products (AVX-512 VNNI, or AVX2) it keeps
them in that kernel's layout and quantizes each group of activations in two int8 levels (the second holds
what the first rounded away: about 1/127^2 of the group's largest value is left), which agrees with
float32 on 100 % of the bench text's top-1 tokens and reads 4 bits a weight with 3x fewer instructions
than widening codes to floats. Elsewhere it runs torch's `aten._weight_int4pack_mm_for_cpu`, where the
rounding left is bfloat16 on the activations, the per-group scale/offset and the outputs. `Int8Linear` is
the plain weight-only int8 option (one scale per output channel, `torch._weight_int8pack_mm`), for models
whose weights are not 4-bit to begin with.

The lm_head is left in float32 by `quantize_linear` (its tied embedding is GGUF Q8_0, not Q4_1, and
bfloat16 logits flip near-ties): that keeps top-1 agreement near 100% at a small cost in speed."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from cache import native

GROUP = 32  # Q4_1's group size along the input dimension
DOT_BLOCK = 16  # outputs per block of the native int4 kernel's layout
DECODE_ROWS = 8  # at most this many rows go to the output layer's int8 kernel (decode); more use the float matmul
ACT = torch.bfloat16  # the activation dtype torch's fast int4/int8 CPU kernels take (float32 falls back to a slow path)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).to(ACT)


class Int4Linear(nn.Module):
    """Group-wise asymmetric 4-bit weights: w = code * scale + minimum per group of `group` inputs.
    Exact for weights that came from GGUF Q4_1 (codes are recovered, not re-rounded).

    Two layouts of the same codes. Where the native kernel runs on integer dot products (AVX-512 VNNI or AVX2,
    `native.q4_fast()`), its own (`dot`): activations are quantized per group in two int8 levels and
    multiplied by the codes with vpdpbusd (AVX2: vpmaddubsw), scales and minimums kept as float16 (exact for Q4_1, which
    stores them so). Elsewhere torch's CPU int4 layout and `_weight_int4pack_mm_for_cpu`, which widens
    every code to a float and takes bfloat16 activations: about 3x the instructions per weight."""

    def __init__(self, linear: nn.Linear, group: int = GROUP, dot: bool | None = None):
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
        fits = group == GROUP and out_features % DOT_BLOCK == 0
        self.dot = (native.q4_fast() if dot is None else dot) and fits
        if self.dot:
            packed, scales_zeros = _dot_layout(codes, scale.squeeze(-1), low.squeeze(-1))
        else:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
            # The kernel computes (code - 8) * scale + zero, in [in_features // group, out_features, 2] layout.
            zero = low + 8 * scale
            scales_zeros = torch.stack([scale.squeeze(-1).t(), zero.squeeze(-1).t()], -1).to(ACT).contiguous()
        self.register_buffer("packed", packed)
        self.register_buffer("scales_zeros", scales_zeros)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.product(x, self.packed, self.scales_zeros, self.group, self.dot)
        return y if self.bias is None else y + self.bias

    @staticmethod
    def product(x: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor, group: int, dot: bool) -> torch.Tensor:
        """x times packed int4 weights (the dot layout or torch's), in x's dtype and shape but the last axis."""
        if dot:
            y = native.q4_matmul(x.reshape(-1, x.shape[-1]), packed, scales_zeros)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(_rows(x), packed, group, scales_zeros)
        return y.to(x.dtype).reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def fuse(modules: list["Int4Linear"]) -> "Int4Fused | None":
        """One product for int4 layers that read the same input, its output split back into theirs; each
        module's codes (and, in the dot layout, its scales) become views into the concatenation, so nothing
        is held twice. None where they do not concatenate: bias, another group size or layout, or torch's
        layout with outputs that are not a multiple of the 64 rows it packs a block."""
        first = modules[0]
        if any(m.bias is not None or m.group != first.group or m.dot != first.dot for m in modules):
            return None
        if not first.dot and any(m.out_features % 64 for m in modules):
            return None
        sizes = [m.out_features for m in modules]
        packed = torch.cat([m.packed for m in modules])
        rows = [size // DOT_BLOCK for size in sizes] if first.dot else sizes
        for module, part in zip(modules, packed.split(rows)):
            module.packed = part
        if first.dot:  # [blocks, groups, 2, 16]: outputs first, so the scales split into views too
            scales = torch.cat([m.scales_zeros for m in modules])
            for module, part in zip(modules, scales.split(rows)):
                module.scales_zeros = part
        else:  # [groups, outputs, 2]: a small copy
            scales = torch.cat([m.scales_zeros for m in modules], dim=1).contiguous()
        return Int4Fused(packed, scales, sizes, first.group, first.dot)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, group={self.group}, "
                f"bias={self.bias is not None}, layout={'dot' if self.dot else 'torch'}")


@dataclass
class Int4Fused:
    """Int4 layers that read the same input as one product (`Int4Linear.fuse`), called like them in turn."""

    packed: torch.Tensor
    scales_zeros: torch.Tensor
    sizes: list[int]
    group: int
    dot: bool

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        return Int4Linear.product(x, self.packed, self.scales_zeros, self.group, self.dot).split(self.sizes, dim=-1)


def _dot_layout(codes: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """codes [n, k] (0..15), scale and minimum [n, k / 32] -> the native kernel's layout
    (agent/weight_kernels.c): per block of 16 outputs and group of 32 inputs, four 64-byte vectors whose
    byte 4 * o + j holds output o's codes for inputs 4 * v + j (low nibble) and 16 + 4 * v + j (high);
    scales [n / 16, k / 32, 2, 16] float16, the block's scales then its minimums."""
    n, k = codes.shape
    parts = codes.to(torch.uint8).reshape(n // DOT_BLOCK, DOT_BLOCK, k // GROUP, 2, 4, 4)  # block, output, group, half, v, j
    packed = (parts[:, :, :, 0] | parts[:, :, :, 1] << 4).permute(0, 2, 3, 1, 4).reshape(n // DOT_BLOCK, k * 8)
    scales = torch.stack([scale, low], -1).reshape(n // DOT_BLOCK, DOT_BLOCK, k // GROUP, 2).permute(0, 2, 3, 1)
    return packed.contiguous(), scales.to(torch.float16).contiguous()


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


def quantize_linear(model: nn.Module, kind: str, skip: tuple[str, ...] = ("lm_head",), dot: bool | None = None) -> nn.Module:
    """Replace every nn.Linear (except those named in `skip`, and any the kernel's shapes rule out) with
    the `kind` module, in place; returns the model. `dot` picks int4's layout (None: the native kernel's
    where it runs on integer dot products)."""
    cls = KINDS[kind]
    options = {"dot": dot} if kind == "int4" else {}
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            full = f"{parent_name}.{name}" if parent_name else name
            if type(child) is nn.Linear and full not in skip and name not in skip:
                if kind == "int4" and child.in_features % GROUP:
                    continue
                setattr(parent, name, cls(child, **options))
    return model


def module_bytes(module: nn.Module) -> int:
    """Bytes held by a module's parameters and buffers."""
    tensors = list(module.parameters()) + list(module.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)
