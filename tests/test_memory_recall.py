"""Long-term memory in the agent loop (memory/recall.py): what the cache evicts is archived after the
reply, and a later turn that names it, returns to its topic or resembles it gets its KV back. Real
components: the tiny random Llama or the embedded SmolLM2, the bundled MiniLM, FAISS and SQLite."""

from __future__ import annotations

import pytest
import torch

from agent import Agent, AgentConfig
from agent.engine import prefill
from cache.meta import NOT_RECALLED, ROLES
from classifiers.acts import asked_kinds, asks_recap, records_outcome, requesters
from memory.embedder import shared_embedder
from memory.recall import LongTermMemory, MemoryConfig, names_in
from tests.helpers import ask, store_for, teacher_force


def spoken(ids: list[int]) -> str:
    return " ".join(f"w{i}" for i in ids)


def tiny_conversation(tiny, budget: int, config: MemoryConfig = MemoryConfig(), policy: str = "window"):
    """A store (window by default) with memory over the tiny model; turn t's message is `texts[t]`."""
    store = store_for(tiny, policy, budget)
    memory = LongTermMemory(store, shared_embedder(), spoken, config)
    prefill(tiny, store, [1, 2, 3, 4], -1, "system", -1)
    return store, memory


def say(tiny, store, memory, turn: int, text: str, size: int = 12, role: str = "user") -> list[int]:
    memory.messages[(turn, role)] = text
    seed = turn if role == "user" else 1000 + turn
    ids = torch.randint(5, 500, (size,), generator=torch.Generator().manual_seed(seed)).tolist()
    prefill(tiny, store, ids, turn, role, turn)
    memory.settle()
    return ids


TEXTS = ["My dog Biscuit needs a vet appointment on Friday.", "What are your opening hours?",
         "Do you sell winter tyres for a small hatchback?", "Can I pay by bank transfer?",
         "How long does delivery to Oslo take?", "Is there parking near the shop?"]


def test_evicted_messages_are_archived_once_and_an_entity_brings_them_back(tiny):
    store, memory = tiny_conversation(tiny, budget=48, config=MemoryConfig(placement="chronological"))
    for turn, text in enumerate(TEXTS):
        say(tiny, store, memory, turn, text)
    archived = memory.archive.segments_for("local", "default", turns=range(0, 1))
    assert archived and all(r.text == TEXTS[0] for r in archived)  # embedded and found as its whole message
    assert not bool((store.meta.turn == 0).any())
    before = [memory.archive.get(r.id).keys.clone() for r in archived]
    recalled = memory.recall(6, shared_embedder().embed("How is Biscuit doing?")[0], ["biscuit"], None)
    # the splice re-rotated copies of the archived keys, never the archive's own (recall reads them uncopied)
    assert all(torch.equal(memory.archive.get(r.id).keys, keys) for r, keys in zip(archived, before))
    assert [(r.turn, r.reason, r.detail, r.tokens) for r in recalled][:1] == [(0, "entity", "biscuit", 12)]
    back = store.meta.turn == 0
    assert int(back.sum()) == 12 and bool((store.meta.recalled_at[back] == 6).all())
    assert store.length <= 48 and store.meta.serial.tolist() == sorted(store.meta.serial.tolist())  # chronological
    store.policy.make_room(store, 48)  # everything evicted again: the recalled tokens are not archived twice
    memory.settle()
    assert memory.archive.segments_for("local", "default", turns=range(0, 1)) == archived
    memory.close()


def test_recall_stays_within_its_share_and_skips_what_the_cache_holds(tiny):
    store, memory = tiny_conversation(tiny, budget=64, config=MemoryConfig(share=0.25, threshold=-1.0))
    for turn, text in enumerate(TEXTS):
        say(tiny, store, memory, turn, text)
    recalled = memory.recall(6, shared_embedder().embed("winter tyres and parking")[0], [], None)
    assert recalled and sum(r.tokens for r in recalled) <= 16
    assert all(r.reason == "similar" for r in recalled)
    assert all(not bool(((store.meta.turn == r.turn) & (store.meta.recalled_at == NOT_RECALLED)).any())
               for r in recalled)  # only turns the cache had lost
    assert store.length <= 64
    recalled_rows = torch.nonzero(store.meta.recalled_at == 6).flatten()  # placed at the end, the default
    assert recalled_rows.tolist() == list(range(store.length - recalled_rows.numel(), store.length))
    again = memory.recall(7, shared_embedder().embed("winter tyres and parking")[0], [], None)
    assert {r.turn for r in again}.isdisjoint({r.turn for r in recalled})  # held now: nothing to bring back
    memory.close()


def test_a_recalled_turn_comes_back_whole_and_what_the_cache_held_of_it_stays(tiny):
    """A turn's evicted tokens come back and the ones the cache still held are marked used at the same
    turn, so the hybrid's room for the first is not made by evicting the second (its hot tier keeps turns
    by last use); evicted again later, those held tokens are archived, being new to the archive."""
    question = "Is Biscuit's vet appointment still on?"
    store, memory = tiny_conversation(tiny, budget=46, config=MemoryConfig(threshold=2.0), policy="hybrid")
    for turn, text in enumerate(TEXTS):
        say(tiny, store, memory, turn, text)
    held = int((store.meta.turn == 0).sum())
    assert 0 < held < 12  # the hybrid kept a few of turn 0's tokens: the rest is archived
    recalled = memory.recall(6, shared_embedder().embed(question)[0], names_in(question), None)
    assert [(r.turn, r.reason, r.tokens) for r in recalled] == [(0, "entity", 12 - held)]
    back = store.meta.turn == 0
    assert int(back.sum()) == 12 and bool((store.meta.recalled_at[back] == 6).all()) and store.length <= 46
    store.policy.make_room(store, 46)  # all of it evicted: only the tokens that were held are new to the archive
    memory.settle()
    assert sum(len(memory.kept[r.id][1]) for r in memory.archive.segments_for("local", "default", turns=range(0, 1))) == 12
    memory.close()


@pytest.mark.parametrize("where", ["inside the reply", "across the two messages"])
def test_recall_leaves_out_what_forget_marks_inside_a_message_never_across_two(tiny, where):
    """`forget` (the superseded values' pieces) is asked once for all the recalled messages together; a
    token sequence marked inside one message stays out, while the same sequence made of the user's last
    token and the reply's first is no value of either message and comes back."""
    store, memory = tiny_conversation(tiny, budget=48)
    user = say(tiny, store, memory, 0, TEXTS[0])
    reply = say(tiny, store, memory, 0, "Booked for Friday.", role="assistant")
    for turn, text in enumerate(TEXTS[1:5], 1):
        say(tiny, store, memory, turn, text)
    pair = reply[3:5] if where == "inside the reply" else [user[-1], reply[0]]
    forget = lambda meta: torch.zeros(len(meta), dtype=torch.bool).index_fill_(0, meta.find(pair), True)  # noqa: E731
    recalled = memory.recall(5, shared_embedder().embed("Is Biscuit booked?")[0], ["biscuit"], None, forget=forget)
    assert [(r.turn, r.tokens) for r in recalled] == [(0, 24)]
    back = store.meta.token[store.meta.turn == 0].tolist()
    assert back == (user + reply[:3] + reply[5:] if where == "inside the reply" else user + reply)
    memory.close()


def test_an_entity_is_matched_as_a_whole_word_without_possessives_weekdays_or_labels(tiny):
    assert names_in("Helen: Remind me what Tom's MOT on Friday costs, ref AB-123?") == ["ab-123", "mot", "tom"]
    store, memory = tiny_conversation(tiny, budget=28, config=MemoryConfig(share=1.0, threshold=2.0))
    for turn, text in enumerate(["My mother rang about the van.", "The MOT for the van is in May.", *FILLER[:3]]):
        say(tiny, store, memory, turn, text)
    question = "When is the MOT?"
    recalled = memory.recall(5, shared_embedder().embed(question)[0], names_in(question), None)
    assert [(r.turn, r.reason, r.detail) for r in recalled] == [(1, "entity", "mot")]  # not "mot" in "mother"
    memory.close()


SETTLED = [("My dog Biscuit needs a vet appointment on Friday.", "I've booked Biscuit in with the vet for Friday at 10am."),
           ("Is Dr Patel in on Mondays?", "Dr Patel works Mondays and Thursdays."),
           ("Two winter tyres for the Fiesta, please.", "Booked: two winter tyres, fitted on Saturday morning."),
           ("Can I pay by bank transfer?", "Yes, bank transfer is fine."),
           ("How long does delivery to Oslo take?", "Delivery to Oslo takes three days."),
           ("Is there parking near the shop?", "There's a car park behind the shop.")]


def test_a_recap_request_brings_back_the_replies_that_recorded_outcomes_first(tiny):
    """"One line on what we sorted, for Dr Patel": the replies that booked something come back first, newest
    first, without their user turns (Patel is whom the recap is for); without recaps the name's turn does."""
    request = "Could you give me one line on what we sorted today? It's for Dr Patel."
    assert asks_recap(request) and not asks_recap("What did I set the password to?")
    assert [records_outcome(reply) for _, reply in SETTLED] == [True, False, True, False, False, False]

    def recalled(config: MemoryConfig) -> tuple[list[tuple[int, str]], torch.Tensor]:
        store, memory = tiny_conversation(tiny, budget=48, config=config)
        for turn, (text, reply) in enumerate(SETTLED):
            say(tiny, store, memory, turn, text)
            say(tiny, store, memory, turn, reply, role="assistant")
        found = memory.recall(6, shared_embedder().embed(request)[0], names_in(request), None, recap=asks_recap(request))
        assert store.length <= 48
        roles = store.meta.role[store.meta.recalled_at == 6]
        memory.close()
        return [(r.turn, r.reason) for r in found], roles

    order, roles = recalled(MemoryConfig(threshold=2.0))
    assert order == [(2, "recap"), (0, "recap")] and roles.numel() == 24
    assert bool((roles == ROLES["assistant"]).all())
    assert recalled(MemoryConfig(threshold=2.0, recaps=False))[0] == [(1, "entity")]


def test_a_turn_asking_for_an_identifier_brings_back_where_it_was_given_first(tiny):
    """"The vet wants our policy number. What is it?" names no value: the turn whose sentence names a policy
    and holds a code comes back first, even though the reply, not the user, gave the number."""
    question = "The vet wants our policy number, and I can't find the email. What is it?"
    assert asked_kinds(question) == ["policy"] and asked_kinds("My policy number is HPI-338207.") == []
    said = [("I've two cats insured with you.", "I've found policy HPI-338207 with Biscuit and Mabel on it."),
            *[(text, "Yes, that's fine.") for text in TEXTS[1:]]]
    def first_recalled(config: MemoryConfig) -> list[tuple[int, str, str]]:
        store, memory = tiny_conversation(tiny, budget=48, config=config)
        for turn, (text, reply) in enumerate(said):
            say(tiny, store, memory, turn, text)
            say(tiny, store, memory, turn, reply, role="assistant")
        found = memory.recall(6, shared_embedder().embed(question)[0], names_in(question), None,
                              asked=asked_kinds(question))
        assert store.length <= 48
        memory.close()
        return [(r.turn, r.reason, r.detail) for r in found][:1]

    assert first_recalled(MemoryConfig(threshold=2.0)) == [(0, "asked", "policy")]
    assert first_recalled(MemoryConfig(threshold=2.0, identifiers=False)) != [(0, "asked", "policy")]


SIGNED = ["The strip-out starts on Monday the 3rd of March, the builders said.", "Can the skip go on the drive? - Priya",
          "Is there parking on the street for the van? - Priya", "Do we need to empty the loft first? - Priya",
          "What time does the pool open on Sunday?", "Are there lockers for bikes outside?"]


def test_a_name_that_says_who_asks_brings_its_turns_back_last(tiny):
    """"Which Monday does the strip-out start? - Priya": Priya signs every message, so her name says who asks,
    not what about; the turn like the question comes back first, and her other turns only after it."""
    question = "Which Monday does the strip-out start again? - Priya"
    assert requesters(question) == {"priya"} and "priya" in names_in(question)
    assert requesters("Geoffrey wants to know which day. Tom's asking too.") == {"geoffrey", "tom"}
    assert requesters("Helen: is it Friday?") == {"helen"} and requesters("What did Sarah say about it?") == set()

    def recalled(config: MemoryConfig) -> list[tuple[int, str]]:
        store, memory = tiny_conversation(tiny, budget=60, config=config)
        for turn, text in enumerate(SIGNED):
            say(tiny, store, memory, turn, text)
        found = memory.recall(len(SIGNED), shared_embedder().embed(question)[0], names_in(question), None,
                              requesters=requesters(question))
        assert store.length <= 60
        memory.close()
        return [(r.turn, r.reason) for r in found]

    order = recalled(MemoryConfig(threshold=0.5))
    assert order[0] == (0, "similar") and order[1:] and all(reason == "entity" for _, reason in order[1:])
    assert recalled(MemoryConfig(threshold=0.5, requesters=False))[0][1] == "entity"


def test_recall_never_crosses_users(tiny):
    """One archive, two users: one user's memories never come back for another."""
    store, memory = tiny_conversation(tiny, budget=40, config=MemoryConfig(user_id="alice", threshold=-1.0))
    for turn, text in enumerate(TEXTS):
        say(tiny, store, memory, turn, text)
    other = LongTermMemory(store_for(tiny, "window", 40), shared_embedder(), spoken,
                           MemoryConfig(user_id="bob", threshold=-1.0))
    other.archive.close()
    other.archive = memory.archive  # the same archive, searched for another user
    assert other.recall(6, shared_embedder().embed(TEXTS[0])[0], ["biscuit"], None) == []
    memory.close()


FILLER = ["Do you have the blue towels in stock?", "What time does the pool open on Sunday?",
          "Can I bring a guest to the sauna?", "Is the spin class full this week?",
          "How much is a personal trainer session?", "Are there lockers for bikes outside?",
          "Can I freeze my membership while travelling?", "Do you sell protein bars at the desk?"]


def test_a_fact_evicted_long_ago_is_recalled_when_asked_and_wins(embedded):
    """Turn 1 states a fact; a window of 256 tokens has evicted it by turn 30; at turn 45 the user asks
    for it, memory re-injects turn 1, and the correct choice scores best."""
    config = AgentConfig(policy="window", budget_tokens=256, memory=MemoryConfig())
    agent = Agent(embedded, config)
    teacher_force(agent, "Hi, I am setting up my gym membership today.", "Welcome! Happy to help you set it up.")
    teacher_force(agent, "My locker code is 4817, please put it on my account.",
                  "Done: locker code 4817 is saved on your account.")
    for turn in range(2, 45):
        teacher_force(agent, FILLER[turn % len(FILLER)], "Yes, that is possible; the front desk can help.")
        if turn == 30:
            assert not bool((agent.store.meta.turn == 1).any())
    assert len(agent.memory.archive.segments_for("local", "default", turns=range(1, 2)))
    turn = ask(agent, "Sorry, what was my locker code again?")
    assert 1 in [r.turn for r in turn.recalled]
    scores = agent.score(["Your locker code is 4817.", "Your locker code is 5930.", "Your locker code is 1264."])
    assert max(range(3), key=scores.__getitem__) == 0
    assert agent.stats()["memory"]["archived_segments"] == len(agent.memory.archive)


def test_text_baseline_reencodes_the_recalled_tokens_once(tiny):
    """reinject "text": the recalled turn's tokens are re-prefilled after the cache with their own ids,
    take back their serials and turn, and are neither archived again nor recalled a second time."""
    store = store_for(tiny, "window", 48)
    memory = LongTermMemory(store, shared_embedder(), spoken, MemoryConfig(reinject="text"),
                            feed=lambda ids, turn: prefill(tiny, store, ids, turn, "user", turn))
    prefill(tiny, store, [1, 2, 3, 4], -1, "system", -1)
    for turn, text in enumerate(TEXTS):
        say(tiny, store, memory, turn, text)
    parts = [memory.archive.get(r.id) for r in memory.archive.segments_for("local", "default", turns=range(0, 1))]
    tokens = [t for part in parts for t in part.tokens]
    serials = torch.cat([part.serials for part in parts]).tolist()
    recalled = memory.recall(6, shared_embedder().embed("How is Biscuit doing?")[0], ["biscuit"], None)
    assert recalled[0].turn == 0
    back = torch.nonzero(store.meta.recalled_at == 6).flatten()
    assert back.tolist() == list(range(store.length - back.numel(), store.length))
    assert store.meta.token[back].tolist() == tokens and store.meta.serial[back].tolist() == serials == sorted(serials)
    assert bool((store.meta.turn[back] == 0).all()) and store.length <= 48
    assert all(r.turn != 0 for r in memory.recall(7, shared_embedder().embed("Biscuit")[0], ["biscuit"], None))
    memory.close()
