"""The topic-boundary classifier with its shipped model and real all-MiniLM-L6-v2 embeddings (no mocks)."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from nltk.metrics.segmentation import pk as nltk_pk
from nltk.metrics.segmentation import windowdiff as nltk_windowdiff

from classifiers.segmentation import boundaries_of_decisions, boundaries_of_labels, score_all, score_dialogue
from classifiers.topics import (DECIDE_FEATURES, DEFAULT_MODEL, FORMAT_VERSION, RANK_FEATURES, TopicModel,
                                TopicModelError, TopicTracker, embed, load_embedder)
from classifiers.train import gold_decisions

ROOT = Path(__file__).resolve().parent.parent

REFUND = [
    ("Hi, I returned a blender two weeks ago and I still haven't had my refund.",
     "Sorry about the wait. Can you give me the order number?"),
    ("It's order BH-55120, the red Vortex blender.", "Thanks. I can see the return arrived at our warehouse on the 3rd."),
    ("So why hasn't the refund come through yet?", "It was held because the box was marked as damaged on arrival."),
]
TV = [
    ("Separately, can I add the sports channels to my TV package?", "Yes, the sports pack is fifteen pounds a month."),
    ("Is there a minimum contract for the sports pack?", "No, it's a rolling monthly add-on you can cancel any time."),
]


@pytest.fixture(scope="module", autouse=True)
def cli_with_corrupt_model(tmp_path_factory):
    """`palace topics` with a truncated model file, started first: the CLI imports the whole agent (torch)
    before it gets to the model, so it runs alongside the other tests instead of after them."""
    corrupt = tmp_path_factory.mktemp("cli") / "topics.json"
    corrupt.write_bytes(DEFAULT_MODEL.read_bytes()[:5000])
    process = subprocess.Popen([sys.executable, str(ROOT / "cli.py"), "topics", "--model", str(corrupt),
                                str(ROOT / "tests" / "fixtures" / "topics-natural.jsonl")],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    yield corrupt, process
    process.kill()


@pytest.fixture(scope="session")
def embedder():
    return load_embedder()


@pytest.fixture(scope="session")
def model():
    return TopicModel.load()


def run(model, embedder, exchanges, final_user):
    """Observe every (user, reply) pair, then the final user turn; return the final decision and tracker."""
    texts = [u for u, _ in exchanges] + [final_user]
    replies = [a for _, a in exchanges]
    users, answers = embed(embedder, texts), embed(embedder, replies)
    tracker = TopicTracker(model)
    for i, (user, reply) in enumerate(exchanges):
        tracker.observe(user, embedding=users[i])
        tracker.reply(reply, embedding=answers[i])
    return tracker.observe(final_user, embedding=users[-1]), tracker


def test_clear_switch_is_a_new_topic(model, embedder):
    decision, _ = run(model, embedder, REFUND, "Another thing: I'd like to add the sports channels to my TV package.")
    assert decision.label == "new" and decision.topic_turn == len(REFUND) == decision.segment


def test_going_back_to_the_refund_names_its_first_turn(model, embedder):
    decision, tracker = run(model, embedder, REFUND + TV, "Going back to the refund, has it gone through yet?")
    assert tracker.segments()[:len(REFUND) + len(TV)] == [0] * len(REFUND) + [len(REFUND)] * len(TV)
    assert decision.label == "return:0" and decision.topic_turn == 0 and decision.segment == len(REFUND) + len(TV)


def test_continuation_without_a_cue_stays_continue(model, embedder):
    decision, _ = run(model, embedder, REFUND[:1], "It's order BH-55120, I bought it in March.")
    assert decision.label == "continue" and decision.topic_turn == 0
    decision, _ = run(model, embedder, REFUND[:2], "How long does the warehouse usually take to check a return?")
    assert decision.label == "continue"


def test_ranker_sees_what_the_replies_restated_and_where_a_topic_began(model, embedder):
    """The refund topic, as a candidate: the date only its reply gave counts as a reply entity (not a user
    one), its first turn shares the blender, its last reply closed the matter, and alone it has no margin."""
    final = "Is it true the blender only reached you on the 3rd?"
    _, tracker = run(model, embedder, REFUND + TV[:1], TV[1][0])
    tracker.reply(TV[1][1])
    cand = tracker.candidates(final, embed(embedder, [final])[0])
    row = dict(zip(RANK_FEATURES, cand.pairs[cand.ids.index(0)]))
    assert (row["reply_entities"], row["entities"], row["pending"]) == (1, 0, 0.0)
    assert row["words_first"] > 0 and row["words_own"] == row["words"] > 0
    assert row["sim_max_margin"] == row["words_own_margin"] == 0.0


def test_features_do_not_depend_on_string_hashing():
    """Word weights are summed in a fixed order, so two processes with different hash seeds (set orders)
    compute the same features to the last bit, and training is repeatable."""
    script = ("import numpy as np; from classifiers.topics import Decision, TopicModel, TopicTracker\n"
              "m = TopicModel({}, {}, {'refund': 2.31, 'blender': 3.07, 'warehous': 1.93, 'damag': 2.71}, 4.17)\n"
              "t = TopicTracker(m); e = np.random.default_rng(0).normal(size=(2, 384)).astype(np.float32)\n"
              "t.commit('My blender refund is late, order BH-55120.', e[0], Decision('new', 0, 0))\n"
              "c = t.candidates('Has the warehouse checked the damaged blender box for my refund yet?', e[1])\n"
              "print(repr(c.turn.tolist()), repr(c.current.tolist()))")
    outputs = {subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=ROOT,
                              env={"PYTHONHASHSEED": seed, "PATH": ""}).stdout for seed in ("1", "2", "3")}
    assert len(outputs) == 1 and "nan" not in outputs.pop()


def test_precomputed_embedding_and_saved_state_give_the_same_decisions(model, embedder):
    exchanges = REFUND + TV[:1]
    tracker = TopicTracker(model, embedder)  # computes the embeddings itself
    labels = []
    for user, reply in exchanges:
        labels.append(tracker.observe(user).label)
        tracker.reply(reply)
    restored = TopicTracker.from_state(json.loads(json.dumps(tracker.state())), model)
    final = "Going back to the refund, has it gone through yet?"
    decision, fresh = run(model, embedder, exchanges, final)  # embeddings computed by the caller, batched
    assert [t.label for t in fresh.turns[:-1]] == labels
    assert restored.observe(final, embedding=fresh.turns[-1].embedding).label == decision.label


def test_corrupt_or_foreign_model_file_is_a_one_line_error(tmp_path, cli_with_corrupt_model):
    corrupt = tmp_path / "topics.json"
    corrupt.write_bytes(DEFAULT_MODEL.read_bytes()[:5000])  # truncated
    other = tmp_path / "old.json"
    raw = json.loads(DEFAULT_MODEL.read_text())
    other.write_text(json.dumps({**raw, "format_version": 0}))
    damaged = tmp_path / "damaged.json"
    raw["decider"]["feature"]["data"] = "!!!"
    damaged.write_text(json.dumps(raw))
    for path, words in ((corrupt, "corrupt"), (other, "version"), (damaged, "not a valid"),
                        (tmp_path / "missing.json", "no such")):
        with pytest.raises(TopicModelError) as caught:
            TopicModel.load(path)
        message = str(caught.value)
        assert str(path) in message and words in message and "\n" not in message, message
    cli_corrupt, process = cli_with_corrupt_model
    _, stderr = process.communicate(timeout=240)
    assert process.returncode == 2 and "Traceback" not in stderr
    assert stderr.strip().count("\n") == 0 and str(cli_corrupt) in stderr and "corrupt" in stderr, stderr


def test_pk_and_windowdiff_agree_with_nltk_on_a_hand_checked_example():
    labels = ["a", "a", "a", "b", "b", "a", "a", "b", "b", "b"]
    decisions = ["new", "continue", "continue", "new", "new", "continue", "continue", "return:3", "continue",
                 "continue"]
    ref, hyp = boundaries_of_labels(labels), boundaries_of_decisions(decisions)
    assert (ref, hyp) == ("0001010100", "0001100100")
    s = score_dialogue(labels, decisions)
    # by hand, k = round(10 / (2 * 3)) = 2, 9 windows: Pk differs in window 5 only; WindowDiff in windows 3
    # (hyp counts 2 boundaries, ref 1) and 5 (0 vs 1)
    assert s.pk == pytest.approx(1 / 9) and s.windowdiff == pytest.approx(2 / 9)
    assert s.pk == nltk_pk(ref, hyp, 2) and s.windowdiff == nltk_windowdiff(ref, hyp, 2)
    assert s.boundary_f1 == pytest.approx(2 / 3)  # hits at 3 and 7 of 3 and 3
    assert (s.returns, s.returns_named, s.return_accuracy) == (2, 1, 0.5)  # turn 5 missed, turn 7 named
    total = score_all([s, score_dialogue(labels, gold_decisions(labels))])
    assert total.pk == pytest.approx(1 / 18) and total.return_accuracy == pytest.approx(3 / 4)


def test_gold_decisions_follow_the_labels():
    assert gold_decisions(["a", "a", "b", "a", "c", "b"]) == ["new", "continue", "new", "return:0", "new",
                                                              "return:2"]


def test_shipped_model_is_small_and_versioned(model):
    assert DEFAULT_MODEL.stat().st_size < 1_000_000
    assert json.loads(DEFAULT_MODEL.read_text())["format_version"] == FORMAT_VERSION == 2
    p = model.decide(np.zeros(len(DECIDE_FEATURES)))
    assert p.shape == (3,) and abs(p.sum() - 1) < 1e-9


def test_agent_observe_uses_the_topic_classifier(embedded):
    """With topics tracked, a return joins its earlier topic's segment and stats show the topic."""
    from agent import Agent, AgentConfig
    from tests.helpers import teacher_force

    agent = Agent(embedded, AgentConfig(policy="hybrid", budget_tokens=512, topics=True))
    script = [("I was charged twice for my March invoice, can you refund one of the charges?",
               "I can see the duplicate charge and have started a refund."),
              ("Thanks. Different question: can I add my partner to the account?",
               "Yes, you can add a second user from the account page."),
              ("Going back to the refund for the double charge, when will it arrive?", None)]
    for user, reply in script[:2]:
        teacher_force(agent, user, reply)
    turn = agent.observe(script[2][0])
    assert turn.topic == "return:0" and turn.segment == 0
    stats = agent.stats()
    assert stats["topic"] == 0 and 0 in stats["topic_stack"]


@pytest.fixture
def folder(tmp_path):
    """A folder of four hand-written one-dialogue files (copies of data/dev/dev-01..04)."""
    folder = tmp_path / "hand"
    folder.mkdir()
    for name in ("dev-01", "dev-02", "dev-03", "dev-04"):
        (folder / f"{name}.jsonl").write_text((ROOT / "data" / "dev" / f"{name}.jsonl").read_text())
    return folder


def test_training_weights_a_folder_holds_out_its_share_and_refits_on_everything(tmp_path, embedder, folder):
    """`palace train` on a generated file and a folder of one-dialogue files: the folder is one group of the
    split (a quarter of it held out), its --weight reaches the fit, and --refit saves a model fitted on all."""
    from cli import UserError, parse_weights
    from classifiers.train import collect, embed_all, load_conversations, make_idf, split, train_command

    generated = str(ROOT / "tests" / "fixtures" / "topics-natural.jsonl")
    conversations = load_conversations([generated, str(folder)], {str(folder): 3.0})
    assert {(c.group, c.weight) for c in conversations} == {(generated, 1.0), (str(folder), 3.0)}
    _, test = split(conversations, 0.25, seed=0)
    assert sum(c.group == str(folder) for c in test) == 1  # a folder of four: one held out
    embed_all(conversations, embedder)
    rows = collect(conversations, TopicModel({}, {}, *make_idf(conversations)))
    hand_turns = sum(len(c.users) - 1 for c in conversations if c.weight == 3.0)
    assert [w for *_, w in rows.turns].count(3.0) == hand_turns and 3.0 in rows.rank_w

    lines: list[str] = []
    out = tmp_path / "topics.json"
    model = train_command([generated, str(folder)], str(out), rounds=0, weights=parse_weights([f"{folder}=3"]),
                          refit=True, echo=lines.append)
    assert any(line.startswith("model ") for line in lines) and any("refitted on all" in line for line in lines)
    saved = json.loads(out.read_text())["meta"]
    assert saved["refit_on_all"] and len(saved["train_dialogues"]) == len(conversations)
    assert list(saved["weights"].values()) == [3.0]
    assert TopicModel.load(out).decider and model.decider
    for bad in ("data/dev", "data/dev=lots", "=2", "data/dev=-1"):
        with pytest.raises(UserError, match="--weight takes PATH=K"):
            parse_weights([bad])


def test_cross_validation_scores_each_weight_on_folds_of_the_folder(folder):
    """`palace train --cv FOLDER`: one row per weight, each the mean over folds of the folder's dialogues."""
    from classifiers.train import cross_validate

    generated = str(ROOT / "tests" / "fixtures" / "topics-natural.jsonl")
    lines: list[str] = []
    rows = cross_validate([generated, str(folder)], str(folder), [0.0, 2.0], folds=2, rounds=0, echo=lines.append)
    assert [row["weight"] for row in rows] == [0.0, 2.0] and "2-fold cross-validation over 4 dialogues" in lines[0]
    assert all(0 <= row["pk"] <= 1 and 0 <= row["return_accuracy"] <= 1 for row in rows)
    assert rows[0] != rows[1]  # the hand-written dialogues changed the fitted model
    with pytest.raises(ValueError, match="fewer than 5 folds"):
        cross_validate([generated, str(folder)], str(folder), [1.0], folds=5)

