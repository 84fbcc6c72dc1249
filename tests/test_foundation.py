"""Managed KV store, re-rotation, importance, policies and the engine, on real models."""

import torch

from agent.engine import Feed, SamplingConfig, decode, forward, prefill, prefill_packed, sample
from cache.policies import PolicyConfig, make_policy
from cache.store import KVStore


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
    store = KVStore.for_model(tiny)
    seen, policy = [], make_policy("full", PolicyConfig())
    for index, ids in enumerate(turns):
        logits = prefill(tiny, store, policy, ids, turn=index, role="user", segment=index)
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
    names = ["full", "h2o", "window"]

    def build(name, history):
        store = KVStore.for_model(tiny)
        policy = make_policy(name, PolicyConfig(budget=None if name == "full" else 24))
        store.recording = policy.needs_importance
        store.measuring_surprisal = True
        prefill(tiny, store, policy, history, 0, "user", 0)
        return store, policy

    alone = [build(n, h) for n, h in zip(names, histories)]
    together = [build(n, h) for n, h in zip(names, histories)]
    expected = [prefill(tiny, s, p, ids, 1, "user", 1) for (s, p), ids in zip(alone, turns)]
    feeds = [Feed(s, p, 1, 1).add(ids[:3], "user").add(ids[3:], "assistant") for (s, p), ids in zip(together, turns)]
    got = prefill_packed(tiny, feeds)
    for (a, _), (b, _), want, have in zip(alone, together, expected, got):
        assert torch.allclose(want, have, atol=1e-5)
        assert torch.allclose(a.layers[1].storage.fetch()[0], b.layers[1].storage.fetch()[0], atol=1e-5)
        assert torch.allclose(a.meta.importance, b.meta.importance, atol=1e-4)
        assert torch.allclose(a.meta.surprisal, b.meta.surprisal, atol=1e-4)
        assert aligned(b)
    roles = together[2][0].meta.role[-17:].tolist()
    assert roles == [1] * 3 + [2] * 14  # the role runs of one feed are declared in order


def test_compaction_rerotates_keys_to_their_new_positions(tiny):
    torch.manual_seed(2)
    ids = torch.randint(0, 512, (40,)).tolist()
    store = KVStore.for_model(tiny)
    store.expect(len(ids), 0, "user", 0)
    forward(tiny, store, ids)
    keep = torch.tensor([0, 1, 2, 3, 9, 17, 18, 30, 38, 39])
    store.keep(keep)
    fresh = KVStore.for_model(tiny)
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
    store = KVStore.for_model(tiny)
    store.recording = True
    store.expect(len(ids), 0, "user", 0)
    forward(tiny, store, ids)
    layers, heads = tiny.config.num_hidden_layers, tiny.config.num_attention_heads
    # every query head's softmax sums to one, in every layer
    assert torch.isclose(store.meta.importance.sum(), torch.tensor(float(layers * heads * len(ids))), rtol=1e-4)
    # causal masking: a batched prefill gives the same mass as feeding token by token
    stepwise = KVStore.for_model(tiny)
    stepwise.recording = True
    for token in ids:
        stepwise.expect(1, 0, "user", 0)
        forward(tiny, stepwise, [token])
    assert torch.allclose(store.meta.importance, stepwise.meta.importance, atol=1e-4)
    assert store.meta.importance[0] >= layers * heads  # the first query can only attend to the first key
    store.frozen = True
    before = store.meta.importance.clone()
    store.expect(1, 1, "user", 1)
    forward(tiny, store, [3])
    assert torch.equal(store.meta.importance[:-1], before)


def run_policy(tiny, name, budget, pin=None, **extra):
    torch.manual_seed(3)
    policy = make_policy(name, PolicyConfig(budget=budget, **extra))
    store = KVStore.for_model(tiny)
    store.recording = policy.needs_importance
    system = torch.randint(0, 512, (6,)).tolist()
    prefill(tiny, store, policy, system, turn=-1, role="system", segment=-1)
    if pin is not None:
        store.pin(torch.tensor(pin))
    lengths = []
    for turn in range(12):
        ids = torch.randint(0, 512, (int(torch.randint(3, 30, ())),)).tolist()
        prefill(tiny, store, policy, ids, turn=turn, role="user", segment=turn)
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


def test_h2o_keeps_heavy_hitters_recent_window_and_pins(tiny):
    store, lengths = run_policy(tiny, "h2o", 48, pin=[1, 4])
    assert max(lengths) <= 48
    assert int(store.meta.pinned.sum()) == 2 and store.meta.turn[:2].tolist() == [-1, -1]
    assert store.meta.turn[-1] == 11
    assert store.meta.importance.sum() > 0


def test_long_message_is_prefilled_in_chunks_within_budget(tiny):
    policy = make_policy("sink", PolicyConfig(budget=64))
    store = KVStore.for_model(tiny)
    ids = torch.randint(0, 512, (500,)).tolist()
    peak = 0
    chunk = policy.max_chunk()
    for start in range(0, len(ids), chunk):
        prefill(tiny, store, policy, ids[start:start + chunk], 0, "user", 0)
        peak = max(peak, store.length)
    prefill(tiny, store, policy, ids, 1, "user", 1)
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
    policy = make_policy("full", PolicyConfig())
    store = KVStore.for_model(tiny)
    logits = prefill(tiny, store, policy, [1, 2, 3], 0, "user", 0)
    tokens = list(decode(tiny, store, policy, logits, stop=[], config=SamplingConfig(max_new_tokens=6), turn=0, segment=0))
    assert len(tokens) == 6 and store.length == 9
    reference = full_logits(tiny, [1, 2, 3] + tokens[:-1])
    assert tokens == reference[2:].argmax(-1).tolist()  # greedy continuation of a full forward
    stop = tokens[2]
    store2 = KVStore.for_model(tiny)
    logits2 = prefill(tiny, store2, policy, [1, 2, 3], 0, "user", 0)
    stopped = list(decode(tiny, store2, policy, logits2, stop=[stop], config=SamplingConfig(max_new_tokens=6), turn=0, segment=0))
    assert stopped == tokens[: tokens.index(stop)]
