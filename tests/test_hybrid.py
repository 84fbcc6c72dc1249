"""The three-tier hybrid policy and persistent markers (pins), on real models."""

import pytest
import torch

from agent import Agent, AgentConfig, SamplingConfig
from agent.engine import prefill
from cache.policies import HybridConfig, PolicyConfig, make_policy
from tests.helpers import store_for


def run_hybrid(tiny, budget=120, turns=14, sizes=None, **hybrid):
    torch.manual_seed(4)
    store = store_for(tiny, "hybrid", budget, hybrid=HybridConfig(**hybrid))
    policy = store.policy
    prefill(tiny, store, torch.randint(0, 512, (10,)).tolist(), -1, "system", -1)
    history = []
    for turn in range(turns):
        size = sizes[turn] if sizes else int(torch.randint(8, 20, ()))
        prefill(tiny, store, torch.randint(0, 512, (size,)).tolist(), turn, "user", segment=turn // 3)
        assert store.length <= budget
        assert all(layer.storage.length == len(store.meta) for layer in store.layers)
        history.append(store.meta.turn.clone())
    return policy, store, history


def test_permanent_tier_is_never_evicted_and_budget_holds(tiny):
    _, store, history = run_hybrid(tiny)
    assert all(int((turns == -1).sum()) == 10 for turns in history)


def test_hot_tier_holds_the_latest_turns_whole(tiny):
    policy, store, _ = run_hybrid(tiny, budget=160, hot_turns=3)
    tiers = policy.tiers(store.meta)
    hot_turns = torch.unique(store.meta.turn[tiers["hot"]]).tolist()
    assert hot_turns == [11, 12, 13]
    assert int(tiers["hot"].sum()) <= 160  # whole turns, never past the budget


def synthetic_meta(turns=20, size=10):
    from cache.store import TokenMeta

    meta = TokenMeta.empty()
    for turn in range(-1, turns):
        meta = meta.cat(TokenMeta.new(size, len(meta), turn, "user", segment=turn // 4))
    meta.surprisal = torch.rand(len(meta), generator=torch.Generator().manual_seed(0))
    return meta


def test_temporary_tier_keeps_the_most_informative_tokens():
    meta = synthetic_meta()
    policy = make_policy("hybrid", PolicyConfig(budget=100), HybridConfig(context=0, hot_turns=3))
    tiers = policy.tiers(meta)
    keep = torch.zeros(len(meta), dtype=torch.bool)
    keep[policy.select(meta, 100)] = True
    assert int(keep.sum()) == 100
    assert bool(keep[tiers["permanent"]].all()) and bool(keep[tiers["hot"]].all())
    temporary = tiers["temporary"]
    kept, dropped = meta.surprisal[temporary & keep], meta.surprisal[temporary & ~keep]
    assert kept.numel() == 100 - 10 - 30 and kept.min() >= dropped.max()


def test_token_spans_are_ranked_by_the_information_they_hold():
    """One surprising word (5 nats) against a five-digit number of 2 nats per digit: with room for one
    span of five tokens, the number's span holds more and is kept, although each digit scores lower."""
    meta = synthetic_meta()
    meta.surprisal = torch.full((len(meta),), 0.1)
    temporary_start = 10  # turn -1 (10 tokens) is permanent
    meta.surprisal[temporary_start + 20] = 5.0  # the word
    number = torch.arange(temporary_start + 60, temporary_start + 65)
    meta.surprisal[number] = 2.0
    policy = make_policy("hybrid", PolicyConfig(budget=100), HybridConfig(context=2, hot_turns=3, score="surprisal"))
    keep = policy._best_temporary(meta, policy.tiers(meta)["temporary"], room=5)
    assert int(keep.sum()) == 5 and bool(keep[number].all()) and not bool(keep[temporary_start + 20])


def test_segment_granularity_keeps_whole_segments():
    meta = synthetic_meta()
    policy = make_policy("hybrid", PolicyConfig(budget=100), HybridConfig(granularity="segment", hot_turns=3))
    keep = torch.zeros(len(meta), dtype=torch.bool)
    keep[policy.select(meta, 100)] = True
    temporary = policy.tiers(meta)["temporary"]
    partial = [seg for seg in torch.unique(meta.segment[temporary & keep]).tolist()
               if bool((temporary & (meta.segment == seg) & ~keep).any())]
    assert int(keep.sum()) == 100 and len(partial) <= 1


def test_unused_shares_are_lent_exactly():
    """Budget 100: permanent 10 tokens (its 10 % share), temporary share 60 % but only 8 temporary tokens
    (turn 0), so the hot tier may use 100 - 10 - 8 = 82 tokens instead of its 30. Hot turns of 21
    tokens are kept whole, newest first: three fit (63), the oldest hot turn is demoted and competes with
    the temporary tokens for the remaining 27 places, where turn 0's surprising tokens win."""
    from cache.store import TokenMeta

    meta = TokenMeta.new(10, 0, -1, "system", -1)
    for turn, size in enumerate([8, 21, 21, 21, 21]):
        meta = meta.cat(TokenMeta.new(size, len(meta), turn, "user", turn))
    meta.surprisal = (meta.turn == 0).float()
    policy = make_policy("hybrid", PolicyConfig(budget=100), HybridConfig(hot_turns=4, context=0, score="surprisal"))
    keep = torch.zeros(len(meta), dtype=torch.bool)
    keep[policy.select(meta, 100)] = True
    kept = {turn: int(keep[meta.turn == turn].sum()) for turn in range(-1, 5)}
    assert kept == {-1: 10, 0: 8, 1: 19, 2: 21, 3: 21, 4: 21}
    assert int(keep.sum()) == 100


def test_bad_hybrid_configuration_is_rejected():
    with pytest.raises(ValueError, match="shares"):
        make_policy("hybrid", PolicyConfig(budget=100), HybridConfig(permanent_share=0.5, hot_share=0.6))
    with pytest.raises(ValueError, match="granularity"):
        make_policy("hybrid", PolicyConfig(budget=100), HybridConfig(granularity="paragraph"))


def test_pins_survive_eviction_and_count_against_the_budget(embedded):
    agent = Agent(embedded, AgentConfig(policy="window", budget_tokens=64,
                                        sampling=SamplingConfig(max_new_tokens=4)))
    agent.chat("My order number is QX-7731, please keep it.")
    pinned = agent.pin("QX-7731")
    assert pinned > 0 and agent.stats()["pinned_tokens"] == pinned
    for message in ["Tell me about shipping.", "And returns?", "What about warranty terms?", "Thanks a lot!"]:
        agent.chat(message)
        assert agent.store.length <= 64
    assert agent.store.meta.find(agent.format.words(" QX-7731")).numel() + \
        agent.store.meta.find(agent.format.words("QX-7731")).numel() >= pinned
    agent.unpin()
    assert agent.stats()["pinned_tokens"] == 0
    with pytest.raises(ValueError, match="not in the cache"):
        agent.pin("ZZ-0000")
