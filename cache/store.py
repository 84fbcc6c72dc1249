"""The managed KV store: per-layer keys/values (GQA: only the model's KV heads) plus per-token metadata,
plugged into transformers' Cache API so `model(ids, past_key_values=store)` works.

Token lifecycle: the engine declares the tokens it is about to feed (`expect`), the model's attention
layers append their keys/values through `update`, and a policy later chooses which tokens to `keep`.
Compaction re-rotates the kept keys so positions stay contiguous (0..len-1), which is why a plain causal
mask is always right and the next token's position is simply `len(store)`."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from cache.rope import Rerotator
from cache.storage import ContiguousStorage, LayerStorage

ROLES = {"system": 0, "user": 1, "assistant": 2}


@dataclass
class TokenMeta:
    """Column-wise metadata, one entry per cached token, always aligned with the tensors."""

    token: torch.Tensor  # long: token id (-1 when not given), for finding text to pin
    segment: torch.Tensor  # long: topic segment id
    turn: torch.Tensor  # long: dialogue turn (-1 = system prompt)
    role: torch.Tensor  # long: ROLES
    position: torch.Tensor  # long: RoPE position the key is rotated to
    pinned: torch.Tensor  # bool: never evicted while pinned
    importance: torch.Tensor  # float: accumulated attention mass received
    surprisal: torch.Tensor  # float: -log p(token | what preceded it), its information content when fed

    @classmethod
    def empty(cls) -> "TokenMeta":
        long = torch.zeros(0, dtype=torch.long)
        return cls(long, long, long, long, long, torch.zeros(0, dtype=torch.bool), torch.zeros(0), torch.zeros(0))

    @classmethod
    def new(cls, count: int, start: int, turn: int, role: str, segment: int,
            ids: list[int] | None = None) -> "TokenMeta":
        full = lambda value: torch.full((count,), value, dtype=torch.long)  # noqa: E731
        tokens = torch.tensor(ids, dtype=torch.long) if ids is not None else full(-1)
        return cls(tokens, full(segment), full(turn), full(ROLES[role]), torch.arange(start, start + count),
                   torch.zeros(count, dtype=torch.bool), torch.zeros(count), torch.zeros(count))

    def __len__(self) -> int:
        return self.turn.numel()

    def cat(self, other: "TokenMeta") -> "TokenMeta":
        return TokenMeta(*(torch.cat((getattr(self, f.name), getattr(other, f.name))) for f in fields(self)))

    def select(self, index: torch.Tensor) -> "TokenMeta":
        return TokenMeta(*(getattr(self, f.name)[index] for f in fields(self)))

    def state(self) -> dict:
        return {f.name: getattr(self, f.name).clone() for f in fields(self)}


class ManagedLayer(CacheLayerMixin):
    """Adapter from transformers' per-layer cache protocol to one LayerStorage."""

    is_croppable = True

    def __init__(self, storage: LayerStorage):
        super().__init__()
        self.storage = storage

    def lazy_initialization(self, key_states, value_states) -> None:
        self.device, self.is_initialized = key_states.device, True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys, self.values = self.storage.update_and_fetch(key_states, value_states)
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.storage.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.storage.length

    def get_max_length(self) -> int:
        return -1

    def crop(self, tokens_to_remove: int) -> None:
        self.storage.truncate(self.storage.length - tokens_to_remove if tokens_to_remove > 0 else -tokens_to_remove)

    def reset(self) -> None:
        self.storage.truncate(0)


class KVStore(Cache):
    """All layers' KV plus token metadata. `recording` turns on importance accumulation;
    `measuring_surprisal` asks the engine for every position's logits to fill the surprisal column."""

    def __init__(self, num_layers: int, rerotator: Rerotator, storage: Callable[[], LayerStorage] = ContiguousStorage):
        super().__init__(layers=[ManagedLayer(storage()) for _ in range(num_layers)])
        self.rerotator = rerotator
        self.meta = TokenMeta.empty()
        self.recording = False
        self.measuring_surprisal = False
        self.last_logits: torch.Tensor | None = None  # predicts the next token fed (for its surprisal)
        self.frozen = False  # while scoring a fork: no importance, metadata untouched

    @classmethod
    def for_model(cls, model: torch.nn.Module, storage: Callable[[], LayerStorage] = ContiguousStorage) -> "KVStore":
        return cls(model.config.num_hidden_layers, Rerotator.from_model(model), storage)

    @property
    def length(self) -> int:
        """Tokens held (the same in every layer)."""
        return self.layers[0].storage.length

    # --- feeding -------------------------------------------------------------------------------
    def expect(self, count: int, turn: int, role: str, segment: int, ids: list[int] | None = None) -> None:
        """Declare the metadata of the next `count` tokens, before the forward that appends them."""
        self.meta = self.meta.cat(TokenMeta.new(count, len(self.meta), turn, role, segment, ids))

    def add_importance(self, layer_idx: int, mass: torch.Tensor) -> None:
        """Called by the attention function with [kv_heads, kv_len] attention mass for one layer."""
        if self.frozen:
            return
        mass = mass.sum(dim=0).to(self.meta.importance.device)
        self.meta.importance[: mass.numel()] += mass

    def add_surprisal(self, ids: list[int], logits: torch.Tensor) -> None:
        """logits: [len(ids), vocab] for the tokens just fed; token i's surprisal comes from the logits
        before it (the previous forward's last logits for the first one)."""
        if self.frozen:
            return
        previous = logits[:-1] if self.last_logits is None else torch.cat((self.last_logits[None], logits[:-1]))
        logprobs = torch.log_softmax(previous.float(), dim=-1)
        targets = torch.tensor(ids[len(ids) - previous.shape[0]:], device=logprobs.device)[:, None]
        values = -logprobs.gather(1, targets)[:, 0].cpu()
        self.meta.surprisal[self.length - values.numel():] = values
        self.last_logits = logits[-1].float()

    # --- compaction -------------------------------------------------------------------------------
    def keep(self, index: torch.Tensor) -> None:
        """Keep only these tokens (any order given; kept in sequence order) and re-rotate their keys so
        positions become 0..len-1 again."""
        index = torch.unique(index.to(torch.long).cpu())  # sorted, deduplicated
        if index.numel() == self.length:
            return
        new_meta = self.meta.select(index)
        delta = torch.arange(index.numel()) - new_meta.position
        moved, rotation = bool((delta != 0).any()), None
        for layer in self.layers:
            keys, values = layer.storage.fetch()
            device_index = index.to(keys.device)
            kept_keys = keys.index_select(2, device_index)
            if moved:
                rotation = rotation or self.rerotator.rotation(delta, keys.device)
                kept_keys = self.rerotator.shift(kept_keys, rotation)
            layer.storage.replace(kept_keys, values.index_select(2, device_index))
        new_meta.position = torch.arange(index.numel())
        self.meta = new_meta

    def truncate(self, length: int) -> None:
        """Crop back to the first `length` tokens (used after scoring a fork)."""
        for layer in self.layers:
            layer.storage.truncate(length)
        self.meta = self.meta.select(slice(0, length))

    def pin(self, index: torch.Tensor, pinned: bool = True) -> None:
        self.meta.pinned[index] = pinned

    def find(self, ids: list[int]) -> torch.Tensor:
        """Indices of every cached occurrence of the token sequence `ids`."""
        tokens, width = self.meta.token, len(ids)
        if not width or tokens.numel() < width:
            return torch.zeros(0, dtype=torch.long)
        starts = torch.nonzero((tokens.unfold(0, width, 1) == torch.tensor(ids)).all(dim=1)).flatten()
        return (starts[:, None] + torch.arange(width)).flatten()

    def memory_bytes(self) -> int:
        return sum(layer.storage.nbytes() for layer in self.layers)

    def state(self) -> dict:
        return {"meta": self.meta.state(), "layers": [layer.storage.state() for layer in self.layers]}
