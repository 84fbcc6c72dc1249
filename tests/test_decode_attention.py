"""One decode token's attention in the native kernel (cache/attention_kernels.c): the same output as SDPA and
the same attention mass as `attention_mass`, over strided views of a store, for GQA and plain heads, the
vector code's head size and any other, split over threads or not."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cache import native
from cache.attention import attend, attention_mass


def layer_views(heads: int, tokens: int, dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A query and key / value views of the first `tokens` of a larger buffer, as a store holds them."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(1, heads, tokens + 37, dim, generator=g) * torch.linspace(0.5, 6.0, dim)
    values = torch.randn(1, heads, tokens + 37, dim, generator=g)
    return torch.randn(1, 9 if heads == 3 else heads, 1, dim, generator=g), keys[:, :, :tokens], values[:, :, :tokens]


@pytest.mark.parametrize("tokens", [1, 5, 31, 64, 65, 700])
@pytest.mark.parametrize("heads,dim", [(3, 64), (3, 16), (4, 64)], ids=["gqa-64", "gqa-16", "mha-64"])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_one_token_attention_equals_sdpa_and_its_mass(tokens, heads, dim, threads):
    query, keys, values = layer_views(heads, tokens, dim, seed=tokens + dim)
    assert not keys.is_contiguous()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        done = native.attend_one(query, keys, values, dim**-0.5, want_mass=True)
    finally:
        torch.set_num_threads(before)
    assert done is not None
    out, mass = done
    want = F.scaled_dot_product_attention(query, keys, values, enable_gqa=query.shape[1] != heads).transpose(1, 2)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mass, attention_mass(query, keys, None, dim**-0.5), rtol=1e-5, atol=1e-6)
    assert native.attend_one(query, keys, values, dim**-0.5, want_mass=False)[1] is None


def test_attend_takes_the_kernel_for_one_float32_token_and_sdpa_otherwise():
    """Same answers either way; bfloat16 KV and several queries are SDPA's, layouts it cannot read are refused."""
    query, keys, values = layer_views(3, 200, 64, seed=1)
    want = F.scaled_dot_product_attention(query, keys, values, enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(attend(query, keys, values, None, None), want, rtol=1e-5, atol=1e-5)
    half = attend(query.bfloat16(), keys.bfloat16(), values.bfloat16(), None, None)
    torch.testing.assert_close(half.float(), want, rtol=0.05, atol=0.05)
    assert native.attend_one(query, keys.transpose(2, 3), values.transpose(2, 3), 0.125, want_mass=False) is None


def test_one_bfloat16_query_is_attended_in_float32_and_rounded_once():
    """A bfloat16 decode step's attention on the CPU is float32 SDPA over the same bfloat16 numbers, rounded
    to bfloat16 once at the end (torch's bfloat16 kernel is five times slower for one query); several
    queries stay in bfloat16 SDPA."""
    query, keys, values = (t.bfloat16() for t in layer_views(3, 300, 64, seed=3))
    exact = F.scaled_dot_product_attention(query.float(), keys.float(), values.float(), enable_gqa=True)
    out = attend(query, keys, values, None, None)
    assert out.dtype == torch.bfloat16 and torch.equal(out, exact.transpose(1, 2).bfloat16())
    many = torch.cat([query, query * 0.5], dim=2)
    rows = attend(many, keys, values, torch.ones(1, 1, 2, 300, dtype=torch.bool), None)
    assert rows.dtype == torch.bfloat16
    torch.testing.assert_close(rows[:, :1].float(), out.float(), rtol=0.02, atol=0.02)


def test_heads_the_kernel_has_no_dense_code_for_stay_with_sdpa(monkeypatch):
    """attend() takes the kernel for one float32 query over 64-wide heads (its vector code) where it is
    fast, and SDPA for other head sizes; both give SDPA's answer."""
    calls, kernel = [], native.attend_one
    monkeypatch.setattr(native, "attend_one", lambda *args, **kwargs: calls.append(args[1].shape[-1]) or kernel(*args, **kwargs))
    for dim in (16, 64):
        query, keys, values = layer_views(3, 50, dim, seed=2)
        want = F.scaled_dot_product_attention(query, keys, values, enable_gqa=True).transpose(1, 2)
        torch.testing.assert_close(attend(query, keys, values, None, None), want, rtol=1e-5, atol=1e-5)
    assert calls == ([64] if native.attend_fast() else [])
