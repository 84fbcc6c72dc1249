"""Managed KV store, re-rotation, importance, policies and the engine, on real models."""

import pytest
import torch

from agent.engine import Feed, SamplingConfig, decode, forward, prefill, prefill_packed, sample
from cache.store import KVStore
from tests.helpers import store_for


def full_logits(model, ids):
    """One forward over the whole sequence with transformers' own eager attention: the reference."""
    model.set_attn_implementation("eager")
    try:
        with torch.inference_mode():
            return model(torch.tensor([ids])).logits[0].float()
    finally:
        from cache.attention import enable_palace_attention

        enable_palace_attention(model)


def aligned(store: KVStore) -> bool:
    return all(layer.storage.length == len(store.meta) == store.length for layer in store.layers)


def test_incremental_turns_match_one_full_forward(tiny):
    torch.manual_seed(1)
    turns = [torch.randint(0, 512, (n,)).tolist() for n in (7, 1, 1, 13, 1, 5)]
    store = store_for(tiny)
    seen = []
    for index, ids in enumerate(turns):
        logits = prefill(tiny, store, ids, turn=index, role="user", segment=index)
        seen += ids
        reference = full_logits(tiny, seen)[-1]
        assert torch.allclose(logits, reference, atol=1e-4), index
        assert aligned(store)


def test_packed_prefill_matches_each_store_alone(tiny):
    """Three stores with different histories, policies and metadata fed in shared forwards: each gets the
    logits, keys, importance and surprisal it gets when fed alone."""
    torch.manual_seed(3)
    histories = [torch.randint(0, 512, (n,)).tolist() for n in (5, 30, 12)]
    turns = [torch.randint(0, 512, (n,)).tolist() for n in (9, 4, 17)]
    def build(name, history):
        store = store_for(tiny, name, None if name in ("full", "hybrid") else 24)
        prefill(tiny, store, history, 0, "user", 0)
        return store

    names = ["hybrid", "h2o", "window"]  # hybrid: surprisal and importance; h2o: importance; window: neither
    alone = [build(n, h) for n, h in zip(names, histories)]
    together = [build(n, h) for n, h in zip(names, histories)]
    expected = [prefill(tiny, s, ids, 1, "user", 1) for s, ids in zip(alone, turns)]
    feeds = [Feed(s, 1, 1).add(ids[:3], "user").add(ids[3:], "assistant") for s, ids in zip(together, turns)]
    prefill_packed(tiny, feeds)
    assert alone[0].meta.surprisal.abs().sum() > 0 and alone[1].meta.importance.sum() > 0
    for a, b, want in zip(alone, together, expected):
        assert torch.allclose(want, b.next_logits, atol=1e-5)
        assert torch.allclose(a.layers[1].storage.fetch()[0], b.layers[1].storage.fetch()[0], atol=1e-5)
        assert torch.allclose(a.meta.importance, b.meta.importance, atol=1e-4)
        assert torch.allclose(a.meta.surprisal, b.meta.surprisal, atol=1e-4)
        assert aligned(b)
    roles = together[2].meta.role[-17:].tolist()
    assert roles == [1] * 3 + [2] * 14  # the role runs of one feed are declared in order


def test_compaction_rerotates_keys_to_their_new_positions(tiny):
    torch.manual_seed(2)
    ids = torch.randint(0, 512, (40,)).tolist()
    store = store_for(tiny)
    store.expect(len(ids), 0, "user", 0)
    forward(tiny, store, ids)
    keep = torch.tensor([0, 1, 2, 3, 9, 17, 18, 30, 38, 39])
    store.keep(keep)
    fresh = store_for(tiny)
    kept_ids = [ids[i] for i in keep]
    fresh.expect(len(kept_ids), 0, "user", 0)
    forward(tiny, fresh, kept_ids)
    kept_keys, kept_values = store.layers[0].storage.fetch()
    fresh_keys, fresh_values = fresh.layers[0].storage.fetch()
    assert torch.allclose(kept_keys, fresh_keys, atol=1e-5)
    assert torch.allclose(kept_values, fresh_values, atol=1e-6)
    assert store.meta.position.tolist() == list(range(len(keep)))
    assert aligned(store)


def test_importance_is_attention_mass_with_causal_masking(tiny):
    ids = list(range(10, 22))
    store = store_for(tiny, "h2o", 64)
    assert store.recording
    store.expect(len(ids), 0, "user", 0)
    forward(tiny, store, ids)
    layers, heads = tiny.config.num_hidden_layers, tiny.config.num_attention_heads
    # every query head's softmax sums to one, in every layer
    assert torch.isclose(store.meta.importance.sum(), torch.tensor(float(layers * heads * len(ids))), rtol=1e-4)
    # causal masking: a batched prefill gives the same mass as feeding token by token
    stepwise = store_for(tiny, "h2o", 64)
    for token in ids:
        stepwise.expect(1, 0, "user", 0)
        forward(tiny, stepwise, [token])
    assert torch.allclose(store.meta.importance, stepwise.meta.importance, atol=1e-4)
    assert store.meta.importance[0] >= layers * heads  # the first query can only attend to the first key
    before = store.meta.importance.clone()
    with store.fork():
        assert not store.recording
        store.expect(1, 1, "user", 1)
        forward(tiny, store, [3])
    assert torch.equal(store.meta.importance, before) and store.length == len(ids)


def run_policy(tiny, name, budget, pin=None, **extra):
    torch.manual_seed(3)
    store = store_for(tiny, name, budget, **extra)
    system = torch.randint(0, 512, (6,)).tolist()
    prefill(tiny, store, system, turn=-1, role="system", segment=-1)
    if pin is not None:
        store.pin(torch.tensor(pin))
    lengths = []
    for turn in range(12):
        ids = torch.randint(0, 512, (int(torch.randint(3, 30, ())),)).tolist()
        prefill(tiny, store, ids, turn=turn, role="user", segment=turn)
        lengths.append(store.length)
        assert aligned(store)
    return store, lengths


def test_window_keeps_the_most_recent_tokens_within_budget(tiny):
    store, lengths = run_policy(tiny, "window", 48)
    assert max(lengths) <= 48
    turns = store.meta.turn.tolist()
    assert turns == sorted(turns) and turns[-1] == 11 and -1 not in turns


def test_sink_keeps_sinks_and_recent_window(tiny):
    store, lengths = run_policy(tiny, "sink", 48, sink_tokens=4)
    assert max(lengths) <= 48
    assert store.meta.turn[:4].tolist() == [-1] * 4  # the first four system tokens survive
    assert store.meta.turn[-1] == 11


def test_h2o_keeps_planted_heavy_hitters_and_the_recent_window(tiny):
    """30 tokens, three of them planted heavy hitters; evicting to 22 keeps the pinned token, the recent
    window (half the target), the planted tokens, then the heaviest of the rest; the light ones go."""
    store = store_for(tiny, "h2o", 32, slack=2)
    prefill(tiny, store, list(range(1, 31)), 0, "user", 0)
    assert store.length == 30
    importance = torch.linspace(0.1, 1.0, 30).flip(0)  # older tokens a little heavier, all light
    planted = [4, 9, 13]
    importance[planted] = 100.0
    store.meta.importance = importance.clone()
    store.pin(torch.tensor([0]))
    tokens = store.meta.token.clone()
    store.make_room(8)  # target 32 - 8 - 2 = 22: pinned 1, recent 11, planted 3, then the 7 heaviest others
    kept = set(store.meta.token.tolist())
    recent = set(tokens[-11:].tolist())
    others = [i for i in range(1, 19) if i not in planted]  # neither pinned, planted nor recent
    heaviest = sorted(others, key=lambda i: -importance[i])[:7]
    assert store.length == 22 and kept == {int(tokens[0])} | recent | {int(tokens[i]) for i in planted + heaviest}
    assert not kept & {int(tokens[i]) for i in others if i not in heaviest}


def test_h2o_within_budget_with_pins(tiny):
    store, lengths = run_policy(tiny, "h2o", 48, pin=[1, 4])
    assert max(lengths) <= 48
    assert int(store.meta.pinned.sum()) == 2 and store.meta.turn[:2].tolist() == [-1, -1]
    assert store.meta.turn[-1] == 11


def test_long_message_is_prefilled_in_chunks_within_budget(tiny):
    store = store_for(tiny, "sink", 64)
    ids = torch.randint(0, 512, (500,)).tolist()
    peak = 0
    chunk = store.policy.max_chunk()
    for start in range(0, len(ids), chunk):
        prefill(tiny, store, ids[start:start + chunk], 0, "user", 0)
        peak = max(peak, store.length)
    prefill(tiny, store, ids, 1, "user", 1)
    assert peak <= 64 and store.length <= 64
    assert store.meta.position.tolist() == list(range(store.length))


def test_sampling_is_seeded_and_top_k_one_is_greedy():
    logits = torch.randn(100)
    greedy = sample(logits, SamplingConfig(temperature=0.0), None)
    assert sample(logits, SamplingConfig(temperature=1.0, top_k=1), torch.Generator().manual_seed(0)) == greedy
    draw = lambda seed: [sample(logits, SamplingConfig(temperature=1.0, top_p=0.9), g) for g in  # noqa: E731
                         [torch.Generator().manual_seed(seed)] for _ in range(20)]
    assert draw(5) == draw(5) and draw(5) != draw(6)


def test_decode_streams_until_stop_and_feeds_every_token(tiny):
    store = store_for(tiny)
    prefill(tiny, store, [1, 2, 3], 0, "user", 0)
    tokens = list(decode(tiny, store, stop=[], config=SamplingConfig(max_new_tokens=6), turn=0, segment=0))
    assert len(tokens) == 6 and store.length == 9
    reference = full_logits(tiny, [1, 2, 3] + tokens[:-1])
    assert tokens == reference[2:].argmax(-1).tolist()  # greedy continuation of a full forward
    stop = tokens[2]
    store2 = store_for(tiny)
    prefill(tiny, store2, [1, 2, 3], 0, "user", 0)
    stopped = list(decode(tiny, store2, stop=[stop], config=SamplingConfig(max_new_tokens=6), turn=0, segment=0))
    assert stopped == tokens[: tokens.index(stop)]


def test_fork_rolls_back_exactly_and_forbids_eviction(tiny):
    """A fork feeds tokens to read their logits, then restores length, metadata and next-token logits;
    evicting or forking again inside it fails loudly instead of breaking the roll-back."""
    store = store_for(tiny, "hybrid", 40)  # records importance and surprisal outside forks
    prefill(tiny, store, list(range(1, 31)), 0, "user", 0)
    meta, logits = store.meta.state(), store.next_logits.clone()
    keys = store.layers[1].storage.fetch()[0].clone()
    with store.fork():
        assert not store.recording and not store.measuring_surprisal
        store.expect(5, 1, "assistant", 1, [7, 8, 9, 10, 11])
        forward(tiny, store, [7, 8, 9, 10, 11])
        assert store.length == 35 and not torch.equal(store.next_logits, logits)
        with pytest.raises(RuntimeError, match="inside a fork"):
            store.keep(torch.arange(10))
        with pytest.raises(RuntimeError, match="already open"):
            store.fork().__enter__()
    assert store.length == 30 and torch.equal(store.next_logits, logits)
    assert all(torch.equal(meta[name], column) for name, column in store.meta.state().items())
    assert torch.equal(store.layers[1].storage.fetch()[0], keys)
    assert store.recording and store.measuring_surprisal


def test_tokens_fed_by_a_plain_transformers_forward_get_metadata(tiny):
    """model(ids, cache=store) without the engine: the store declares the arrivals itself."""
    store = store_for(tiny)
    prefill(tiny, store, [1, 2, 3], 0, "user", 0)
    with torch.inference_mode():
        tiny(torch.tensor([[4, 5]]), cache=store, position_ids=torch.tensor([[3, 4]]))
    assert store.length == len(store.meta) == 5 and store.meta.turn.tolist() == [0] * 5
    assert store.meta.role[-2:].tolist() == [2, 2] and store.meta.position.tolist() == list(range(5))
