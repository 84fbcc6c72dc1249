"""The native int4 kernels (agent/weight_kernels.c through cache/native.py) against float math: the dot
layout's product with activations quantized per group in two int8 levels, and the calls that fold a
layer's RMS norm, rotation, SwiGLU and residual adds around it, against the same steps done by torch."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from agent.qlinear import Int4Linear
from cache import native

HEAD_DIM = 16


def q4_weights(n: int, k: int, seed: int) -> torch.Tensor:
    """Weights that GGUF Q4_1 holds exactly: codes 0..15 times a float16 scale plus a float16 minimum per
    group of 32 inputs, each group spanning all 16 codes as Q4_1's (max - min) / 15 makes it."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k // 32, 32), generator=g).float()
    codes[..., 0], codes[..., 1] = 0, 15
    scale = (torch.rand(n, k // 32, 1, generator=g) * 0.05 + 1e-3).half().float()
    low = (-torch.rand(n, k // 32, 1, generator=g) * 0.4).half().float()
    return (codes * scale + low).reshape(n, k)


def int4(weight: torch.Tensor) -> Int4Linear:
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    linear.weight.data.copy_(weight)
    return Int4Linear(linear, dot=True)


def activations(rows: int, k: int, seed: int) -> torch.Tensor:
    """Activations with this model's kind of outliers: one channel a thousand times the rest."""
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed))
    x[:, 7] *= 1000
    return x


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 9])
def test_dot_layout_multiplies_like_float_math(rows):
    """Rows in tiles of four and the rest one by one; the error is that of quantizing activations twice
    (about 1/127^2 of each group's largest value), under that of rounding them to bfloat16."""
    weight = q4_weights(48, 96, seed=rows)
    layer = int4(weight)
    assert layer.dot and layer.packed.dtype == torch.uint8 and layer.scales_zeros.dtype == torch.float16
    x = activations(rows, 96, seed=10 + rows)
    want = x.double() @ weight.double().t()
    got = layer(x)
    assert got.shape == (rows, 48) and got.dtype == torch.float32
    error = (got.double() - want).abs().max()
    assert error / (x.abs().double() @ weight.abs().double().t()).max() < 1e-4
    assert error < (x.bfloat16().double() @ weight.double().t() - want).abs().max()  # torch's layout rounds to bfloat16


def test_the_embedded_weights_come_back_exactly(embedded):
    """GGUF Q4_1 weights: codes, scales and minimums are recovered exactly (float16 holds them); the
    identity's rows are quantized without loss, so the product gives back the weights themselves."""
    linear = embedded.model.model.layers[3].mlp.gate_proj
    layer = Int4Linear(linear, dot=True)
    with torch.inference_mode():
        recovered = layer(torch.eye(linear.in_features)).t()
    assert torch.equal(recovered, linear.weight.detach())
    assert torch.equal(native.q4_dense(layer.packed, layer.scales_zeros), linear.weight.detach())  # prefill's unpacking


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def assert_near(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal but for a level of the activations' quantization that a rounding difference moved by one step."""
    torch.testing.assert_close(got, want, rtol=0, atol=float(want.abs().max()) * 1e-3)


def test_norm_rotation_and_residual_fold_into_one_call():
    rows, k, heads = 5, 64, 4  # outputs: 2 rotated heads (queries, keys), then 2 that are not (values)
    layer = int4(q4_weights(heads * HEAD_DIM, k, seed=1))
    x, weight = activations(rows, k, seed=2), torch.rand(k) + 0.5
    angles = torch.rand(rows, HEAD_DIM // 2) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    got = native.q4_matmul(x, layer.packed, layer.scales_zeros, norm=(weight, 1e-5),
                           rotary=(cos, sin, 2 * HEAD_DIM, HEAD_DIM))
    plain = native.q4_matmul(rms_norm(x, weight, 1e-5), layer.packed, layer.scales_zeros)
    heads_first = plain.view(1, rows, heads, HEAD_DIM).transpose(1, 2)
    turned, _ = apply_rotary_pos_emb(heads_first[:, :2], heads_first[:, :2], cos[None], sin[None])
    want = torch.cat([turned, heads_first[:, 2:]], dim=1).transpose(1, 2).reshape(rows, -1)
    assert_near(got, want)
    residual = torch.randn(rows, heads * HEAD_DIM)
    assert_near(native.q4_matmul(x, layer.packed, layer.scales_zeros, residual=residual),
                residual + native.q4_matmul(x, layer.packed, layer.scales_zeros))


def test_a_layer_after_attention_is_one_call():
    """o projection and residual, RMS norm, gate and up, SwiGLU, down and residual: q4_mlp against the steps."""
    rows, d, ff = 3, 64, 96
    o, down = int4(q4_weights(d, d, seed=3)), int4(q4_weights(d, ff, seed=4))
    gate_up = Int4Linear.fuse([int4(q4_weights(ff, d, seed=5)), int4(q4_weights(ff, d, seed=6))])
    attended, stream, weight = activations(rows, d, seed=7), torch.randn(rows, d), torch.rand(d) + 0.5
    got = native.q4_mlp(attended, stream, (o.packed, o.scales_zeros), (weight, 1e-5),
                        (gate_up.packed, gate_up.scales_zeros), (down.packed, down.scales_zeros))
    middle = stream + o(attended)
    gate, up = gate_up(rms_norm(middle, weight, 1e-5))
    assert_near(got, middle + down(nn.functional.silu(gate) * up))
    swiglu = native.q4_matmul(torch.cat([gate, up], -1), down.packed, down.scales_zeros, swiglu=True)
    assert_near(swiglu, down(nn.functional.silu(gate) * up))


def test_float_layer_glue_equals_torch_ops():
    """The float32 layer's glue (agent/lean._float_layer): RMS norm and SwiGLU in one call each, the rotation
    of queries and keys in place, against the ops they replace."""
    from agent.lean import _rms_norm

    x, weight = torch.randn(3, 64), torch.rand(64) + 0.5
    torch.testing.assert_close(native.prepare_rows(x, norm=(weight, 1e-5)), _rms_norm(x, weight, 1e-5), rtol=1e-6, atol=1e-6)
    gate_up = torch.randn(3, 128)
    torch.testing.assert_close(native.prepare_rows(gate_up, swiglu=True),
                               nn.functional.silu(gate_up[:, :64]) * gate_up[:, 64:], rtol=1e-6, atol=1e-6)
    rows, heads = 3, 4
    out = torch.randn(rows, heads * HEAD_DIM)
    angles = torch.rand(rows, HEAD_DIM // 2) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    heads_first = out.view(1, rows, heads, HEAD_DIM).transpose(1, 2)
    turned, _ = apply_rotary_pos_emb(heads_first[:, :2], heads_first[:, :2], cos[None], sin[None])
    want = torch.cat([turned, heads_first[:, 2:]], dim=1).transpose(1, 2).reshape(rows, -1)
    native.rotate_rows(out, cos, sin, 2 * HEAD_DIM, HEAD_DIM)
    assert torch.equal(out, want)  # the same products and sum, in the same order
