"""Training and evaluation of the topic classifier (`palace train`, `palace topics`).

Training uses the turns' `topic` labels (docs/dialogue-format.md, "Topics"). The tracker is run over
each training dialogue with the *gold* decisions committed (teacher forcing), so the features at turn
t are exactly what the online tracker computes there; the ranker learns which earlier topic a turn
belongs to, the decider continue / new / return. Evaluation runs the tracker on its own decisions.

Baselines on the same turns:
- TextTiling-style: a boundary where the turn's similarity to the mean of the previous two turns'
  embeddings falls below a threshold; at a boundary, a return to the earlier segment with the most
  similar centroid if that similarity clears a second threshold (both tuned on the training split);
- every turn is a boundary (every turn `new`).
"""

from __future__ import annotations

import json
import math
import random
import statistics
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import numpy as np

from classifiers.segmentation import Scores, score_all, score_dialogue
from classifiers.topics import (DECISIONS, DEFAULT_MODEL, EMBED_DIM, FORMAT_VERSION, Decision, TopicModel,
                                TopicTracker, analyse, embed, load_embedder)

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DATA = [str(ROOT / "data" / "dialogues.jsonl"), str(ROOT / "data" / "topics"), str(ROOT / "data" / "dev")]
# Every dialogue counts once by default (`--weight PATH=K` changes that). Five-fold cross-validation over
# data/dev/ (then dev-01..20; each fold trained on the generator's 228 dialogues and the other 16 hand-written
# ones) gave, with format-1 features, Pk 0.198 / 0.205 / 0.200 and return accuracy 0.544 / 0.523 / 0.522 for
# weights 1 / 3 / 6 on the hand-written ones, and 0.288 / 0.397 without them (`palace train --cv data/dev`;
# README "Topic boundaries"). At weight 1 the same folds give Pk 0.196 / return accuracy 0.529 with format 1
# and 0.193 / 0.552 with format 2 (its ranker features, the decider fitted on out-of-fold ranker scores);
# other folds (--seed 1) 0.194 / 0.518 and 0.203 / 0.539; over dev-01..32, 0.197 / 0.533 and 0.195 / 0.529.
DEFAULT_WEIGHTS: dict[str, float] = {}


@dataclass
class Conversation:
    """One dialogue as the classifier sees it: user turns, replies, labels (or None) and embeddings."""
    id: str
    users: list[str]
    replies: list[str | None]
    labels: list[str | None]
    user_emb: np.ndarray | None = None
    reply_emb: np.ndarray | None = None
    source: str = ""  # the file
    group: str = ""  # the path it was loaded through (a file or a folder): held-out shares are per group
    weight: float = 1.0  # of its rows in training

    @property
    def labelled(self) -> bool:
        return all(label is not None for label in self.labels)


def load_conversations(paths: list[str], weights: dict[str, float] | None = None) -> list[Conversation]:
    """The dialogues of each path; `weights` maps a path (as given, or resolved) to its dialogues' weight."""
    from agent.eval.dialogue import dialogue_files, load_dialogues

    resolved = {str(Path(k).resolve()): w for k, w in (weights or {}).items()}
    out = []
    for path in paths:
        weight = resolved.get(str(Path(path).resolve()), 1.0)
        for file in dialogue_files([path]):
            for d in load_dialogues([file]):
                out.append(Conversation(d.id, [t.user for t in d.turns], [t.assistant for t in d.turns],
                                        [t.topic for t in d.turns], source=str(file), group=path, weight=weight))
    return out


def embed_all(conversations: list[Conversation], embedder) -> None:
    """Embed every user turn and reply once (batched; identical texts share one embedding)."""
    texts = sorted({t for c in conversations for t in c.users + [r for r in c.replies if r]})
    table = dict(zip(texts, embed(embedder, texts)))
    zero = np.zeros(EMBED_DIM, np.float32)
    for c in conversations:
        c.user_emb = np.stack([table[u] for u in c.users])
        c.reply_emb = np.stack([table[r] if r else zero for r in c.replies])


def gold_decisions(labels: list[str]) -> list[str]:
    first: dict[str, int] = {}
    out = []
    for t, label in enumerate(labels):
        if t and label == labels[t - 1]:
            out.append("continue")
        elif label in first:
            out.append(f"return:{first[label]}")
        else:
            out.append("new")
        first.setdefault(label, t)
    return out


def make_idf(conversations: list[Conversation]) -> tuple[dict[str, float], float]:
    """Smoothed idf of content-word stems over messages (user and assistant), words seen twice or more."""
    df: dict[str, int] = {}
    n = 0
    for c in conversations:
        for text in c.users + [r for r in c.replies if r]:
            n += 1
            for w in analyse(text).words:
                df[w] = df.get(w, 0) + 1
    idf = lambda k: math.log((n + 1) / (k + 1)) + 1  # noqa: E731
    return {w: round(idf(k), 4) for w, k in sorted(df.items()) if k >= 2}, round(idf(1), 4)


# --- training ---------------------------------------------------------------------------------------


@dataclass
class Rows:
    rank_x: list = field(default_factory=list)
    rank_y: list = field(default_factory=list)
    rank_w: list = field(default_factory=list)
    rank_d: list = field(default_factory=list)  # the dialogue (its index in the training list) of each row
    turns: list = field(default_factory=list)  # (Candidates, gold kind, gold topic, dialogue, weight)


def target(labels: list[str], t: int, tracker: TopicTracker) -> tuple[str, int]:
    """The right decision at turn t given the tracker's state (its own topics, which may be wrong):
    continue where the labels do not change; at a labelled boundary, a return to the most recent other
    topic whose first turn has this turn's label, else new. In the gold state this is the gold decision."""
    if t == 0:
        return "new", 0
    if labels[t] == labels[t - 1]:
        return "continue", tracker.current_topic
    current = tracker.current_topic
    same = [tp for tp in tracker.topics.values() if tp.first != current and labels[tp.first] == labels[t]]
    if same:
        return "return", max(same, key=lambda tp: tp.last).first
    return "new", t


def collect(conversations: list[Conversation], features_model: TopicModel, policy: TopicModel | None = None,
            rows: Rows | None = None) -> Rows:
    """Features and right decisions at every turn. policy None: the gold decisions are committed
    (teacher forcing); else the policy's own decisions are, so the rows cover the states the online
    tracker gets into after its mistakes (one round of DAgger)."""
    rows = rows or Rows()
    for d, c in enumerate(conversations):
        tracker = TopicTracker(policy or features_model)
        for t, text in enumerate(c.users):
            e = c.user_emb[t]
            cand = tracker.candidates(text, e)
            kind, topic = target(c.labels, t, tracker)
            if t:
                if kind == "return" or not RANK_ON_RETURNS_ONLY:
                    for cid, x in zip(cand.ids, cand.pairs):
                        rows.rank_x.append(x)
                        rows.rank_y.append(int(cid == topic))
                        rows.rank_w.append(c.weight)
                        rows.rank_d.append(d)
                rows.turns.append((cand, kind, topic, d, c.weight))
            decision = tracker._decide(cand) if policy is not None else Decision(kind, t, topic)
            tracker.commit(text, e, decision)
            if c.replies[t]:
                tracker._add_reply(c.replies[t], c.reply_emb[t])
    return rows


def fit_logistic(x: np.ndarray, y: np.ndarray, c: float, w: np.ndarray | None = None) -> dict:
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    scaler = StandardScaler().fit(x)
    scale = np.where(scaler.scale_ > 1e-9, scaler.scale_, 1.0)
    lr = LogisticRegression(C=c, max_iter=5000).fit((x - scaler.mean_) / scale, y, sample_weight=w)
    params = {"mean": scaler.mean_, "scale": scale, "coef": lr.coef_, "intercept": lr.intercept_}
    # the tracker computes the probabilities from these parameters: check that they agree with sklearn
    from classifiers.topics import _logistic

    probe = x[: min(len(x), 200)]
    assert np.allclose(_logistic(params, probe), lr.predict_proba((probe - scaler.mean_) / scale), atol=1e-6)
    return params


BOOSTING = {"iterations": 150, "leaves": 8, "min_samples_leaf": 20, "learning_rate": 0.1, "members": 1,
            "max_features": 1.0}


def fit_boosted(x: np.ndarray, y: np.ndarray, w: np.ndarray | None = None) -> dict:
    """Gradient-boosted trees (sklearn), exported as arrays. With several members (each on a random half
    of the features) the trees of all are merged into one forest whose raw score is their mean."""
    from sklearn.ensemble import HistGradientBoostingClassifier

    from classifiers.topics import _boosted, _probabilities, export_boosted

    members = []
    for m in range(BOOSTING["members"]):
        members.append(HistGradientBoostingClassifier(
            max_iter=BOOSTING["iterations"], learning_rate=BOOSTING["learning_rate"], max_leaf_nodes=BOOSTING["leaves"],
            min_samples_leaf=BOOSTING["min_samples_leaf"], l2_regularization=1.0, max_features=BOOSTING["max_features"],
            early_stopping=False, random_state=m).fit(x, y, sample_weight=w))
    parts = [export_boosted(clf) for clf in members]
    width = max(p["feature"].shape[1] for p in parts)
    params = {}
    for k, fill in (("feature", 0), ("threshold", 0.0), ("left", 0), ("right", 0), ("leaf", True), ("value", 0.0)):
        params[k] = np.concatenate([np.pad(p[k], ((0, 0), (0, width - p[k].shape[1])), constant_values=fill)
                                    for p in parts])
    params["value"] = params["value"] / len(parts)
    params["depth"] = np.asarray(max(int(p["depth"]) for p in parts))
    params["classes"] = parts[0]["classes"]
    params["baseline"] = np.mean([p["baseline"] for p in parts], axis=0)
    probe = x[: min(len(x), 300)]
    raw = np.mean([clf._raw_predict(probe) for clf in members], axis=0)
    assert np.allclose(_boosted(params, probe), _probabilities(raw), atol=1e-6)
    if len(members) == 1:
        assert np.allclose(_boosted(params, probe), members[0].predict_proba(probe), atol=1e-6)
    params.pop("_flat", None)
    return params


def fit_part(x: np.ndarray, y: np.ndarray, w: np.ndarray, kind: str, c: float) -> dict:
    return fit_boosted(x, y, w) if kind == "boosted" else fit_logistic(x, y, c, w)


KIND = {"ranker": "boosted", "decider": "boosted"}  # or "logistic"
RANK_ON_RETURNS_ONLY = True  # the ranker learns which earlier topic a return goes to
STACK_FOLDS = 3  # folds of the training dialogues for the decider's out-of-fold ranker scores


def fit_rows(rows: Rows, idf: dict, default_idf: float, c_rank: float, c_decide: float) -> TopicModel:
    """The ranker on every row; the decider on ranker scores of dialogues the scoring ranker was not fitted
    on (one ranker per fold of the dialogues), as the scores of unseen dialogues are at test time: scored
    in-sample, the ranker looks surer than it is, and the decider learns to trust it too much."""
    rx, ry, rw = np.asarray(rows.rank_x), np.asarray(rows.rank_y), np.asarray(rows.rank_w)
    fold = np.asarray(rows.rank_d) % STACK_FOLDS
    model = TopicModel(fit_part(rx, ry, rw, KIND["ranker"], c_rank), {}, idf, default_idf)
    scorers = [TopicModel(fit_part(rx[fold != f], ry[fold != f], rw[fold != f], KIND["ranker"], c_rank), {}, idf,
                          default_idf) for f in range(STACK_FOLDS)]
    tracker = TopicTracker(model)
    xs, ys, ws = [], [], []
    for cand, kind, _, dialogue, weight in rows.turns:
        scores = scorers[dialogue % STACK_FOLDS].rank(cand.pairs) if cand.ids else np.zeros(0)
        x, _ = tracker.decide_features(cand, scores)
        xs.append(x)
        ys.append(DECISIONS.index(kind))
        ws.append(weight)
    model.decider = fit_part(np.asarray(xs), np.asarray(ys), np.asarray(ws), KIND["decider"], c_decide)
    return model


def fit(train: list[Conversation], c_rank: float = 1.0, c_decide: float = 1.0, rounds: int = 2) -> TopicModel:
    """Teacher-forced rows, then `rounds` rounds of rows from the model's own online states (DAgger)."""
    idf, default_idf = make_idf(train)
    rows = collect(train, TopicModel({}, {}, idf, default_idf))
    model = fit_rows(rows, idf, default_idf, c_rank, c_decide)
    for _ in range(rounds):
        rows = collect(train, model, policy=model, rows=rows)
        model = fit_rows(rows, idf, default_idf, c_rank, c_decide)
    return model


# --- running and baselines --------------------------------------------------------------------------


def run_model(model: TopicModel, c: Conversation, timings: list[float] | None = None) -> list[str]:
    tracker = TopicTracker(model)
    out = []
    for t, text in enumerate(c.users):
        started = time.perf_counter()
        decision = tracker.observe(text, embedding=c.user_emb[t])
        if timings is not None:
            timings.append((time.perf_counter() - started) * 1000)
        out.append(decision.label)
        if c.replies[t]:
            tracker.reply(c.replies[t], embedding=c.reply_emb[t])
    return out


def run_texttiling(c: Conversation, threshold: float, return_threshold: float, window: int = 2) -> list[str]:
    """Online TextTiling-style segmentation with similarity-threshold returns."""
    out, segment_of, centroids = [], [], {}
    e = c.user_emb
    for t in range(len(c.users)):
        if t == 0:
            out.append("new"); segment_of.append(0); centroids[0] = e[0].copy()
            continue
        block = e[max(0, t - window):t].mean(axis=0)
        sim = float(block @ e[t] / (np.linalg.norm(block) or 1.0))
        if sim >= threshold:
            out.append("continue"); topic = segment_of[-1]
        else:
            best, best_sim = None, -2.0
            for k, s in centroids.items():
                if k != segment_of[-1]:
                    v = float(s @ e[t] / (np.linalg.norm(s) or 1.0))
                    if v > best_sim:
                        best, best_sim = k, v
            if best is not None and best_sim >= return_threshold:
                out.append(f"return:{best}"); topic = best
            else:
                out.append("new"); topic = t
                centroids[t] = np.zeros(EMBED_DIM, np.float32)
        segment_of.append(topic)
        centroids[topic] = centroids[topic] + e[t]
    return out


def run_every_turn(c: Conversation) -> list[str]:
    return ["new"] * len(c.users)


def tune_texttiling(train: list[Conversation]) -> dict:
    """Thresholds that minimise mean Pk on the training split, then maximise return F1 there."""
    def pk_of(th: float) -> float:
        return score_all([score_dialogue(c.labels, run_texttiling(c, th, 2.0)) for c in train]).pk

    grid = [round(x, 3) for x in np.arange(0.0, 0.85, 0.025)]
    threshold = min(grid, key=pk_of)

    def return_f1(rt: float) -> float:
        s = score_all([score_dialogue(c.labels, run_texttiling(c, threshold, rt)) for c in train])
        p = s.return_precision
        r = s.return_accuracy
        return 2 * p * r / (p + r) if p + r else 0.0

    return_threshold = max([round(x, 3) for x in np.arange(0.0, 0.95, 0.025)], key=return_f1)
    return {"threshold": float(threshold), "return_threshold": float(return_threshold), "window": 2}


def methods(model: TopicModel) -> dict[str, Callable[[Conversation], list[str]]]:
    tt = model.texttiling or {"threshold": 0.3, "return_threshold": 0.5, "window": 2}
    return {"model": lambda c: run_model(model, c),
            "texttiling": lambda c: run_texttiling(c, tt["threshold"], tt["return_threshold"], tt.get("window", 2)),
            "every-turn": run_every_turn}


def evaluate(conversations: list[Conversation], run: Callable[[Conversation], list[str]]) -> tuple[Scores, list]:
    per = []
    for c in conversations:
        if c.labelled:
            per.append((c, run(c)))
    scores = [score_dialogue(c.labels, d) for c, d in per]
    return score_all(scores), list(zip(per, scores))


def split(conversations: list[Conversation], share: float, seed: int) -> tuple[list, list]:
    """A random held-out share of every group's dialogues (each path given: a file, or a folder of
    one-dialogue files), so each kind of dialogue is in both."""
    train, test = [], []
    by_group: dict[str, list[Conversation]] = {}
    for c in conversations:
        by_group.setdefault(c.group, []).append(c)
    for group in by_group.values():
        n = len(group)
        test_idx = set(random.Random(seed).sample(range(n), max(1, round(n * share)))) if n > 1 else set()
        train += [c for i, c in enumerate(group) if i not in test_idx]
        test += [c for i, c in enumerate(group) if i in test_idx]
    return train, test


def table_rows(results: dict[str, Scores]) -> list[str]:
    lines = [f"{'method':12} {'Pk':>6} {'WinDiff':>8} {'bF1':>6} {'ret.acc':>8} {'ret.prec':>9}  turns bounds returns"]
    for name, s in results.items():
        lines.append(f"{name:12} {s.pk:6.3f} {s.windowdiff:8.3f} {s.boundary_f1:6.3f} {s.return_accuracy:8.3f} "
                     f"{s.return_precision:9.3f}  {s.turns:5} {s.boundaries:6} {s.returns:7}")
    return lines


# --- commands ---------------------------------------------------------------------------------------


def train_command(data: list[str] | None, out: str | None, test_share: float = 0.25, seed: int = 0,
                  c_rank: float = 1.0, c_decide: float = 1.0, rounds: int = 2,
                  weights: dict[str, float] | None = None, refit: bool = False,
                  echo: Callable[[str], None] = print) -> TopicModel:
    """`palace train`: fit on the labelled dialogues in `data` (default: data/dialogues.jsonl, data/topics/
    and data/dev/; never data/heldout/), print the held-out split's figures next to the baselines, save.
    With `refit`, the saved model is fitted again on every dialogue, the held-out share included."""
    data = data or DEFAULT_DATA
    weights = DEFAULT_WEIGHTS if weights is None else weights
    conversations = [c for c in load_conversations(data, weights) if c.labelled]
    if len(conversations) < 4:
        raise ValueError(f"need at least 4 dialogues with topic labels on every turn, found {len(conversations)}")
    train, test = split(conversations, test_share, seed)
    echo(f"{len(conversations)} labelled dialogues: {len(train)} train, {len(test)} held out "
         f"(seed {seed}): {', '.join(c.id for c in test)}")
    started = time.perf_counter()
    embed_all(conversations, load_embedder())
    echo(f"embedded {sum(len(c.users) for c in conversations)} turns and their replies "
         f"in {time.perf_counter() - started:.1f} s")
    started = time.perf_counter()
    model = fit(train, c_rank, c_decide, rounds)
    model.texttiling = tune_texttiling(train)
    echo(f"fitted in {time.perf_counter() - started:.0f} s")
    results = {name: evaluate(test, run)[0] for name, run in methods(model).items()}
    for line in table_rows(results):
        echo(line)
    if refit:
        started = time.perf_counter()
        texttiling = model.texttiling
        model = fit(conversations, c_rank, c_decide, rounds)
        model.texttiling = texttiling
        echo(f"refitted on all {len(conversations)} dialogues in {time.perf_counter() - started:.0f} s "
             "(the figures above are of the model fitted without the held-out share)")
    fitted = conversations if refit else train
    model.meta = {"trained_on": sorted({_relative(c.source) for c in fitted}), "train_dialogues": [c.id for c in fitted],
                  "held_out_dialogues": [c.id for c in test], "split_seed": seed, "refit_on_all": refit,
                  "weights": {_relative(k): v for k, v in weights.items()}, "c_rank": c_rank,
                  "c_decide": c_decide, "rounds": rounds, "kinds": dict(KIND),
                  "held_out": {k: _clean(v.to_json()) for k, v in results.items()},
                  "format_version": FORMAT_VERSION}
    path = model.save(out or DEFAULT_MODEL)
    echo(f"saved {path} ({path.stat().st_size / 1024:.0f} KiB, format version {FORMAT_VERSION})")
    return model


def cross_validate(data: list[str], folder: str, weights: list[float], folds: int = 5, seed: int = 0,
                   rounds: int = 2, echo: Callable[[str], None] = print) -> list[dict]:
    """`palace train --cv FOLDER`: how much the dialogues of `folder` (hand-written) should weigh, chosen
    without any other test set. They are cut into `folds` folds; each fold is scored by a model fitted on
    `data` (the other paths) and the other folds at each weight (0: without them). Nothing is saved."""
    others = [c for c in load_conversations([p for p in data if Path(p).resolve() != Path(folder).resolve()])
              if c.labelled]
    held = [c for c in load_conversations([folder]) if c.labelled]
    if len(held) < folds:
        raise ValueError(f"{folder}: {len(held)} labelled dialogues, fewer than {folds} folds")
    embed_all(others + held, load_embedder())
    order = list(range(len(held)))
    random.Random(seed).shuffle(order)
    rows = []
    echo(f"{folds}-fold cross-validation over {len(held)} dialogues of {folder}, besides {len(others)} others")
    for weight in weights:
        scores = []
        for fold in range(folds):
            test = {order[i] for i in range(fold, len(held), folds)}
            train = [replace(c, weight=weight) for i, c in enumerate(held) if i not in test and weight > 0]
            model = fit(others + train, rounds=rounds)
            scores.append(evaluate([held[i] for i in sorted(test)], methods(model)["model"])[0])
        row = {"weight": weight, **{k: float(np.mean([getattr(s, k) for s in scores]))
                                    for k in ("pk", "windowdiff", "return_accuracy", "boundary_f1")}}
        rows.append(row)
        echo(f"weight {weight:g}: Pk {row['pk']:.3f}  WindowDiff {row['windowdiff']:.3f}  return accuracy "
             f"{row['return_accuracy']:.3f}  boundary F1 {row['boundary_f1']:.3f}  (mean over folds)")
    return rows


def topics_command(files: list[str], model_path: str | None, json_out: str | None, baselines: bool,
                   quiet: bool, echo: Callable[[str], None] = print) -> dict:
    model = TopicModel.load(model_path)
    conversations = load_conversations(files)
    embed_all(conversations, load_embedder())
    timings: list[float] = []
    report_dialogues, per_scores = [], []
    for c in conversations:
        decisions = run_model(model, c, timings)
        s = score_dialogue(c.labels, decisions) if c.labelled else None
        if s:
            per_scores.append(s)
        if not quiet:
            figures = (f"Pk {s.pk:.3f} WD {s.windowdiff:.3f} bF1 {s.boundary_f1:.3f} returns "
                       f"{s.returns_named}/{s.returns}") if s else "no topic labels"
            echo(f"== {c.id} ({c.source}) · {figures}")
            gold = gold_decisions(c.labels) if c.labelled else [None] * len(c.users)
            for t, (d, label, g) in enumerate(zip(decisions, c.labels, gold)):
                mark = "" if g is None else "  " if _agrees(d, g, c.labels, t) else "✗ "
                echo(f"  {mark}{t:3} {d:11} {label or '-':22} {c.users[t][:70]}")
        entry = {"id": c.id, "file": c.source, "turns": [
            {"turn": t, "prediction": d, "topic": c.labels[t]} for t, d in enumerate(decisions)]}
        if s:
            entry.update(pk=s.pk, windowdiff=s.windowdiff, boundary_f1=s.boundary_f1,
                         return_accuracy=_num(s.return_accuracy), returns=s.returns, boundaries=s.boundaries)
        report_dialogues.append(entry)
    result: dict = {}
    if per_scores:
        total = score_all(per_scores)
        result = {"pk": total.pk, "windowdiff": total.windowdiff, "boundary_f1": total.boundary_f1,
                  "return_accuracy": _num(total.return_accuracy), "return_precision": _num(total.return_precision),
                  "dialogues_scored": len(per_scores), "turns": total.turns, "boundaries": total.boundaries,
                  "returns": total.returns}
        rows = {"model": total}
        if baselines:
            for name, run in methods(model).items():
                if name != "model":
                    rows[name] = evaluate(conversations, run)[0]
            result["baselines"] = {k: _clean(v.to_json()) for k, v in rows.items() if k != "model"}
        for line in table_rows(rows):
            echo(line)
    p50, p95 = np.percentile(timings, [50, 95]) if timings else (0.0, 0.0)
    echo(f"per turn after the embedding: p50 {p50:.2f} ms, p95 {p95:.2f} ms over {len(timings)} turns")
    result.update(ms_per_turn_p50=float(p50), ms_per_turn_p95=float(p95), model=str(model_path or DEFAULT_MODEL),
                  dialogues=report_dialogues)
    if json_out:
        Path(json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(json_out).write_text(json.dumps(result, indent=1, allow_nan=False) + "\n", encoding="utf-8")
    return result


def _agrees(decision: str, gold: str, labels: list[str], t: int) -> bool:
    if gold.startswith("return:"):
        return decision.startswith("return:") and labels[int(decision.split(":")[1])] == labels[t]
    return decision == gold


def _relative(path: str) -> str:
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return path


def _clean(d: dict) -> dict:
    return {k: _num(v) for k, v in d.items()}


def _num(x):
    return None if isinstance(x, float) and math.isnan(x) else x
