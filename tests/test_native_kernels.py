"""The C kernels for quantized KV (cache/native.py, issue 13) against the dense dequantized matmul on the
same codes: keys' scores and values' weighted sums for the query counts decode and scoring use, on a chunk
cut out of a longer tier (a view with the whole tier's head stride), through the vector path (SmolLM2's
head_dim 64, value channel groups of 32) and the scalar one (head_dim 20), with rows as a compaction leaves
them (a scattered subset of their groups, owing different shifts); built on this machine, with a one-line
fallback when no compiler works."""

from __future__ import annotations

import pytest
import torch

from cache import native
from cache.quant import Tier

TOKENS = 1024


def tier(kind: str, dim: int, seed: int) -> Tier:
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randn(3, TOKENS, dim, generator=generator) * torch.linspace(0.5, 6.0, dim)
    held = Tier(kind, group=32, channel_group=32)
    held.append(keys, torch.randn(3, TOKENS, dim, generator=generator))
    return held


def compacted(held: Tier, seed: int) -> Tier:
    """Keep a random two thirds of the rows, each owing one of a few shifts, as repeated compactions leave them."""
    generator = torch.Generator().manual_seed(seed)
    kept = torch.sort(torch.randperm(held.length, generator=generator)[: 2 * held.length // 3]).values
    dim = held.rows.key_scale.shape[-1]
    inv_freq = 1.0 / 10000 ** (torch.arange(0, dim, 2) / dim)
    held.install(held.rows.select(kept).shifted(-torch.randint(0, 4, (len(kept),), generator=generator) * 37, inv_freq))
    return held


def test_the_kernels_build_on_this_machine():
    assert native.library() is not None
    assert native.available(torch.zeros(1))


@pytest.mark.parametrize("moved", [False, True])
@pytest.mark.parametrize("dim", [64, 20])
@pytest.mark.parametrize("kind", ["int8", "int4", "fp8"])
def test_kernels_equal_the_dense_matmul_on_the_same_codes(kind, dim, moved):
    held = tier(kind, dim, seed=len(kind) + dim)
    if moved:
        held = compacted(held, seed=dim)
        assert held.rows.key_shift.unique().numel() == 4
    chunk = held.chunk(100, 612)  # a view: codes of other tokens around it
    assert not chunk.rows.keys.is_contiguous()
    dense_keys, dense_values = chunk.dense()
    generator = torch.Generator().manual_seed(3)
    for rows in (1, 3, 4, 7, 32):
        grouped = torch.randn(3, rows, dim, generator=generator)
        weights = torch.rand(3, rows, 512, generator=generator)
        want_scores, want_sums = grouped @ dense_keys.transpose(-1, -2), weights @ dense_values
        got_scores, got_sums = chunk.scores(grouped), chunk.weighted(weights)
        assert got_scores.shape == want_scores.shape and got_sums.shape == want_sums.shape
        torch.testing.assert_close(got_scores, want_scores, rtol=1e-4, atol=1e-4 * float(want_scores.abs().max()))
        torch.testing.assert_close(got_sums, want_sums, rtol=1e-4, atol=1e-4 * float(want_sums.abs().max()))


def test_a_new_build_replaces_the_stale_ones_beside_it(monkeypatch, tmp_path):
    monkeypatch.setenv("PALACE_CACHE", str(tmp_path))
    stale = [native.library_path().with_name(name) for name in ("kernels-0123456789abcdef.so", "quant_kernels-0123456789abcdef.so")]
    stale[0].parent.mkdir(parents=True)
    for path in stale:
        path.write_bytes(b"an older build")  # of other sources, or from before the library held more than KV kernels
    native.build(native.library_path())
    assert [p.name for p in stale[0].parent.iterdir()] == [native.library_path().name]


def test_without_a_compiler_attention_keeps_torch_ops_and_says_why_once(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("PALACE_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    native.library.cache_clear()
    try:
        assert native.library() is None and not native.available(torch.zeros(1))
        assert native.library() is None
        message = capsys.readouterr().err.strip().splitlines()
        assert len(message) == 1 and "native KV kernels unavailable" in message[0]
        chunk = compacted(tier("int8", 64, seed=1), seed=2).chunk(0, 512)
        grouped = torch.randn(3, 3, 64)
        torch.testing.assert_close(chunk.scores(grouped), grouped @ chunk.dense()[0].transpose(-1, -2))
        assert not list(tmp_path.glob("native/*.so"))  # no half-built library left behind
    finally:
        native.library.cache_clear()


def test_palace_native_0_turns_them_off(monkeypatch):
    monkeypatch.setenv("PALACE_NATIVE", "0")
    native.library.cache_clear()
    try:
        assert not native.available(torch.zeros(1))
    finally:
        native.library.cache_clear()


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16"])
def test_compaction_in_place_equals_torch_gather_and_rotation(monkeypatch, kv_dtype):
    """Two stores fed the same tokens by a tiny GQA Llama, then the same scattered evictions: one compacts
    through the C kernel in place, the other through torch ops (PALACE_NATIVE=0 while it compacts). Same tokens, same
    positions, keys within float rounding (bfloat16: bit for bit, one rounding of a float32 rotation in
    both), values exactly; the logits of a next forward agree."""
    from agent.engine import forward
    from cache.storage import StorageConfig
    from tests.helpers import store_for, tiny_llama

    model = tiny_llama(seed=5)
    ids = torch.randint(0, 512, (160,), generator=torch.Generator().manual_seed(5)).tolist()
    evictions = [torch.tensor([0, 3, 4, 50, 51, 52, 90]), torch.arange(20, 40), torch.tensor([1, 2, 100, 110])]
    calls, kernel = [], native.compact_rows
    monkeypatch.setattr(native, "compact_rows", lambda *args: calls.append(args[0][0][0].dtype) or kernel(*args))

    def native_on(on: bool) -> None:
        monkeypatch.setenv("PALACE_NATIVE", "1" if on else "0")
        native.library.cache_clear()

    def run(use_native: bool):  # only the compactions differ: the forwards run the same (native) path
        native_on(True)
        store = store_for(model, storage=StorageConfig(kv_dtype))
        forward(model, store, ids)
        native_on(use_native)
        for drop in evictions:
            kept = torch.ones(store.length, dtype=torch.bool)
            kept[drop] = False
            store.keep(torch.nonzero(kept).flatten())
        native_on(True)
        return store, [layer.storage.fetch() for layer in store.layers], forward(model, store, ids[:5])

    try:
        fast, fast_kv, fast_logits = run(True)
        assert len(calls) == len(evictions)  # every compaction in C, all its layers in one call
        slow, slow_kv, slow_logits = run(False)
        assert len(calls) == len(evictions)
    finally:
        native.library.cache_clear()
    assert fast.length == slow.length == 160 - 31 + 5
    assert torch.equal(fast.meta.serial, slow.meta.serial) and torch.equal(fast.meta.position, slow.meta.position)
    for (fast_keys, fast_values), (slow_keys, slow_values) in zip(fast_kv, slow_kv):
        assert torch.equal(fast_values, slow_values)
        if kv_dtype == "bfloat16":
            assert torch.equal(fast_keys, slow_keys)
        else:
            torch.testing.assert_close(fast_keys, slow_keys, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(fast_logits, slow_logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16"])
def test_a_splice_at_the_end_written_in_place_equals_torch_rotation_and_append(monkeypatch, kv_dtype):
    """The same evictions (handed to a sink) and the same splices back at the end, in two stores fed alike by
    a tiny GQA Llama: one through the C kernels (the evicted rows of all layers in one gather a side, the
    spliced rows turned and written straight into each layer), the other through torch ops (PALACE_NATIVE=0
    while it evicts and splices). Same spans, same tokens and positions, keys within float rounding
    (bfloat16: bit for bit), values exactly; the logits of a next forward agree."""
    from agent.engine import forward
    from cache.storage import StorageConfig
    from tests.helpers import store_for, tiny_llama

    model = tiny_llama(seed=6)
    ids = torch.randint(0, 512, (150,), generator=torch.Generator().manual_seed(6)).tolist()
    calls = []
    for name in ("place_rows", "gather_layer_rows"):
        kernel = getattr(native, name)
        monkeypatch.setattr(native, name, lambda *args, _k=kernel, _n=name: calls.append(_n) or _k(*args))

    def native_on(on: bool) -> None:
        monkeypatch.setenv("PALACE_NATIVE", "1" if on else "0")
        native.library.cache_clear()

    def run(use_native: bool):
        native_on(True)
        store = store_for(model, storage=StorageConfig(kv_dtype))
        forward(model, store, ids)
        native_on(use_native)
        evicted = []
        store.on_evict = evicted.append
        for drop in (torch.tensor([2, 3, 40, 41, 42, 97]), torch.arange(10, 30)):
            kept = torch.ones(store.length, dtype=torch.bool)
            kept[drop] = False
            store.keep(torch.nonzero(kept).flatten())
        store.on_evict = None
        spans = [span.state() for span in evicted]
        store.inject(evicted[1:3], turn=1)
        store.inject(evicted[0], turn=2)
        native_on(True)
        return store, spans, [layer.storage.fetch() for layer in store.layers], forward(model, store, ids[:5])

    try:
        fast, fast_spans, fast_kv, fast_logits = run(True)
        assert calls.count("gather_layer_rows") == 2 * 2 and calls.count("place_rows") == 2  # all layers in one call
        slow, slow_spans, slow_kv, slow_logits = run(False)
        assert len(calls) == 4 + 2
    finally:
        native.library.cache_clear()
    same_keys = torch.equal if kv_dtype == "bfloat16" else \
        (lambda a, b: torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6) is None)  # the compactions' rotations
    for fast_span, slow_span in zip(fast_spans, slow_spans, strict=True):
        assert same_keys(fast_span["keys"], slow_span["keys"]) and torch.equal(fast_span["values"], slow_span["values"])
    assert fast.length == slow.length == 150 + 5
    assert torch.equal(fast.meta.serial, slow.meta.serial) and torch.equal(fast.meta.position, slow.meta.position)
    for (fast_keys, fast_values), (slow_keys, slow_values) in zip(fast_kv, slow_kv):
        assert torch.equal(fast_values, slow_values) and same_keys(fast_keys, slow_keys)
    torch.testing.assert_close(fast_logits, slow_logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dim", [64, 520])
def test_spliced_layers_equal_torch_rotation_then_append_to_the_bit(dim):
    """`place_layers` against the path it replaced (`Rerotator.shift`, out of place, then `append`, a layer at a
    time) on two layers of 12,000 random bfloat16 keys each, turned by scattered deltas, into layers holding
    different lengths (so their buffers' head strides differ too): bit for bit (a kernel that rounds the
    rotation another way moves about one key element in 100,000 by a bfloat16 step, which a small model rarely
    shows); for SmolLM2's head size and for one wider than the kernel's vectorized buffers (its element-wise
    path)."""
    from cache.rope import Rerotator
    from cache.storage import ContiguousStorage, place_layers

    generator = torch.Generator().manual_seed(8)
    held = [(torch.randn(1, 3, length, dim, generator=generator) * 3).bfloat16() for length in (100, 37)]
    keys, values = ((torch.randn(2, 3, 4000, dim, generator=generator) * 3).bfloat16() for _ in range(2))
    delta = torch.randint(-900, 900, (4000,), generator=generator)
    delta[::7] = 0
    rerotator = Rerotator(1.0 / 10000 ** (torch.arange(0, dim, 2) / dim))
    rotation = rerotator.rotation(delta)
    fast, slow = [ContiguousStorage(), ContiguousStorage()], [ContiguousStorage(), ContiguousStorage()]
    for pair in (fast, slow):
        for storage, rows in zip(pair, held):
            storage.append(rows, rows)
    assert place_layers(fast, keys, values, rotation, delta != 0)
    assert fast[0].keys.stride(1) != fast[1].keys.stride(1)
    for layer, storage in enumerate(slow):
        storage.append(rerotator.shift(keys[layer][None], rotation), values[layer][None])
    for fast_layer, slow_layer in zip(fast, slow):
        assert torch.equal(fast_layer.fetch()[0], slow_layer.fetch()[0])
        assert torch.equal(fast_layer.fetch()[1], slow_layer.fetch()[1])


def bf16_glue_inputs(rows: int, seed: int) -> tuple[torch.Tensor, ...]:
    """A stream with a few outlier columns (this model's activations reach the thousands), its norm's weight,
    a gate-and-up product, and queries, keys and values with the rotary angles of `rows` positions."""
    generator = torch.Generator().manual_seed(seed)
    stream = torch.randn(rows, 576, generator=generator) * torch.rand(576, generator=generator) * 4
    stream[:, [7, 300]] *= 400
    angles = torch.arange(rows)[:, None] * (1.0 / 10000 ** (torch.arange(0, 64, 2) / 64))[None]
    turn = torch.cat([angles, angles], dim=-1)
    return (stream.bfloat16(), torch.randn(576, generator=generator).bfloat16(),
            (torch.randn(rows, 2 * 1536, generator=generator) * 3).bfloat16(),
            torch.randn(rows, 15 * 64, generator=generator).bfloat16(), turn.cos().bfloat16(), turn.sin().bfloat16())


def module_glue(stream, weight, gate_up, qkv, cos, sin) -> list[torch.Tensor]:
    """The same glue as the module path computes it (agent/lean.py's torch ops, transformers' order)."""
    from agent.lean import _rms_norm

    gate, up = gate_up.chunk(2, dim=-1)
    heads = qkv[:, : 12 * 64].reshape(-1, 12, 64)
    signed = torch.cat([-sin[:, :32], sin[:, 32:]], dim=-1)[:, None]
    turned = heads * cos[:, None] + heads.roll(32, dims=-1) * signed
    return [_rms_norm(stream, weight, 1e-5), torch.nn.functional.silu(gate) * up,
            torch.cat([turned.reshape(len(qkv), -1), qkv[:, 12 * 64:]], dim=-1)]


def native_glue(stream, weight, gate_up, qkv, cos, sin) -> list[torch.Tensor]:
    rotated = qkv.clone()
    native.bf16_rotate(rotated, cos.float(), sin.float(), 12 * 64, 64)
    return [native.bf16_rms_norm(stream, weight, 1e-5), native.bf16_swiglu(gate_up), rotated]


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_bfloat16_glue_equals_the_module_ops_bit_for_bit(rows):
    """The bfloat16 RMS norm (its mean summed in aten's order), SwiGLU and rotation of queries and keys
    (agent/bf16_glue.c), which the lean forward runs where the module path ran torch's ops, give the same
    bits: the eval's probes do not move by a margin when the kernels take over."""
    inputs = bf16_glue_inputs(rows, seed=rows)
    for got, want in zip(native_glue(*inputs), module_glue(*inputs), strict=True):
        assert torch.equal(got, want)



def widened_case(rows: int, k: int = 96, n: int = 64, seed: int = 0) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=generator) * 0.05
    return torch.randn(rows, k, generator=generator) * 3, weight, torch.randn(n, generator=generator)


def assert_widened_product(rows: int, seed: int) -> None:
    """w16_matmul equals the float32 product with the weight rounded to bfloat16, with a bias and without."""
    x, weight, bias = widened_case(rows, seed=seed)
    rounded = weight.to(torch.bfloat16).double()
    packed = native.w16_pack(weight)
    assert packed.dtype == torch.bfloat16 and packed.numel() == weight.numel()
    scale = float((x.abs().double() @ rounded.abs().t()).max())
    for shift in (bias, None):
        want = x.double() @ rounded.t() + (0 if shift is None else shift.double())
        assert float((native.w16_matmul(x, packed, shift).double() - want).abs().max()) < 1e-6 * scale


@pytest.mark.parametrize("rows", [1, 5, 6, 7, 13, 64])
def test_widened_weights_give_the_float32_product_of_the_rounded_weights(rows):
    """The embedder's products on a CPU without bfloat16 arithmetic (agent/packed.py WidenedLinear): every
    row count (whole tiles of six rows and the remainders) gives the product of the rounded weights, and not
    the float32 weights' own product."""
    assert_widened_product(rows, seed=rows)
    x, weight, _ = widened_case(rows, seed=rows)
    assert not torch.allclose(native.w16_matmul(x, native.w16_pack(weight)), x @ weight.t(), rtol=0, atol=1e-6)



def q4_1_weight(n: int = 64, k: int = 96, seed: int = 0) -> torch.Tensor:
    """A float32 weight that is exactly GGUF Q4_1: per 32 inputs a float16 scale and minimum, codes 0..15 (both
    ends used, as the GGUF quantizer leaves them)."""
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k // 32, 32), generator=generator).float()
    codes[..., 0], codes[..., 1] = 0, 15
    scale = (torch.rand(n, k // 32, 1, generator=generator) * 0.01 + 1e-3).half().float()
    low = (torch.randn(n, k // 32, 1, generator=generator) * 0.05).half().float()
    return (codes * scale + low).reshape(n, k)


def assert_q4f_product(rows: int, seed: int) -> None:
    """q4f_matmul equals the float32 product of the weight it packs (exactly Q4_1), with a bias and a residual
    and without."""
    weight = q4_1_weight(seed=seed)
    generator = torch.Generator().manual_seed(seed + 100)
    x, bias, residual = torch.randn(rows, 96, generator=generator) * 3, torch.randn(64, generator=generator), \
        torch.randn(rows, 64, generator=generator)
    packed = native.q4f_pack(weight)
    assert packed is not None and packed[0].dtype == torch.uint8 and packed[0].numel() == weight.numel() // 2
    scale = float((x.abs().double() @ weight.abs().double().t()).max())
    for shift, added in ((None, None), (bias, None), (None, residual), (bias, residual)):
        want = x.double() @ weight.double().t() + (0 if shift is None else shift.double()) + (0 if added is None else added.double())
        got = native.q4f_matmul(x, *packed, bias=shift, residual=added)
        assert float((got.double() - want).abs().max()) < 1e-6 * scale


@pytest.mark.parametrize("rows", [1, 5, 6, 7, 13, 64])
def test_q4_1_codes_give_the_float32_product_of_the_weights_they_hold(rows):
    """The float32 layers' products (agent/lean._product): a weight that is exactly Q4_1 read from its codes gives
    its own float32 product at every row count (one tile, widened in registers; more, through a widened buffer);
    a weight that is not Q4_1 is not packed (it would be another product)."""
    assert_q4f_product(rows, seed=rows)
    weight = q4_1_weight(seed=rows)
    weight[3, 7] += 1e-4
    assert native.q4f_pack(weight) is None
    assert native.q4f_pack(q4_1_weight(n=native.library().w16_block() * 3 // 2)) is None  # whole blocks only


# Each instruction set the kernels have code for, built on this (x86) machine by turning the wider ones off:
# CI's CPU runs one of them natively, the others here. (name, compiler flags, integer dots, vector code)
INSTRUCTION_SETS = [("avx2", ["-mno-avx512f"], True, True), ("scalar", ["-mno-avx512f", "-mno-avx2"], False, False)]


@pytest.mark.parametrize("name,flags,dots,vector", INSTRUCTION_SETS, ids=[s[0] for s in INSTRUCTION_SETS])
def test_every_instruction_set_gives_the_same_products(monkeypatch, tmp_path, name, flags, dots, vector):
    """The weight and attention kernels built for AVX2 (no AVX-512) and for no vector unit at all: each
    reports what it runs fast, and its int4, int8, bfloat16-weight, Q4_1-code, SwiGLU and one-token attention results
    match float math, and its bfloat16 glue torch's ops."""
    import torch.nn.functional as F

    from tests.test_decode_attention import layer_views
    from tests.test_int4_kernels import activations, int4, q4_weights

    wrapper = tmp_path / "cc"
    wrapper.write_text(f'#!/bin/sh\nexec {native.compiler()} "$@" {" ".join(flags)}\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("PALACE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(wrapper))
    native.library.cache_clear()
    try:
        assert native.library() is not None
        assert (native.q4_fast(), native.q8_fast(), native.attend_fast()) == (dots, vector, vector)
        weight, x = q4_weights(48, 96, seed=1), activations(5, 96, seed=2)
        layer = int4(weight)
        want = x.double() @ weight.double().t()
        error = (native.q4_matmul(x, layer.packed, layer.scales_zeros).double() - want).abs().max()
        assert error / (x.abs().double() @ weight.abs().double().t()).max() < 1e-4
        codes = torch.randint(-127, 128, (200, 96), generator=torch.Generator().manual_seed(3), dtype=torch.int8)
        scales = torch.rand(200, 3, generator=torch.Generator().manual_seed(4)) * 0.02
        dense = (codes.float().reshape(200, 3, 32) * scales[..., None]).reshape(200, 96)
        for rows in (1, 3):
            want = x[:rows] @ dense.T
            torch.testing.assert_close(native.q8_matmul(x[:rows], codes, scales), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
        gate_up = torch.randn(3, 2 * 40) * 4
        torch.testing.assert_close(native.prepare_rows(gate_up, swiglu=True), F.silu(gate_up[:, :40]) * gate_up[:, 40:],
                                   rtol=1e-6, atol=1e-6)
        query, keys, values = layer_views(3, 300, 64, seed=5)
        out, _ = native.attend_one(query, keys, values, 0.125, want_mass=True)
        want = F.scaled_dot_product_attention(query, keys, values, scale=0.125, enable_gqa=True).transpose(1, 2)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        inputs = bf16_glue_inputs(40, seed=6)
        for got, want in zip(native_glue(*inputs), module_glue(*inputs), strict=True):
            assert torch.equal(got, want)
        for rows in (1, 7):
            assert_widened_product(rows, seed=rows)
            assert_q4f_product(rows, seed=rows)
    finally:
        native.library.cache_clear()
