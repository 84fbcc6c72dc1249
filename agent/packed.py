"""Linear layers whose weights are laid out once for products of a few dozen rows, on the CPU: a bfloat16
weight packed into oneDNN's blocked layout (`PackedLinear`), or a float32 layer's weight read as bfloat16
by the project's kernel (`WidenedLinear`).

`PackedLinear`, why: for a bfloat16 weight, `F.linear` lays the weight out for oneDNN on every call. At a few dozen rows
(a user's turn, a decode step, an embedded sentence) that costs more than the product: a 27-row product
with a 1152 x 384 weight took 84 us against 31 packed, a 30-row one with a 1536 x 576 weight 326 against
167 (one thread, the README's AMX Xeon); at 1,100 rows the two are level. Not the same bits: oneDNN may
sum some shapes in another order (about what another CPU gives). The packed copy is held beside the
weight, which the reference paths (transformers' forward, the tests) still read: a bfloat16 model's
linear weights are held twice. float32 weights, other devices, builds without oneDNN, and CPUs where oneDNN
cannot reorder bfloat16 (it needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT: an AVX2-only AMD EPYC raised) keep
`F.linear`."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cache import native

PACK_ROWS = 32  # oneDNN's hint for the activations' row count


class PackedLinear:
    """`F.linear(x, weight, bias)`, packed where that pays (a bfloat16 weight on the CPU)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight, self.bias, self.packed = weight.detach(), None if bias is None else bias.detach(), None
        if packable(self.weight):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, PACK_ROWS)

    @classmethod
    def of(cls, module: torch.nn.Linear) -> "PackedLinear":
        return cls(module.weight, module.bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None or x.dtype != self.weight.dtype:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def packable(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and torch.backends.mkldnn.is_available() \
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and torch.cpu._is_avx512_supported()


class WidenedLinear:
    """`F.linear(x, weight, bias)` for float32 rows, the weight rounded to bfloat16 and widened back in
    registers (cache/native.py `w16_matmul`). Why: on a CPU without bfloat16 arithmetic (the AVX2-only EPYC),
    a sentence's few dozen rows are bound by reading float32 weights; the embedder's 24 products at 16 rows
    took 6.2 ms with MKL and 2.3 ms so (2 threads; 8.2 against 4.3 at 32 rows, level at 512). Rounding the
    weights moves an embedding by cosine 0.99999 on average (1,200 development messages; a float32 pass in
    bfloat16 throughout moves it by 0.99995)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.out_features, self.in_features = weight.shape
        self.packed = native.w16_pack(weight)
        self.bias = None if bias is None else bias.detach().float().contiguous()

    @classmethod
    def of(cls, module: torch.nn.Linear) -> "WidenedLinear":
        return cls(module.weight, module.bias)

    @staticmethod
    def fits(weight: torch.Tensor) -> bool:
        """Whether the kernel takes this float32 weight here (CPU, kernels built, whole output blocks)."""
        return weight.dtype == torch.float32 and native.available(weight) \
            and weight.shape[0] % native.library().w16_block() == 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = native.w16_matmul(x.reshape(-1, self.in_features), self.packed, self.bias)
        return rows.reshape(*x.shape[:-1], self.out_features)
