"""Attention reads compact KV in its own format (issue 13): chunked online softmax over quantized tiers and
paged blocks gives what SDPA gives over the same tokens; nothing keeps a float copy of a layer; the bytes a
store reports are every byte its layers hold; and compactions re-quantize nothing, moved or not."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cache import storage as storage_module
from cache.attention import attend, attend_chunks, attention_mass, causal_mask
from cache.policies import PolicyConfig, make_policy
from cache.rope import Rerotator
from cache.storage import StorageConfig
from cache.store import KVStore
from tests.helpers import store_for, tiny_llama

HEADS, QUERY_HEADS, DIM = 3, 9, 64  # SmolLM2-135M's attention shape
KINDS = {"float32": StorageConfig("float32"), "bfloat16": StorageConfig("bfloat16"),
         "paged": StorageConfig("float32", paged=True), "int8": StorageConfig("int8"), "int4": StorageConfig("int4"),
         "fp8": StorageConfig("fp8"), "dynamic": StorageConfig("dynamic", int8_tokens=1024)}


def random_kv(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randn(1, HEADS, tokens, DIM, generator=generator) * torch.linspace(0.5, 6.0, DIM)
    return keys, torch.randn(1, HEADS, tokens, DIM, generator=generator)


@pytest.mark.parametrize("kind", list(KINDS))
def test_chunked_attention_equals_sdpa_over_the_same_tokens(kind):
    """More tokens than one chunk, appended unevenly; decode (1 query), scoring (5, scales folded into the
    queries) and prefill (40, dequantized chunks), causal and with an explicit mask; and the attention mass
    importance eviction reads. The reference is SDPA over the storage's own dequantized tokens, so what is
    tested is the reading, not the quantization."""
    tokens = storage_module.CHUNK + 333
    layer = KINDS[kind].build(1, tokens)[0]
    keys, values = random_kv(tokens, seed=1)
    for start in range(0, tokens, 1000):
        layer.append(keys[:, :, start:start + 1000], values[:, :, start:start + 1000])
    assert sum(1 for _ in layer.chunks(torch.float32)) >= (1 if kind == "float32" else 2)
    exact_keys, exact_values = (t.float() for t in layer.fetch())
    generator = torch.Generator().manual_seed(2)
    for rows in (1, 5, 40):
        query = torch.randn(1, QUERY_HEADS, rows, DIM, generator=generator)
        masks = [None] if rows == 1 else [None, torch.rand(1, 1, rows, tokens, generator=generator) > 0.3]
        for mask in masks:
            reference_mask = causal_mask(rows, tokens) if mask is None and rows > 1 else mask
            want = attend(query, exact_keys, exact_values, reference_mask, None)
            got, mass = attend_chunks(query, layer.chunks(torch.float32), tokens, mask, None, want_mass=True)
            assert got.shape == want.shape == (1, rows, QUERY_HEADS, DIM)
            assert float((got - want).abs().max()) < 1e-4 * float(want.abs().max())
            want_mass = attention_mass(query, exact_keys, reference_mask, DIM**-0.5)
            assert torch.allclose(mass, want_mass, atol=1e-5, rtol=1e-4)


def tensors_held(root) -> dict[int, int]:
    """Every tensor reachable from `root` through attributes, containers and dataclasses (not through a
    store back-reference): bytes by underlying storage, so views and shared pools count once."""
    found, seen, todo = {}, set(), [root]
    while todo:
        item = todo.pop()
        if isinstance(item, torch.Tensor):
            found[item.untyped_storage().data_ptr()] = item.untyped_storage().nbytes()
        elif isinstance(item, (list, tuple, set)):
            todo.extend(item)
        elif isinstance(item, dict):
            todo.extend(item.values())
        elif id(item) not in seen and not isinstance(item, KVStore) and hasattr(item, "__dict__"):
            seen.add(id(item))
            todo.extend(vars(item).values() if not dataclasses.is_dataclass(item) else
                        [getattr(item, f.name) for f in dataclasses.fields(item)])
    return found


@pytest.mark.parametrize("kind", list(KINDS))
def test_store_bytes_are_every_byte_its_layers_hold_and_no_float_copy_is_kept(kind):
    """After a prefill and decode steps through the real model: the walk of every tensor the layers hold
    equals memory_bytes() (so there is no retained float copy, and scales, zero points, residual windows,
    capacity and the whole block pool are counted), and compact kinds hold their share of float32."""
    model = tiny_llama(layers=2)
    from agent.engine import forward

    held = {}
    for name in ("float32", kind):
        store = store_for(model, storage=KINDS[name])
        generator = torch.Generator().manual_seed(3)
        forward(model, store, torch.randint(0, 512, (700,), generator=generator).tolist())
        for token in range(5):
            forward(model, store, [token])
        assert all(layer.keys is None and layer.values is None for layer in store.layers)
        walked = sum(tensors_held(store.layers).values())
        assert walked == store.memory_bytes() > 0
        held[name] = walked
    ceiling = {"int8": 0.35, "int4": 0.25, "fp8": 0.35, "dynamic": 0.35, "bfloat16": 0.51}.get(kind)
    if ceiling is not None:
        assert held[kind] < ceiling * held["float32"]


def compaction_store(kind: str) -> KVStore:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, DIM, 2).float() / DIM))
    return KVStore(1, Rerotator(inv_freq), make_policy("full", PolicyConfig()), StorageConfig(kind))


@pytest.mark.parametrize("kind", ["int8", "int4", "fp8"])
def test_compactions_requantize_nothing(kind):
    """Twelve compactions, each evicting a few tokens after a 96-token prefix (a permanent tier), with the
    keys after them moved; a float32 store given the same steps is the reference. The prefix keeps its
    exact codes, and the moved keys and values keep their error: their codes stay, the keys owing their
    shifts (re-quantizing the re-rotated keys, as this store once did, doubled their error by the twelfth)."""
    stores = {name: compaction_store(name) for name in ("float32", kind)}
    keys, values = random_kv(1200, seed=4)
    for store in stores.values():
        store.expect(1200, 0, "user", 0, list(range(1200)))
        store.layers[0].append(keys, values)
    quantized, reference = stores[kind], stores["float32"]
    prefix_before = quantized.layers[0].storage.fetch()[0][:, :, :96].clone()
    errors = []
    generator = torch.Generator().manual_seed(5)
    for _ in range(12):
        start = 96 + int(torch.randint(0, quantized.length - 200, (1,), generator=generator))
        kept = torch.cat((torch.arange(start), torch.arange(start + 8, quantized.length)))
        for store in stores.values():
            store.keep(kept)
        (got_keys, got_values), (want_keys, want_values) = (s.layers[0].storage.fetch() for s in (quantized, reference))
        moved = slice(96, None)
        errors.append((float((got_keys[:, :, moved] - want_keys[:, :, moved]).norm() / want_keys[:, :, moved].norm()),
                       float((got_values - want_values).norm() / want_values.norm())))
    assert torch.equal(quantized.layers[0].storage.fetch()[0][:, :, :96], prefix_before)
    (first_keys, first_values), (last_keys, last_values) = errors[0], errors[-1]
    assert last_values < 1.02 * first_values and last_keys < 1.02 * first_keys
