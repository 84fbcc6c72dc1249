"""A lean forward of a Llama model over the managed stores, for prefill and decode alike.

Why: a 135M model decodes one token on a CPU in a few hundred small eager ops, and transformers' forward
adds per-call machinery around each (module hooks, kwargs plumbing and deprecation wrappers on every
layer, a mask built and thrown away, output dataclasses): without it, decode is 8 % (float32) to 15 %
(int4 weights) faster on the 2-core Xeon of the README. This is gpt-fast's shape:
the layer loop on one screen, calling the same modules' arithmetic directly (their `forward`, not
`__call__`), with attention done by the palace attention over each piece's store, as under
transformers. On the CPU the output layer reads int8 codes where they hold its weights exactly (the
embedded model's tied embedding was stored as GGUF Q8_0: agent/qlinear.Q8Head), a quarter of the bytes.
The arithmetic is otherwise transformers' own, in its order (the rotation of queries and keys is done
for both at once, the same products and sums), so the logits agree to float rounding;
transformers' forward stays the reference path (`PALACE_LEAN=0`, and every family but Llama), and a
test holds the two to the same logits and greedy tokens."""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass
from typing import Callable

import torch

from agent.qlinear import GROUP, Int4Linear, Q8Head
from cache import native
from cache.attention import Piece, palace_attention

FAMILIES = ("llama",)  # same layer shape as transformers' LlamaDecoderLayer, nothing added


Linear = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class _Layer:
    """One decoder layer's pieces, bound once: the norms' weights and the linear layers' forwards, queries,
    keys and values in one product, the gate and up projections in another."""

    attention: torch.nn.Module  # for its layer_idx and scaling, which the palace attention reads
    norm_in: tuple[torch.Tensor, float]
    norm_post: tuple[torch.Tensor, float]
    qkv: Callable[[torch.Tensor], list[torch.Tensor]]
    o: Linear
    gate_up: Callable[[torch.Tensor], list[torch.Tensor]]
    down: Linear
    act: Linear


def _fused(modules: list[torch.nn.Module]) -> Callable[[torch.Tensor], list[torch.Tensor]]:
    """One product for linear layers that read the same input, its output split back into theirs: one kernel
    call instead of several (each costs 10-20 us of dispatch on a CPU, as much as a small product). The
    weights are concatenated once and each module's own weight becomes a view into the whole, so nothing is
    held twice and transformers' forward reads the same numbers. Float layers without bias and int4 layers
    (torch's int4 CPU layout packs 64 output rows a block: outputs that are multiples of 64 concatenate) are
    fused; any other mix is called one by one."""
    sizes = [module.out_features for module in modules]
    if all(type(m) is torch.nn.Linear and m.bias is None for m in modules):
        whole = torch.cat([m.weight.detach() for m in modules])
        for module, part in zip(modules, whole.split(sizes)):
            module.weight = torch.nn.Parameter(part, requires_grad=False)
        return lambda x: torch.nn.functional.linear(x, whole).split(sizes, dim=-1)
    if all(type(m) is Int4Linear and m.bias is None and m.group == GROUP and m.out_features % 64 == 0 for m in modules):
        whole = torch.cat([m.packed for m in modules])
        for module, part in zip(modules, whole.split(sizes)):
            module.packed = part  # a view: the scales stay each module's own (a few KB), the codes are shared
        scales = torch.cat([m.scales_zeros for m in modules], dim=1).contiguous()
        return lambda x: Int4Linear.product(x, whole, scales, GROUP).split(sizes, dim=-1)
    return lambda x: [module.forward(x) for module in modules]


class LeanLlama:
    """The model's forward over `kv_pieces`, returning the logits at `keep` only."""

    def __init__(self, model: torch.nn.Module):
        inner = model.model
        self.embed, self.rotary = inner.embed_tokens.weight, inner.rotary_emb
        head = Q8Head.lossless(model.lm_head) if model.lm_head.weight.device.type == "cpu" and native.q8_fast() else None
        self.head = (head or model.lm_head).forward  # int8 where that is exact: a quarter of the bytes per token
        self.norm = (inner.norm.weight, inner.norm.variance_epsilon)
        self.head_dim = inner.layers[0].self_attn.head_dim
        self.layers = [_Layer(layer.self_attn, (layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon),
                              (layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon),
                              _fused([layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj]),
                              layer.self_attn.o_proj.forward, _fused([layer.mlp.gate_proj, layer.mlp.up_proj]),
                              layer.mlp.down_proj.forward, layer.mlp.act_fn)
                       for layer in inner.layers]

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, pieces: list[Piece], keep: torch.Tensor) -> torch.Tensor:
        """ids and positions [1, n]; the logits [len(keep), vocab]."""
        hidden = torch.nn.functional.embedding(ids, self.embed)
        cos, sin = self.rotary(hidden, position_ids=positions)
        half = self.head_dim // 2  # rotate_half(x) * sin, as x rolled by half a head times sin negated in its first half
        cos, sin = cos.unsqueeze(1), torch.cat([-sin[..., :half], sin[..., half:]], dim=-1).unsqueeze(1)
        shape = (*hidden.shape[:-1], -1, self.head_dim)
        for layer in self.layers:
            query, key, value = (part.reshape(shape).transpose(1, 2) for part in layer.qkv(_rms_norm(hidden, *layer.norm_in)))
            heads, both = query.shape[1], torch.cat([query, key], dim=1)  # one rotation for queries and keys
            both = both * cos + both.roll(half, dims=-1) * sin
            query, key = both[:, :heads], both[:, heads:]
            out, _ = palace_attention(layer.attention, query, key, value, None, scaling=layer.attention.scaling,
                                      kv_pieces=pieces)
            hidden = hidden + layer.o(out.reshape(*hidden.shape[:-1], -1))
            gate, up = layer.gate_up(_rms_norm(hidden, *layer.norm_post))
            hidden = hidden + layer.down(layer.act(gate) * up)
        return self.head(_rms_norm(hidden[:, keep], *self.norm))[0]


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
               layers[0].input_layernorm.weight.data_ptr())  # and what a move to another device or dtype does
    built = _BUILT.get(model)
    if built is None or built[0] != modules:
        built = _BUILT[model] = (modules, LeanLlama(model))
    return built[1]
