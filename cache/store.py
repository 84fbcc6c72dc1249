"""The managed KV store: per-layer keys/values (GQA: only the model's KV heads) plus per-token metadata,
under one cache policy, plugged into transformers' Cache API so `model(ids, cache=store)` and
`model.generate(ids, cache=store)` continue from it (`past_key_values=` is transformers' older name).

Token lifecycle: the engine declares the tokens it is about to feed (`expect`), the model's attention
layers append their keys/values through `update`, and the policy later chooses which tokens to `keep`.
Tokens fed by a plain transformers forward are declared on arrival with default metadata.
Compaction re-rotates the kept keys so positions stay contiguous (0..len-1), which is why a plain causal
mask is always right and the next token's position is simply `len(store)`.

A fork (`with store.fork():`) feeds tokens only to read their logits (scoring choices, drafting a
reply) and then rolls back exactly: length, metadata and the next-token logits are restored, nothing is
recorded and nothing may be evicted meanwhile."""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from cache.meta import TokenMeta
from cache.rope import Rerotator
from cache.storage import LayerStorage, StorageConfig

if TYPE_CHECKING:
    from cache.policies import Policy

class ManagedLayer(CacheLayerMixin):
    """Adapter from transformers' per-layer cache protocol to one LayerStorage."""

    def __init__(self, storage: LayerStorage, store: "KVStore", first: bool):
        super().__init__()
        self.storage, self.store, self.first = storage, store, first

    def lazy_initialization(self, key_states, value_states) -> None:
        self.device, self.is_initialized = key_states.device, True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys, self.values = self.storage.update_and_fetch(key_states, value_states)
        if self.first:
            self.store.declare_arrivals()
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.storage.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.storage.length

    def get_max_length(self) -> int:
        return -1


class KVStore(Cache):
    """All layers' KV plus token metadata, under a policy that says what must be recorded (attention
    importance, surprisal) and what to evict. `next_logits` are the logits that predict the next token
    fed: the one place every caller reads them from."""

    def __init__(self, num_layers: int, rerotator: Rerotator, policy: "Policy", storage: StorageConfig = StorageConfig()):
        self.storage_config = storage
        layers = storage.build(num_layers, policy.budget)
        super().__init__(layers=[ManagedLayer(layer, self, i == 0) for i, layer in enumerate(layers)])
        self.rerotator = rerotator
        self.policy = policy
        self.meta = TokenMeta.empty()
        self.next_serial = 0  # serial of the next token fed
        self.next_logits: torch.Tensor | None = None
        self.frozen = False  # inside a fork: nothing recorded, nothing evicted

    @classmethod
    def for_model(cls, model: torch.nn.Module, policy: "Policy", storage: StorageConfig = StorageConfig()) -> "KVStore":
        return cls(model.config.num_hidden_layers, Rerotator.from_model(model), policy, storage)

    @property
    def length(self) -> int:
        """Tokens held (the same in every layer)."""
        return self.layers[0].storage.length

    @property
    def recording(self) -> bool:
        """Whether attention should hand this store the mass each cached token receives."""
        return self.policy.needs_importance and not self.frozen

    @property
    def measuring_surprisal(self) -> bool:
        """Whether the engine must keep every fed position's logits for the surprisal column."""
        return self.policy.needs_surprisal and not self.frozen

    # --- feeding -------------------------------------------------------------------------------
    def make_room(self, incoming: int) -> None:
        """Let the policy evict so that `incoming` more tokens fit the budget."""
        self.policy.make_room(self, incoming)

    def expect(self, count: int, turn: int, role: str, segment: int, ids: list[int] | None = None) -> None:
        """Declare the metadata of the next `count` tokens, before the forward that appends them."""
        self.meta = self.meta.cat(TokenMeta.new(count, len(self.meta), turn, role, segment, ids, self.next_serial))
        self.next_serial += count

    def declare_arrivals(self) -> None:
        """Tokens appended without `expect` (a plain transformers forward) get default metadata: the
        newest turn and segment, role assistant, token id unknown."""
        missing = self.length - len(self.meta)
        if missing > 0:
            turn = int(self.meta.turn[-1]) if len(self.meta) else -1
            segment = int(self.meta.segment[-1]) if len(self.meta) else -1
            self.expect(missing, turn, "assistant", segment)

    def add_importance(self, layer_idx: int, mass: torch.Tensor) -> None:
        """Called by the attention function with [kv_heads, kv_len] attention mass for one layer."""
        if self.frozen:
            return
        mass = mass.sum(dim=0).to(self.meta.importance.device)
        self.meta.importance[: mass.numel()] += mass

    def observe_logits(self, ids: list[int], logits: torch.Tensor) -> None:
        """After a forward appended `ids`: logits are [kept, vocab] for the last `kept` of them (all of
        them when measuring surprisal). Fills their surprisal, -log p(token | what preceded it), the first
        one's from the previous `next_logits`; then keeps the last row as the new `next_logits`."""
        if self.measuring_surprisal:
            previous = logits[:-1] if self.next_logits is None else torch.cat((self.next_logits[None], logits[:-1]))
            logprobs = torch.log_softmax(previous.float(), dim=-1)
            targets = torch.tensor(ids[len(ids) - previous.shape[0]:], device=logprobs.device)[:, None]
            values = -logprobs.gather(1, targets)[:, 0].cpu()
            self.meta.surprisal[self.length - values.numel():] = values
        self.next_logits = logits[-1].float()

    @contextmanager
    def fork(self) -> Iterator["KVStore"]:
        """Feed tokens to read their logits, then roll back exactly (see the module docstring)."""
        if self.frozen:
            raise RuntimeError("a fork of this store is already open")
        length, next_logits, next_serial = self.length, self.next_logits, self.next_serial
        self.frozen = True
        try:
            yield self
        finally:
            self.truncate(length)
            self.next_logits, self.next_serial = next_logits, next_serial
            self.frozen = False

    # --- compaction -------------------------------------------------------------------------------
    def keep(self, index: torch.Tensor) -> None:
        """Keep only these tokens (any order given; kept in sequence order) and re-rotate their keys so
        positions become 0..len-1 again."""
        if self.frozen:
            raise RuntimeError("cannot evict inside a fork: make room before opening it")
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
        """Crop back to the first `length` tokens."""
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
