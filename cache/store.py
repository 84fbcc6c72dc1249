"""The managed KV store: per-layer keys/values (GQA: only the model's KV heads) plus per-token metadata,
under one cache policy, plugged into transformers' Cache API so `model(ids, cache=store)` and
`model.generate(ids, cache=store)` continue from it (`past_key_values=` is transformers' older name).

Token lifecycle: the engine declares the tokens it is about to feed (`expect`), the model's attention
layers append their keys/values through `update`, and the policy later chooses which tokens to `keep`.
Tokens fed by a plain transformers forward are declared on arrival with default metadata.
Compaction re-rotates the kept keys so positions stay contiguous (0..len-1), which is why a plain causal
mask is always right and the next token's position is simply `len(store)`.

Long-term memory meets the cache at two points: what a compaction evicts is handed, KV and all, to
`on_evict` (an archive), one span per message, and `inject` splices archived spans back in, at the end
or where they were, their keys re-rotated to where they land. Every token fed gets a `serial`, its index
in the conversation stream, which compaction and splicing keep, so the memory side can tell which
archived tokens are live.

A fork (`with store.fork():`) feeds tokens only to read their logits (scoring choices, drafting a
reply) and then rolls back exactly: length, metadata and the next-token logits are restored, nothing is
recorded and nothing may be evicted or injected meanwhile."""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from typing import TYPE_CHECKING, Callable, Iterator

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from cache import native
from cache.meta import ROLES, TokenMeta
from cache.rope import Rerotator
from cache.span import KVSpan
from cache.storage import ContiguousStorage, LayerStorage, StorageConfig, compact_layers, held_bytes, place_layers

if TYPE_CHECKING:
    from cache.policies import Policy

PLACEMENTS = ("end", "chronological")


class ManagedLayer(CacheLayerMixin):
    """Adapter from transformers' per-layer cache protocol to one LayerStorage. Its `keys` / `values`
    stay None: the storage holds the tokens in its own format, our attention reads them from there
    (`storage.chunks`), and a float copy of the whole layer is made only for a caller that asks
    (`storage.fetch()`, or transformers' own attention through `update`), and not kept."""

    def __init__(self, storage: LayerStorage, store: "KVStore", first: bool):
        super().__init__()
        self.storage, self.store, self.first = storage, store, first

    def lazy_initialization(self, key_states, value_states) -> None:
        self.device, self.is_initialized = key_states.device, True

    def append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Append new tokens; our attention then reads them from the storage."""
        self._write(self.storage.append, key_states, value_states)

    def update(self, key_states, value_states, *args, **kwargs):
        """transformers' own attention (a plain forward over the store, e.g. generate()) needs every token
        in compute precision: it gets them, and nothing keeps them."""
        return self._write(self.storage.update_and_fetch, key_states, value_states)

    def _write(self, write, key_states: torch.Tensor, value_states: torch.Tensor):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        result = write(key_states, value_states)
        if self.first:
            self.store.declare_arrivals()
        return result

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.storage.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.storage.length

    def get_max_length(self) -> int:
        return -1


class KVStore(Cache):
    """All layers' KV plus token metadata, under a policy that says what must be recorded (attention
    importance, surprisal) and what to evict. `next_logits` are the logits that predict the next token
    fed: the one place every caller reads them from. `on_evict`, when set, receives every span a
    compaction drops (nothing is gathered for it when unset), or only the rows `evict_filter` picks (a
    bool per row of the dropped tokens' metadata): an archive that keeps no system prompt and nothing it
    already holds need not have their KV copied out."""

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
        self.on_evict: Callable[[KVSpan], None] | None = None
        self.evict_filter: Callable[[TokenMeta], torch.Tensor] | None = None

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
    def make_room(self, incoming: int, drop: torch.Tensor | None = None) -> bool:
        """Let the policy evict so that `incoming` more tokens fit the budget; whether it had to. `drop`
        (a bool per token) leaves those tokens out in the same compaction, the policy choosing among the
        rest (the notes' old KV, replaced as the new notes are fed: one rewrite of the cache, not two)."""
        if drop is None or not bool(drop.any()):
            return self.policy.make_room(self, incoming)
        rest = torch.nonzero(~drop).flatten()
        kept = self.policy.room_for(self.meta.select(rest), incoming)
        self.keep(rest if kept is None else rest[kept], reserve=incoming)
        return kept is not None

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
        # a quantized layer cannot truncate back exactly (tokens the fork pushed out of its residual window
        # stay quantized), so it is restored from a snapshot: references, as its tensors are never mutated
        snapshots = [None if layer.storage.exact_truncate else layer.storage.state() for layer in self.layers]
        self.frozen = True
        try:
            yield self
        finally:
            self.truncate(length)
            for layer, snapshot in zip(self.layers, snapshots):
                if snapshot is not None:
                    layer.storage.load_state(snapshot)
            self.next_logits, self.next_serial = next_logits, next_serial
            self.frozen = False

    # --- compaction and splicing ------------------------------------------------------------------
    @torch.inference_mode()  # the storage was filled by forwards in inference mode, and is written in place
    def keep(self, index: torch.Tensor, reserve: int = 0) -> None:
        """Keep only these tokens (any order given; kept in sequence order) and re-rotate their keys so
        positions become 0..len-1 again. The dropped tokens go to `on_evict`, if set, once the cache is
        compacted. The memory they held is given back, except room for `reserve` more tokens (what the
        caller is about to append: making room and then growing again would copy the cache twice)."""
        self._check_not_frozen("evict")
        index = torch.unique(index.to(torch.long).cpu())  # sorted, deduplicated
        if index.numel() == self.length:
            return
        evicted = self._evicted_spans(index) if self.on_evict is not None else []
        self._rewrite(0, index, reserve=reserve)
        for span in evicted:
            self.on_evict(span)

    @torch.inference_mode()  # the storage was filled by forwards in inference mode
    def inject(self, spans: KVSpan | list[KVSpan], turn: int, at: str = "end") -> None:
        """Splice archived spans back in, recalled at `turn`: at the "end" (after the cache, like a note
        retrieved before the user's next message, in the order given: the policy's compaction, then an
        append) or "chronological" (each token where it was in the conversation by serial order;
        everything after the earliest one moves up, in one rewrite). The policy first makes room for them
        all, so the budget holds. Keys
        are re-rotated from the spans' positions to where they land; the rows are marked
        `recalled_at = turn` and their importance rescaled to the live cache's level (see `_recalled`).
        The cached logits no longer predict the next token, so `next_logits` is cleared: feed something
        before reading it."""
        self._check_not_frozen("inject")
        if at not in PLACEMENTS:
            raise ValueError(f"unknown placement {at!r}: use one of {', '.join(PLACEMENTS)}")
        spans = [spans] if isinstance(spans, KVSpan) else [span for span in spans if len(span)]
        if not spans:
            return
        span = KVSpan.cat(spans)
        if bool(self.holds(span.serials).any()) or span.serials.unique().numel() != len(span):
            raise ValueError("the spans repeat tokens or hold tokens the cache already has: "
                             "inject span.select(~store.holds(span.serials))")
        if self.policy.budget is not None and len(span) > self.policy.budget:
            raise ValueError(f"spans of {len(span)} tokens cannot fit a {self.policy.budget}-token budget")
        span = dataclasses.replace(span, meta=self._recalled(span.meta, turn))
        kept = self.policy.room_for(self.meta, len(span))
        if kept is not None and at == "end":  # compact, then append: the splice moves nothing a second time
            self.keep(kept, reserve=len(span))
            kept = None
        if kept is not None:  # chronological: make room and splice in one rewrite of the whole cache
            kept = torch.unique(kept.to(torch.long).cpu())
            evicted = self._evicted_spans(kept) if self.on_evict is not None else []
            ours, live = torch.arange(len(span)), kept + len(span)
            order = torch.cat((ours, live))
            order = order[torch.argsort(torch.cat((span.serials, self.meta.serial))[order], stable=True)]
            self._rewrite(0, order=order, span=span)
            for dropped in evicted:
                self.on_evict(dropped)
        elif at == "end":
            self._rewrite(self.length, span=span)
        else:  # the tail from the earliest insertion point, span and live tokens merged by serial
            start = self._chronological_index(span)
            serials = torch.cat((span.serials, self.meta.serial[start:]))
            order = None if bool((serials[1:] > serials[:-1]).all()) else torch.argsort(serials, stable=True)
            self._rewrite(start, order=order, span=span)
        self.next_logits = None

    @torch.inference_mode()
    def reorder(self, order: torch.Tensor) -> None:
        """Put the live tokens in this order (a permutation of 0..length-1), keys re-rotated to where they
        land, in one rewrite from the first token that moves. Nothing is evicted. The cached logits no
        longer predict the next token (its context moved), so `next_logits` is cleared."""
        self._check_not_frozen("reorder")
        order = order.to(torch.long).cpu()
        if order.numel() != self.length or not torch.equal(torch.sort(order).values, torch.arange(self.length)):
            raise ValueError(f"reorder needs a permutation of the cache's {self.length} tokens, got {order.numel()}")
        if bool((order[1:] > order[:-1]).all()):
            return
        self._rewrite(0, order=order)
        self.next_logits = None

    def touch(self, turns: list[int], turn: int) -> int:
        """Mark the live tokens of these dialogue turns as recalled at `turn`: a turn that recall brings
        back is used now as a whole, so the room made for its missing tokens is not taken from the part
        the cache still holds. Returns how many tokens were touched."""
        wanted = torch.tensor(turns, dtype=self.meta.turn.dtype, device=self.meta.turn.device)
        rows = torch.isin(self.meta.turn, wanted) & (self.meta.turn >= 0)
        self.meta.recalled_at[rows] = turn
        return int(rows.sum())

    def mark_recalled(self, original: TokenMeta, turn: int) -> None:
        """The last len(original) tokens re-encode these archived tokens (recalled as text, not KV): they
        take back their serials, turns and segments and are marked recalled at `turn`, so they are
        neither archived again nor recalled twice."""
        rows = slice(self.length - len(original), self.length)
        for column in ("serial", "turn", "segment"):
            getattr(self.meta, column)[rows] = getattr(original, column)
        self.meta.recalled_at[rows] = turn

    def holds(self, serials: torch.Tensor) -> torch.Tensor:
        """Bool mask: which of these serials the cache holds now."""
        return torch.isin(serials, self.meta.serial)

    def _check_not_frozen(self, action: str) -> None:
        if self.frozen:
            raise RuntimeError(f"cannot {action} inside a fork: make room before opening it")

    def _chronological_index(self, span: KVSpan) -> int:
        """Where the span's earliest token was: before the first live token fed after it. (The cache is in
        serial order except for spans recalled at the end; a chronological splice after them sorts the
        tail it rewrites back into serial order.)"""
        later = torch.nonzero(self.meta.serial > span.serials.min()).flatten()
        return int(later[0]) if later.numel() else self.length

    def _recalled(self, meta: TokenMeta, turn: int) -> TokenMeta:
        """A span's rows as they come back: recalled at `turn`, importance rescaled so the span's mean is
        the live cache's. Its inner ranking is kept, but not its level: mass accumulated up to eviction
        is stale (and low, which is usually why it was evicted) and would get it evicted again at once."""
        live = float(self.meta.importance.mean()) if len(self.meta) else 0.0
        mean = float(meta.importance.mean())
        importance = meta.importance * (live / mean) if mean > 0 else torch.full_like(meta.importance, live)
        return dataclasses.replace(meta, importance=importance, recalled_at=torch.full_like(meta.recalled_at, turn))

    def _rewrite(self, start: int, order: torch.Tensor | None = None, span: KVSpan | None = None,
                 reserve: int = 0) -> None:
        """The one way the cache is rearranged: tokens [0, start) stay as they are and the rest becomes
        the sources (the span's tokens, if any, then the live tokens from `start` on), picked by `order`
        (None: all of them, as they are, which a splice needs and which costs no gather), with keys
        re-rotated to positions start, start+1, ... (a quantized layer instead keeps its codes and records
        the rotation each key owes: re-quantizing would add error each time, see `rearrange`). A leading
        run of `order` that leaves tokens where they are is not moved at all: the layers truncate and
        append (a rewrite of everything: `replace`), then give back the capacity the evicted tokens held
        beyond room for `reserve` more when that is a large share (`fit`)."""
        unchanged = self._unchanged_prefix(start, order, span)
        if unchanged:
            offset = len(span) if span is not None else 0
            order = order[unchanged:]
            order = torch.where(order >= offset, order - unchanged, order)
            start += unchanged
        moved = self.meta.select(slice(start, None))
        if span is not None:
            moved = span.meta.cat(moved)
        if order is not None:
            moved = moved.select(order)
        positions = torch.arange(start, start + len(moved))
        delta = positions - moved.position
        turned = delta != 0
        shifted, rotation = bool(turned.any()), None
        # a compaction (kept tokens in order, nothing spliced in) moves rows in place where the storage can
        in_place = span is None and order is not None and bool((order[1:] > order[:-1]).all())
        # a splice at the end (span rows after every live one) is written straight into the storage where it can
        appended = span is not None and order is None and start == self.length
        done = (in_place or appended) and self._move_natively(start, order, span, delta, turned, reserve)
        if not done:
            for i, layer in enumerate(self.layers):
                if hasattr(layer.storage, "rearrange"):  # a quantized layer moves its codes itself
                    kv = None if span is None else tuple(t[i].to(layer.device) if layer.is_initialized else t[i]
                                                         for t in (span.keys, span.values))
                    layer.storage.rearrange(start, order, delta, kv, self.rerotator)
                    if not layer.is_initialized and kv is not None:
                        layer.lazy_initialization(*kv)
                    continue
                keys, values, fresh = self._sources(i, start, span)
                if order is not None:
                    device_order = order.to(keys.device)
                    keys, values, fresh = keys.index_select(2, device_order), values.index_select(2, device_order), True
                if shifted:
                    rotation = rotation or self.rerotator.rotation(delta, keys.device)
                    keys = self.rerotator.shift(keys, rotation, in_place=fresh)
                if start == 0:
                    layer.storage.replace(keys, values)
                else:
                    layer.storage.truncate(start)
                    layer.storage.append(keys, values)
                layer.storage.fit(reserve)
                if not layer.is_initialized:
                    layer.lazy_initialization(keys, values)
        moved.position = positions
        self.meta = self.meta.select(slice(0, start)).cat(moved)

    def _move_natively(self, start: int, order: torch.Tensor | None, span: KVSpan | None, delta: torch.Tensor,
                   turned: torch.Tensor, reserve: int) -> bool:
        """`_rewrite`'s compaction in place (`order`) or splice at the end (`span`) for every layer in one native
        call, where every layer is contiguous float storage the kernels can read; False where not."""
        storages = [layer.storage for layer in self.layers]
        if not all(isinstance(s, ContiguousStorage) for s in storages) or \
                not all(layer.is_initialized for layer in self.layers):
            return False
        rotation = self.rerotator.rotation(delta, self.layers[0].device)
        if not (compact_layers(storages, start, order, rotation, turned) if span is None else
                place_layers(storages, span.keys, span.values, rotation, turned)):
            return False
        for storage in storages:
            storage.fit(reserve)
        return True

    def _unchanged_prefix(self, start: int, order: torch.Tensor | None, span: KVSpan | None) -> int:
        """How many of the cache's first tokens a rewrite from 0 leaves where they are (same token, same
        position): the leading run of `order` that picks the live tokens 0, 1, 2, ... in turn (never
        all of the sources: something is left to install)."""
        if start or not self.length or order is None:
            return 0
        offset = len(span) if span is not None else 0
        head = order[: min(self.length, len(order) - 1)]
        same = head == torch.arange(offset, offset + len(head))
        return int(same.long().cumprod(0).sum())

    def _sources(self, layer_index: int, start: int, span: KVSpan | None) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """[1, kv_heads, tokens, head_dim] keys and values that `_rewrite` picks from, for one layer: the
        span's, on the cache's device and in its compute dtype, then the live tokens from `start` on
        (read only if there are any); and whether they are a new tensor the rewrite may modify (not a
        view of the storage or of the span)."""
        layer = self.layers[layer_index]
        live = None
        if start < layer.storage.length:  # its own length: layer 0 is rewritten first
            keys, values = layer.storage.fetch()
            live = keys[:, :, start:], values[:, :, start:]
        if span is None:
            return *live, False
        keys, values = span.keys[layer_index][None], span.values[layer_index][None]
        if live is not None:
            keys, values = keys.to(live[0]), values.to(live[1])
            return torch.cat((keys, live[0]), dim=2), torch.cat((values, live[1]), dim=2), True
        if layer.is_initialized:
            keys, values = keys.to(layer.device), values.to(layer.device)
        return keys, values, False

    def _evicted_spans(self, kept: torch.Tensor) -> list[KVSpan]:
        """What keeping `kept` drops, as one span per message (turn and role) it came from, messages in
        dialogue order and tokens in cache order, with the KV as the cache holds it now. A span need not
        be contiguous: token-level policies evict a message piecemeal, and its serials say where each
        token was. Only the rows `evict_filter` picks, if set."""
        dropped = torch.ones(self.length, dtype=torch.bool)
        dropped[kept] = False
        if self.evict_filter is not None:
            dropped &= self.evict_filter(self.meta)
        evicted = torch.nonzero(dropped).flatten()
        if not evicted.numel():
            return []
        message = self.meta.turn[evicted] * len(ROLES) + self.meta.role[evicted]
        _, group = torch.unique(message, return_inverse=True)
        evicted = evicted[torch.argsort(group, stable=True)]  # grouped by message, cache order within
        sizes = torch.bincount(group).tolist()
        kv = [layer.storage.fetch() for layer in self.layers]
        if native.rows_dense(*(t for pair in kv for t in pair)):  # every layer's rows in one call a side
            keys, values = (native.gather_layer_rows([pair[side] for pair in kv], evicted) for side in (0, 1))
        else:  # gathered along the [1, heads, tokens, dim] views themselves (a gather from a 3-d slice of one
            # copies the whole layer first), each layer straight into its slice of the spans' one tensor
            keys, values = (first.new_empty((len(kv), first.shape[1], len(evicted), first.shape[3])) for first in kv[0])
            index = evicted.to(keys.device)
            for i, (k, v) in enumerate(kv):
                torch.index_select(k, 2, index, out=keys[i : i + 1])
                torch.index_select(v, 2, index, out=values[i : i + 1])
        keys, values = keys.split(sizes, dim=2), values.split(sizes, dim=2)
        firsts = [0, *torch.tensor(sizes).cumsum(0).tolist()[:-1]]
        return [KVSpan(self.meta.select(evicted[a:a + size]), keys[i], values[i])
                for i, (a, size) in enumerate(zip(firsts, sizes))]

    def truncate(self, length: int) -> None:
        """Crop back to the first `length` tokens. Not an eviction (nothing goes to `on_evict`): a fork
        rolls back tokens that never became part of the conversation."""
        for layer in self.layers:
            layer.storage.truncate(length)
        self.meta = self.meta.select(slice(0, length))

    def pin(self, index: torch.Tensor, pinned: bool = True) -> None:
        self.meta.pinned[index] = pinned

    def memory_bytes(self) -> int:
        """Every byte the layers hold: each storage's tensors (capacity, scales, zero points, residual
        window), and what layers share counted once: a block pool, free blocks and all, and quantized
        layers' shift tables."""
        total, pools, shared = 0, {}, []
        for layer in self.layers:
            pool = getattr(layer.storage, "pool", None)
            if pool is not None:
                pools[id(pool)] = pool
            elif hasattr(layer.storage, "tensors"):
                shared.extend(layer.storage.tensors())
            else:
                total += layer.storage.nbytes()
        return total + held_bytes(shared) + sum(pool.nbytes() for pool in pools.values())

    def state(self) -> dict:
        """Everything a session needs to continue from this store exactly: metadata, each layer's
        storage state, the serial counter and the next-token logits. Not the policy (its configuration
        is the caller's) and not `on_evict`."""
        self._check_not_frozen("save")
        return {"meta": self.meta.state(), "layers": [layer.storage.state() for layer in self.layers],
                "next_serial": self.next_serial, "next_logits": self.next_logits}

    def load_state(self, state: dict, device: torch.device | str | None = None) -> None:
        """Restore a `state()` into this store, which must have the same layers and storage kind
        (ValueError otherwise); tensors go to `device` (default: where they were saved)."""
        self._check_not_frozen("load")
        if len(state["layers"]) != len(self.layers):
            raise ValueError(f"a {len(state['layers'])}-layer cache state cannot go into a {len(self.layers)}-layer store")
        move = (lambda t: t.to(device)) if device is not None else (lambda t: t)  # noqa: E731
        lengths = set()
        for layer, layer_state in zip(self.layers, state["layers"]):
            layer.storage.load_state(_mapped(layer_state, move))
            lengths.add(layer.storage.length)
            layer.is_initialized = layer.storage.length > 0
            if layer.is_initialized:
                layer.device = layer.storage.fetch()[0].device
        meta = TokenMeta.from_state(state["meta"])
        if lengths != {len(meta)}:
            raise ValueError(f"the cache state's layers hold {sorted(lengths)} tokens but its metadata {len(meta)}")
        self.meta, self.next_serial = meta, int(state["next_serial"])
        self.next_logits = None if state["next_logits"] is None else move(state["next_logits"])


def _mapped(value, move: Callable[[torch.Tensor], torch.Tensor]):
    """`value` (dicts, lists, tuples of tensors and plain values) with `move` applied to every tensor."""
    if isinstance(value, torch.Tensor):
        return move(value)
    if isinstance(value, dict):
        return {key: _mapped(item, move) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_mapped(item, move) for item in value)
    return value
