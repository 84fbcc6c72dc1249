"""The engine's lean forward (agent/lean.py) against transformers' forward under the same attention, and
the int8 output layer (agent/qlinear.Q8Head, agent/weight_kernels.c) against the float matmul it
replaces: same logits to float rounding, same greedy tokens, on the tiny random Llama and the embedded
model."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from agent.engine import SamplingConfig, decode, forward_forks, prefill
from agent.lean import DENSE_ROWS, lean_forward
from agent.qlinear import Q8Head
from cache import native
from tests.helpers import store_for


def run(model, monkeypatch, lean: bool, ids: list[int], new: int) -> tuple[list[torch.Tensor], list[int]]:
    """Prefill `ids` in two turns, then decode `new` greedy tokens; the logits after each step and the tokens."""
    monkeypatch.setenv("PALACE_LEAN", "1" if lean else "0")
    assert (lean_forward(model) is not None) == lean
    store = store_for(model)
    logits = [prefill(model, store, ids[: len(ids) // 2], 0, "user", 0).clone(),
              prefill(model, store, ids[len(ids) // 2:], 1, "user", 1).clone()]
    tokens = []
    for token in decode(model, store, [], SamplingConfig(max_new_tokens=new), 1, 1):
        tokens.append(token)
        logits.append(store.next_logits.clone())
    return logits, tokens


def test_lean_forward_equals_transformers_forward_on_the_tiny_model(tiny, monkeypatch):
    ids = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    want_logits, want_tokens = run(tiny, monkeypatch, False, ids, 12)
    got_logits, got_tokens = run(tiny, monkeypatch, True, ids, 12)
    assert got_tokens == want_tokens
    for got, want in zip(got_logits, want_logits, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_lean_forward_scores_packed_forks_like_transformers(tiny, monkeypatch):
    """forward_forks (several stores' candidates in one packed forward, as scoring does) through both paths."""
    prompt, ids = list(range(3, 30)), [[40, 41, 42], [50, 51]]
    results = []
    for lean in (False, True):
        monkeypatch.setenv("PALACE_LEAN", "1" if lean else "0")
        stores = [store_for(tiny), store_for(tiny)]
        for store in stores:
            prefill(tiny, store, prompt, 0, "user", 0)
        with stores[0].fork(), stores[1].fork():
            for store, seq in zip(stores, ids):
                store.expect(len(seq), 0, "assistant", -1, seq)
            positions = [torch.arange(len(prompt), len(prompt) + len(seq)) for seq in ids]
            results.append(forward_forks(tiny, stores, ids, positions, [None, None]))
    for got, want in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def both_paths(loaded, monkeypatch, new: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The logits of transformers' forward and of the lean one over a sentence and `new` greedy tokens, which
    must be the same tokens."""
    ids = loaded.tokenizer("The parcel was left with the neighbour at number 29, and the driver said",
                           add_special_tokens=False)["input_ids"]
    want_logits, want_tokens = run(loaded.model, monkeypatch, False, ids, new)
    got_logits, got_tokens = run(loaded.model, monkeypatch, True, ids, new)
    assert got_tokens == want_tokens
    return want_logits, got_logits


def test_embedded_model_decodes_the_same_greedy_tokens_with_the_lean_forward(embedded, monkeypatch):
    """float32: the native glue, and every product read from the Q4_1 codes the embedded model's float32 weights
    are exactly (agent/lean._product): the same greedy tokens and logits as transformers' forward."""
    monkeypatch.setenv("PALACE_LEAN", "1")
    assert {layer.kind for layer in lean_forward(embedded.model).layers} == {"float"}
    layer = embedded.model.model.layers[0]
    assert all(native.q4f_pack(w.weight) is not None for w in (layer.self_attn.q_proj, layer.mlp.down_proj))
    want_logits, got_logits = both_paths(embedded, monkeypatch, 24)
    for got, want in zip(got_logits, want_logits, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)


def test_bfloat16_lean_forward_multiplies_through_packed_weights_and_decodes_the_same_tokens(monkeypatch):
    """bfloat16 on the CPU (what `--dtype auto` picks on AMX or AVX-512 BF16): every product of the lean
    forward, the output layer's too, reads weights packed once for oneDNN (agent/packed.py), the glue runs in
    the native bfloat16 kernels where they are built, and it gives the greedy tokens and, to bfloat16
    rounding, the logits of transformers' forward over the same weights."""
    from agent.model import load_model
    from agent.packed import packable

    loaded = load_model("embedded", device="cpu", dtype="bfloat16")
    monkeypatch.setenv("PALACE_LEAN", "1")
    lean = lean_forward(loaded.model)
    assert {layer.kind for layer in lean.layers} == {"bf16" if native.library() is not None else "modules"}
    assert (lean.head.packed is not None) == packable(loaded.model.lm_head.weight)
    want_logits, got_logits = both_paths(loaded, monkeypatch, 16)
    for got, want in zip(got_logits, want_logits, strict=True):
        assert (got.float().softmax(-1) - want.float().softmax(-1)).abs().max() < 0.02


# The native int4 layout's lean forward folds norms, rotation, SwiGLU and residual adds into its kernels, which
# quantize activations per group (two int8 levels): a difference of rounding order can move a level by one
# step (about 1/127^2 of a group's largest value). Both of its paths stay within 0.025 of the float32 model's
# logits here (torch's layout, bfloat16 activations: 0.15-0.26), so they are held to 0.05 of each other.
INT4_TOLERANCE = {True: dict(rtol=0, atol=5e-2), False: dict(rtol=1e-4, atol=1e-3)}


@pytest.mark.parametrize("dot", [True, False], ids=["dot-layout", "torch-layout"])
def test_lean_forward_fuses_int4_projections_without_changing_a_token(embedded, monkeypatch, dot):
    """int4 weights: queries, keys and values in one product, gate and up in another, the modules' codes views
    into the fused ones (so transformers' forward still reads the same), and the same tokens either way; in
    the native layout each layer is two kernel calls."""
    from agent.model import quantize_linear_int4

    model = quantize_linear_int4(embedded.model, dot=dot)
    assert model.model.layers[0].mlp.down_proj.dot == dot
    monkeypatch.setenv("PALACE_LEAN", "1")
    assert {layer.kind for layer in lean_forward(model).layers} == {"dot" if dot else "modules"}
    ids = embedded.tokenizer("My order KL-20931 never came, the tracking says delivered to a safe place. I checked "
                             "the porch, the bins and the shed, and asked both neighbours on the left and on the right of my house "
                             "at number 29, but nobody has seen a parcel or a card from the driver all week long",
                             add_special_tokens=False)["input_ids"]
    assert len(ids) // 2 >= DENSE_ROWS  # each prefill half multiplies through the float32 weights of the codes
    want_logits, want_tokens = run(model, monkeypatch, False, ids, 12)
    got_logits, got_tokens = run(model, monkeypatch, True, ids, 12)
    attention = model.model.layers[0].self_attn
    assert attention.k_proj.packed.data_ptr() > attention.q_proj.packed.data_ptr()  # views into one fused buffer
    assert attention.k_proj.packed.untyped_storage().data_ptr() == attention.q_proj.packed.untyped_storage().data_ptr()
    again_logits, again_tokens = run(model, monkeypatch, False, ids, 12)  # transformers' forward on the views
    assert got_tokens == want_tokens == again_tokens
    for got, want, again in zip(got_logits, want_logits, again_logits, strict=True):
        torch.testing.assert_close(got, want, **INT4_TOLERANCE[dot])
        torch.testing.assert_close(again, want, rtol=0, atol=0)


def test_the_embedded_output_layer_is_int8_without_loss(embedded):
    """Its tied embedding was stored as GGUF Q8_0: codes times scales give back every float32 weight."""
    head = Q8Head.lossless(embedded.model.lm_head)
    assert head is not None and head.codes.dtype == torch.int8
    assert head.weight is embedded.model.model.embed_tokens.weight  # shared, not copied
    groups = head.codes.float().reshape(head.out_features, -1, 32) * head.scales[..., None]
    assert torch.equal(groups.reshape(head.out_features, -1), embedded.model.lm_head.weight.detach())


def test_weights_that_int8_does_not_hold_exactly_stay_float():
    linear = nn.Linear(64, 16, bias=False)
    assert Q8Head.lossless(linear) is None
    with torch.no_grad():
        linear.weight.copy_(torch.randint(-127, 128, (16, 64)).float() * 0.03125)  # a power of two: exact
        linear.weight[:, ::32] = 127 * 0.03125  # each group's largest code is 127, as Q8_0 makes it
    assert Q8Head.lossless(linear) is not None
    assert Q8Head.lossless(nn.Linear(64, 16, bias=True)) is None


@pytest.mark.parametrize("rows", [1, 3, 8, 11])
def test_int8_kernel_equals_the_float_matmul(rows):
    """Every row count decode and lockstep evaluation use (11: more than one pass of 8), 64 outputs a block
    and a ragged last block."""
    generator = torch.Generator().manual_seed(rows)
    codes = torch.randint(-127, 128, (200, 96), generator=generator, dtype=torch.int8)
    scales = torch.rand(200, 3, generator=generator) * 0.02
    x = torch.randn(rows, 96, generator=generator) * 3
    want = x @ (codes.float().reshape(200, 3, 32) * scales[..., None]).reshape(200, 96).T
    got = native.q8_matmul(x, codes, scales)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def test_a_decode_token_is_one_native_call_a_layer_with_the_same_tokens_kv_and_importance(embedded, monkeypatch):
    """int4 weights in the native layout, a store of float32 buffers that records importance and evicts (h2o
    under a budget smaller than the prompt): each decode token goes through each layer in one call (`native.q4_decode_layer`), and
    gives the layer-by-layer path's tokens, logits (to the int4 tolerance), keys, values and importance."""
    from agent.model import quantize_linear_int4

    model = quantize_linear_int4(embedded.model, dot=True)
    monkeypatch.setenv("PALACE_LEAN", "1")
    lean = lean_forward(model)
    assert lean.stepping
    calls, kernel = [], native.q4_decode_layer
    monkeypatch.setattr(native, "q4_decode_layer", lambda *args: calls.append(args[6]) or kernel(*args))
    ids = embedded.tokenizer("Could you move my delivery to Thursday? I will be away until then, and my neighbour at "
                             "number 12 cannot take parcels in for me any more, thanks",
                             add_special_tokens=False)["input_ids"]
    results = []
    for stepping in (False, True):
        lean.stepping = stepping
        store = store_for(model, "h2o", budget=16, slack=1)
        prefill(model, store, ids, 0, "user", 0)
        tokens, logits = [], []
        for token in decode(model, store, [], SamplingConfig(max_new_tokens=10), 0, 0):
            tokens.append(token)
            logits.append(store.next_logits.clone())
        results.append((tokens, logits, [layer.storage.fetch() for layer in store.layers], store.meta.importance.clone()))
    layers = len(model.model.layers)  # every decode token (and a one-token prefill chunk) in one call a layer:
    assert len(calls) >= 10 * layers and len(calls) % layers == 0 and max(calls) < 16  # the new row within the budget
    (want_tokens, want_logits, want_kv, want_importance), (tokens, logits, kv, importance) = results
    assert tokens == want_tokens
    for got, want in zip(logits, want_logits, strict=True):
        torch.testing.assert_close(got, want, **INT4_TOLERANCE[True])
    for (keys, values), (want_keys, want_values) in zip(kv, want_kv, strict=True):
        torch.testing.assert_close(keys, want_keys, rtol=0, atol=5e-2)
        torch.testing.assert_close(values, want_values, rtol=0, atol=5e-2)
    torch.testing.assert_close(importance, want_importance, rtol=1e-3, atol=1e-3)
