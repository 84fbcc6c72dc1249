"""Running summary: every N user turns, an extractive keyframe of those turns, kept with its vector.

A 135M model summarises poorly, so a keyframe is the block's most central user turn (closest to the
block's mean embedding), cut to its first clause-sized piece. Keyframes are searchable (a summary hit
brings back its block's turns) and their texts, oldest first, are the running summary that the notes in
the permanent tier carry. The turn embeddings are the ones the agent already computed, so a keyframe
costs no extra embedding."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np
import torch

WORDS = 14  # the most words a keyframe keeps


@dataclass
class Keyframe:
    first_turn: int
    last_turn: int
    text: str
    vector: np.ndarray = field(repr=False)


class RunningSummary:
    """Buffers user turns with their embeddings; every `every` turns, closes a keyframe."""

    def __init__(self, every: int = 5):
        if every < 1:
            raise ValueError(f"summary interval {every} must be at least one turn")
        self.every = every
        self.keyframes: list[Keyframe] = []
        self._block: list[tuple[int, str, np.ndarray]] = []

    def add(self, turn: int, text: str, embedding: np.ndarray) -> Keyframe | None:
        """A user turn; returns the keyframe it closes, if any."""
        self._block.append((turn, text, np.asarray(embedding, dtype=np.float32)))
        if len(self._block) < self.every:
            return None
        vectors = np.stack([v for *_, v in self._block])
        centre = vectors.mean(0)
        centre /= max(float(np.linalg.norm(centre)), 1e-9)
        best = int(np.argmax(vectors @ centre))
        frame = Keyframe(self._block[0][0], self._block[-1][0], extract(self._block[best][1]), centre)
        self.keyframes.append(frame)
        self._block = []
        return frame

    def search(self, query: np.ndarray, threshold: float) -> list[tuple[Keyframe, float]]:
        """Keyframes at least `threshold` similar to the query, best first."""
        if not self.keyframes:
            return []
        scores = np.stack([k.vector for k in self.keyframes]) @ np.asarray(query, dtype=np.float32)
        return [(self.keyframes[i], float(scores[i])) for i in np.argsort(-scores) if scores[i] >= threshold]

    def texts(self) -> list[str]:
        return [k.text for k in self.keyframes]

    def state(self) -> dict:
        """Keyframes and the open block, vectors as tensors (a session file holds no pickled objects)."""
        return {"every": self.every,
                "keyframes": [(k.first_turn, k.last_turn, k.text, torch.from_numpy(k.vector)) for k in self.keyframes],
                "block": [(turn, text, torch.from_numpy(vector)) for turn, text, vector in self._block]}

    @classmethod
    def from_state(cls, state: dict) -> "RunningSummary":
        summary = cls(state["every"])
        summary.keyframes = [Keyframe(a, b, text, vector.numpy()) for a, b, text, vector in state["keyframes"]]
        summary._block = [(turn, text, vector.numpy()) for turn, text, vector in state["block"]]
        return summary


_SENTENCE = re.compile(r"[^.!?]+[.!?]?")
_FILLER = re.compile(r"^(?:(?:hi|hello|hey|thanks|thank you|ok|okay|right|yes|yeah|no|oh|well|so|sorry|great|lovely)"
                     r"\b[\s,!.]*)+", re.I)


def extract(text: str) -> str:
    """The first sentence with content, without greetings, at most WORDS words."""
    for sentence in _SENTENCE.findall(text):
        sentence = _FILLER.sub("", sentence.strip()).strip()
        if len(sentence.split()) >= 3:
            words = sentence.split()
            return " ".join(words[:WORDS]).rstrip(",;:") + ("..." if len(words) > WORDS else "")
    return " ".join(text.split()[:WORDS])
