"""A lean forward of a Llama model over the managed stores, for prefill and decode alike.

Why: a 135M model decodes one token on a CPU in a few hundred small eager ops, and transformers' forward
adds per-call machinery around each (module hooks, kwargs plumbing and deprecation wrappers on every
layer, a mask built and thrown away, output dataclasses): without it, decode is 8 % (float32) to 15 %
(int4 weights) faster on the 2-core Xeon of the README. This is gpt-fast's shape:
the layer loop on one screen, calling the same modules' arithmetic directly (their `forward`, not
`__call__`), with attention done by the palace attention over each piece's store, as under
transformers. On the CPU the output layer reads int8 codes where they hold its weights exactly (the
embedded model's tied embedding was stored as GGUF Q8_0: agent/qlinear.Q8Head), a quarter of the bytes.
With int4 weights in the native layout, a decode token over float32 KV buffers goes through each layer in
one native call (products, the new key and value written in place, attention, MLP: `LeanLlama._step`), which
took int4 decode from 0.81x to 1.03x llama.cpp's pace on an AVX2 EPYC. In float32, the embedded model's
weights are read from the GGUF Q4_1 codes they exactly are (`_product`, `native.q4f_matmul`: an eighth of
the bytes, float32 sums), which took float32 decode from 26 to 67-69 tokens/s on that EPYC with the same
greedy tokens. The arithmetic is otherwise transformers' own, in its order (the rotation of queries and keys
is done for both at once, the same products and sums), so the logits agree to float rounding;
transformers' forward stays the reference path (`PALACE_LEAN=0`, and every family but Llama), and a
test holds the two to the same logits and greedy tokens."""

from __future__ import annotations

import functools
import os
import weakref
from dataclasses import dataclass
from typing import Callable

import torch

from agent.packed import PackedLinear
from agent.qlinear import DECODE_ROWS, Int4Linear, Q8Head
from cache import native
from cache.attention import Piece, palace_attention
from cache.storage import ContiguousStorage

FAMILIES = ("llama",)  # same layer shape as transformers' LlamaDecoderLayer, nothing added


class _Rotation:
    """One forward's rotary angles, in the form each layer kind reads, built on first use (the native
    layers never read torch's form, the module layers never the native one)."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor):
        self._cos, self._sin = cos, sin  # [1, n, head_dim], as the model's rotary embedding gives them

    @functools.cached_property
    def rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [n, head_dim] float32 per position, for the native kernels."""
        return self._cos[0].float().contiguous(), self._sin[0].float().contiguous()

    @functools.cached_property
    def heads(self) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [1, 1, n, head_dim] with sin negated in its first half: rotate_half(x) * sin is x
        rolled by half a head times that."""
        half = self._cos.shape[-1] // 2
        signed = torch.cat([-self._sin[..., :half], self._sin[..., half:]], dim=-1)
        return self._cos.unsqueeze(1), signed.unsqueeze(1)


@dataclass
class _Layer:
    """One decoder layer's arithmetic around attention, bound once. `before`: the stream's RMS norm, queries,
    keys and values in one product, queries and keys rotated ([1, heads, n, head_dim] each). `after`: the
    attention output's projection added to the stream, then the MLP of the normed stream added to it."""

    kind: str  # "dot" (native int4 kernels), "float" / "bf16" (native or torch's products, native glue), "modules"
    attention: torch.nn.Module  # for its layer_idx and scaling, which the palace attention reads
    before: Callable[[torch.Tensor, _Rotation], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    after: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (attention output, stream) -> stream
    step: native.Q4Layer | None = None  # the whole layer for one decode token in one native call, where it runs


def _heads(parts: list[torch.Tensor], head_dim: int) -> list[torch.Tensor]:
    """[1, n, heads * head_dim] pieces -> [1, heads, n, head_dim] views."""
    return [part.reshape(*part.shape[:-1], -1, head_dim).transpose(1, 2) for part in parts]


def _modules_layer(layer: torch.nn.Module) -> _Layer:
    """The layer as its modules compute it (float, int8 or torch-layout int4 weights)."""
    attention, mlp = layer.self_attn, layer.mlp
    norm_in = (layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon)
    norm_post = (layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon)
    qkv, gate_up = _fused([attention.q_proj, attention.k_proj, attention.v_proj]), _fused([mlp.gate_proj, mlp.up_proj])
    o, down, act = _single(attention.o_proj), _single(mlp.down_proj), mlp.act_fn
    head_dim = attention.head_dim
    half = head_dim // 2

    def before(stream: torch.Tensor, turn: _Rotation) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        query, key, value = _heads(qkv(_rms_norm(stream, *norm_in)), head_dim)
        heads, both = query.shape[1], torch.cat([query, key], dim=1)  # one rotation for queries and keys
        cos, signed_sin = turn.heads
        both = both * cos + both.roll(half, dims=-1) * signed_sin
        return both[:, :heads], both[:, heads:], value

    def after(out: torch.Tensor, stream: torch.Tensor) -> torch.Tensor:
        stream = stream + o(out)
        gate, up = gate_up(_rms_norm(stream, *norm_post))
        return stream + down(act(gate) * up)

    return _Layer("modules", attention, before, after)


def _linears(layer: torch.nn.Module) -> list[torch.nn.Module]:
    """q, k, v, o, gate, up, down: the order the native layer kinds index them in."""
    attention, mlp = layer.self_attn, layer.mlp
    return [attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]


def _norms(layer: torch.nn.Module) -> tuple[tuple[torch.Tensor, float], tuple[torch.Tensor, float]]:
    """The input and post-attention RMS norms as (float32 weight, eps), as the native kernels take them."""
    return tuple((norm.weight.float().contiguous(), norm.variance_epsilon)
                 for norm in (layer.input_layernorm, layer.post_attention_layernorm))


DENSE_ROWS = 32  # from this many rows an int4 layer multiplies through its float32 weights, unpacked per call


def _dot_layer(layer: torch.nn.Module, silu: bool) -> _Layer | None:
    """The layer in two calls of the native int4 kernels, or None where its modules are not all dot-layout
    int4 without bias under a SiLU MLP: `before` folds the RMS norm and the rotation around the fused
    product, `after` the output projection, residual adds, norm, SwiGLU and MLP (two calls a layer instead
    of about forty small ops). From DENSE_ROWS rows (prefill) the float layer's arithmetic runs on the float32
    weights the codes stand for (Q4_1's own rounding: exactly the float model's), read by the widened kernel from a
    copy of the codes in its layout made once (`native.q4f_pack`, 0.75 byte a weight; unpacked per call by
    `native.q4_dense` where that copy would not be exact): a float multiply-add per weight and row beats the
    integer dots' two activation levels from a few dozen rows (400 rows: 18 against 34 ms a layer's MLP on an AVX2
    EPYC, when the weights were unpacked per call). Reading the copy instead of unpacking: twelve chat turns of
    20-30 words under `full`, time to first token 140 / 173 -> 107 / 88 ms p50 there (two runs alternated)."""
    attention, linears = layer.self_attn, _linears(layer)
    if not silu or not all(type(m) is Int4Linear and m.dot and m.bias is None for m in linears):
        return None
    norm_in, norm_post = _norms(layer)
    qkv, gate_up, o, down = Int4Linear.fuse(linears[:3]), Int4Linear.fuse(linears[4:6]), linears[3], linears[6]
    head_dim, rotated = attention.head_dim, qkv.sizes[0] + qkv.sizes[1]
    weights = (qkv, o, gate_up, down)
    widened = [native.q4f_pack(native.q4_dense(w.packed, w.scales_zeros)) for w in weights]
    widened = widened if all(p is not None for p in widened) else None

    def dense(stream: torch.Tensor) -> bool:
        return stream.numel() >= DENSE_ROWS * stream.shape[-1]

    def product(i: int) -> Product:
        """Weight i's product for many rows: its codes in the widened kernel's layout, or unpacked now."""
        if widened is not None:
            return _codes_product(widened[i])
        return _torch_product(native.q4_dense(weights[i].packed, weights[i].scales_zeros))

    def before(stream: torch.Tensor, turn: _Rotation) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if dense(stream):
            return _float_before(stream, turn, product(0), norm_in, qkv.sizes, head_dim)
        out = native.q4_matmul(stream.reshape(-1, stream.shape[-1]), qkv.packed, qkv.scales_zeros, norm=norm_in,
                               rotary=(*turn.rows, rotated, head_dim))
        return _heads(out.view(*stream.shape[:-1], -1).split(qkv.sizes, dim=-1), head_dim)

    def after(out: torch.Tensor, stream: torch.Tensor) -> torch.Tensor:
        if dense(stream):
            return _float_after(out, stream, product(1), norm_post, product(2), product(3))
        return native.q4_mlp(out.reshape(-1, out.shape[-1]), stream.reshape(-1, stream.shape[-1]), (o.packed, o.scales_zeros),
                             norm_post, (gate_up.packed, gate_up.scales_zeros), (down.packed, down.scales_zeros)).view_as(stream)

    heads, kv_heads = attention.config.num_attention_heads, attention.config.num_key_value_heads
    step = None
    if head_dim == native.ATTEND_DIM and native.attend_fast() and heads // kv_heads <= native.ATTEND_GROUP:
        step = native.Q4Layer.of((qkv.packed, qkv.scales_zeros), (o.packed, o.scales_zeros),
                                 (gate_up.packed, gate_up.scales_zeros), (down.packed, down.scales_zeros),
                                 (norm_in, norm_post), heads, kv_heads, head_dim)
    return _Layer("dot", attention, before, after, step)


def _float_layer(layer: torch.nn.Module, silu: bool) -> _Layer | None:
    """The layer with float32 weights on a CPU with the native kernels: its products (`_product`: the embedded
    model's weights read from their Q4_1 codes), and the glue around them in C (`native.prepare_rows`: the RMS
    norms and SwiGLU; `native.rotate_rows`: queries and keys in place) and in the products (the residual adds),
    about a dozen calls a layer instead of forty small ops. None where the weights are not all float32 without
    bias on the CPU under a SiLU MLP."""
    attention, linears = layer.self_attn, _linears(layer)
    weights = [m.weight for m in linears if type(m) is torch.nn.Linear]
    if (not silu or len(weights) < len(linears) or any(m.bias is not None for m in linears)
            or any(w.dtype != torch.float32 or w.device.type != "cpu" for w in weights) or not native.available(*weights)):
        return None
    norm_in, norm_post = _norms(layer)
    qkv, gate_up = _product(_concatenated(linears[:3])), _product(_concatenated(linears[4:6]))
    o, down = _product(linears[3].weight), _product(linears[6].weight)
    sizes = [m.out_features for m in linears[:3]]
    before = functools.partial(_float_before, qkv=qkv, norm=norm_in, sizes=sizes, head_dim=attention.head_dim)
    after = functools.partial(_float_after, o=o, norm=norm_post, gate_up=gate_up, down=down)
    return _Layer("float", attention, before, after)


def _bf16_layer(layer: torch.nn.Module, silu: bool) -> _Layer | None:
    """The layer with bfloat16 weights on a CPU with the native kernels: the products on packed weights
    (agent/packed.py), the glue around them in C (agent/bf16_glue.c: each RMS norm, the rotation of queries
    and keys in place, SwiGLU, one pass over the rows each instead of five to eight torch ops, with torch's
    roundings). None where the weights and norms are not all bfloat16 without bias on the CPU under a SiLU MLP."""
    attention, linears = layer.self_attn, _linears(layer)
    norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
    weights = [m.weight for m in linears if type(m) is torch.nn.Linear] + list(norms)
    if (not silu or len(weights) < len(linears) + 2 or any(m.bias is not None for m in linears)
            or any(w.dtype != torch.bfloat16 or w.device.type != "cpu" for w in weights) or not native.available(*weights)):
        return None
    norm_in = (norms[0].detach(), layer.input_layernorm.variance_epsilon)
    norm_post = (norms[1].detach(), layer.post_attention_layernorm.variance_epsilon)
    qkv, gate_up = PackedLinear(_concatenated(linears[:3])), PackedLinear(_concatenated(linears[4:6]))
    o, down = PackedLinear.of(linears[3]), PackedLinear.of(linears[6])
    sizes, head_dim = [m.out_features for m in linears[:3]], attention.head_dim

    def before(stream: torch.Tensor, turn: _Rotation) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        out = qkv(native.bf16_rms_norm(stream.reshape(-1, stream.shape[-1]), *norm_in))
        native.bf16_rotate(out, *turn.rows, sizes[0] + sizes[1], head_dim)
        return _heads(out.view(*stream.shape[:-1], -1).split(sizes, dim=-1), head_dim)

    def after(out: torch.Tensor, stream: torch.Tensor) -> torch.Tensor:
        stream = stream + o(out)
        gated = gate_up(native.bf16_rms_norm(stream.reshape(-1, stream.shape[-1]), *norm_post))
        return stream + down(native.bf16_swiglu(gated)).view_as(stream)

    return _Layer("bf16", attention, before, after)


Product = Callable[..., torch.Tensor]  # (rows [n, k], residual [n, out] or None) -> rows @ weight.T (+ residual)


def _torch_product(weight: torch.Tensor) -> Product:
    """A float32 weight's product through torch (the residual added in the same call, `addmm`)."""
    transposed = weight.detach().t()  # once, not per call

    def product(rows: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return rows @ transposed if residual is None else torch.addmm(residual, rows, transposed)

    return product


def _product(weight: torch.Tensor) -> Product:
    """A float32 weight's product: read from its exact Q4_1 codes where it has them (the embedded model's, shipped
    as GGUF Q4_1: `native.q4f_matmul`, an eighth of the bytes and the same weights), else through torch."""
    packed = native.q4f_pack(weight)
    return _torch_product(weight) if packed is None else _codes_product(packed)


def _codes_product(packed: tuple[torch.Tensor, torch.Tensor]) -> Product:
    """The product of a weight packed by `native.q4f_pack`."""
    return lambda rows, residual=None: native.q4f_matmul(rows, *packed, residual=residual)


def _float_before(stream: torch.Tensor, turn: _Rotation, qkv: Product, norm: tuple[torch.Tensor, float],
                  sizes: list[int], head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A float32 layer's norm, queries, keys and values in one product, queries and keys rotated in place."""
    out = qkv(_normed(stream.reshape(-1, stream.shape[-1]), norm))
    native.rotate_rows(out, *turn.rows, sizes[0] + sizes[1], head_dim)
    return _heads(out.view(*stream.shape[:-1], -1).split(sizes, dim=-1), head_dim)


def _float_after(out: torch.Tensor, stream: torch.Tensor, o: Product, norm: tuple[torch.Tensor, float],
                 gate_up: Product, down: Product) -> torch.Tensor:
    """A float32 layer after attention: output projection and residual add, norm, gate and up, SwiGLU, down and
    residual add."""
    middle = o(out.reshape(-1, out.shape[-1]), stream.reshape(-1, stream.shape[-1]))
    gated = gate_up(_normed(middle, norm))
    return down(_swiglu(gated), middle).view_as(stream)


def _normed(rows: torch.Tensor, norm: tuple[torch.Tensor, float]) -> torch.Tensor:
    """RMS norm of [rows, k]: one native call for decode's few rows, torch's vectorized ops for more."""
    return native.prepare_rows(rows, norm=norm) if rows.shape[0] <= DECODE_ROWS else _rms_norm(rows, *norm)


def _swiglu(rows: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of [rows, 2k] (gate first): native for a few rows, else torch's (vectorized exp)."""
    if rows.shape[0] <= DECODE_ROWS:
        return native.prepare_rows(rows, swiglu=True)
    gate, up = rows.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def _fused(modules: list[torch.nn.Module]) -> Callable[[torch.Tensor], list[torch.Tensor]]:
    """One product for linear layers that read the same input, its output split back into theirs: one kernel
    call instead of several (each costs 10-20 us of dispatch on a CPU, as much as a small product). Float
    layers without bias (`_concatenated`, packed where that pays) and int4 layers that concatenate
    (`Int4Linear.fuse`) are fused; any other mix is called one by one."""
    sizes = [module.out_features for module in modules]
    if (whole := _concatenated(modules)) is not None:
        linear = PackedLinear(whole)
        return lambda x: linear(x).split(sizes, dim=-1)
    if all(type(m) is Int4Linear for m in modules) and (fused := Int4Linear.fuse(modules)) is not None:
        return fused
    return lambda x: [module.forward(x) for module in modules]


def _single(module: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """A float linear layer's product (packed where that pays: agent/packed.py), any other its forward."""
    return PackedLinear.of(module) if type(module) is torch.nn.Linear else module.forward


def _concatenated(modules: list[torch.nn.Module]) -> torch.Tensor | None:
    """The weights of float linear layers without bias as one tensor, each module's own weight becoming a view
    into it (held once; transformers' forward reads the same numbers; `_fused` may add a packed copy, agent/packed.py);
    None for any other mix."""
    if not all(type(m) is torch.nn.Linear and m.bias is None for m in modules):
        return None
    whole = torch.cat([m.weight.detach() for m in modules])
    for module, part in zip(modules, whole.split([m.out_features for m in modules])):
        module.weight = torch.nn.Parameter(part, requires_grad=False)
    return whole


class LeanLlama:
    """The model's forward over `kv_pieces`, returning the logits at `keep` only."""

    def __init__(self, model: torch.nn.Module):
        inner = model.model
        self.embed, self.rotary = inner.embed_tokens.weight, inner.rotary_emb
        head = Q8Head.lossless(model.lm_head) if model.lm_head.weight.device.type == "cpu" and native.q8_fast() else None
        self.head = head.forward if head else _single(model.lm_head)  # int8 where that is exact: a quarter of the bytes
        self.norm = (inner.norm.weight, inner.norm.variance_epsilon)
        silu = model.config.hidden_act == "silu"
        self.layers = [_dot_layer(layer, silu) or _float_layer(layer, silu) or _bf16_layer(layer, silu) or _modules_layer(layer)
                       for layer in inner.layers]
        self.stepping = all(layer.step is not None for layer in self.layers)

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, pieces: list[Piece], keep: torch.Tensor) -> torch.Tensor:
        """ids and positions [1, n]; the logits [len(keep), vocab]."""
        if self.stepping and ids.shape[1] == 1 and len(pieces) == 1 and (stepped := self._step(ids, positions, pieces[0])) is not None:
            return self.head(_rms_norm(stepped, *self.norm))[0]
        hidden = torch.nn.functional.embedding(ids, self.embed)
        turn = _Rotation(*self.rotary(hidden, position_ids=positions))
        for layer in self.layers:
            query, key, value = layer.before(hidden, turn)
            out, _ = palace_attention(layer.attention, query, key, value, None, scaling=layer.attention.scaling,
                                      kv_pieces=pieces)
            hidden = layer.after(out.reshape(*hidden.shape[:-1], -1), hidden)
        return self.head(_rms_norm(hidden[:, keep], *self.norm))[0]

    def _step(self, ids: torch.Tensor, positions: torch.Tensor, piece: Piece) -> torch.Tensor | None:
        """One decode token through every layer, each in one native call (`native.q4_decode_layer`: products,
        the new key and value written into the store's buffers, attention, MLP) instead of a dozen calls and
        views, where the store holds every layer as float32 buffers on the CPU; the final stream [1, 1, d],
        or None where the store holds its tokens otherwise (the layer-by-layer path then runs)."""
        store = piece.store
        storages = [layer.storage for layer in store.layers]
        held_as_buffers = all(type(s) is ContiguousStorage and s.keys is not None and s.keys.dtype == torch.float32
                              and s.keys.device.type == "cpu" for s in storages)
        if piece.mask is not None or self.embed.dtype != torch.float32 or not held_as_buffers:
            return None
        hidden = torch.nn.functional.embedding(ids[0], self.embed)
        cos, sin = _Rotation(*self.rotary(hidden[None], position_ids=positions)).rows
        recording = store.recording and not store.frozen
        mass = torch.zeros(store.length + 1) if recording else None
        for layer, storage in zip(self.layers, storages):
            length = storage.claim(1)
            hidden = native.q4_decode_layer(layer.step, hidden, cos, sin, storage.keys, storage.values, length,
                                            layer.attention.scaling, mass)
        store.declare_arrivals()
        if recording:
            store.add_importance(0, mass[None])
        return hidden[None]


def _rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm's arithmetic: in float32, back to the input's dtype before the weight."""
    wide = hidden.to(torch.float32)
    wide = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)
    return weight * wide.to(hidden.dtype)


_BUILT: "weakref.WeakKeyDictionary[torch.nn.Module, tuple[tuple[int, ...], LeanLlama]]" = weakref.WeakKeyDictionary()


def lean_forward(model: torch.nn.Module) -> LeanLlama | None:
    """The model's lean forward, or None where transformers' forward is the path: another family, or
    PALACE_LEAN=0. Built once per model and rebuilt if its linear layers were swapped since (quantized in
    place) or it was moved; kept outside the model, so a deep copy does not carry one bound to the original."""
    if os.environ.get("PALACE_LEAN", "1") == "0" or model.config.model_type not in FAMILIES:
        return None
    layers = model.model.layers
    modules = (id(layers[0].self_attn.q_proj), id(layers[-1].mlp.down_proj), id(model.lm_head),  # what a swap replaces
               layers[0].input_layernorm.weight.data_ptr(),  # and what a move to another device or dtype does
               native.library() is not None)  # the native layer kinds need the kernels (PALACE_NATIVE can turn them off)
    built = _BUILT.get(model)
    if built is None or built[0] != modules:
        built = _BUILT[model] = (modules, LeanLlama(model))
    return built[1]
