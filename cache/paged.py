"""Paged KV storage (vLLM block-pool style). A layer's keys and values live in fixed-size blocks taken
from a pool; a sequence is a block table (list of block ids) plus a length. Compaction and truncation
hand whole blocks back to the pool's free list instead of reallocating, and ref counts let a fork share
blocks with its parent (copy-on-write on the one partially filled block a fork may append to).

Batch 1 only: the engine feeds one sequence, so tensors are [1, kv_heads, tokens, head_dim] at the edges."""

from __future__ import annotations

import torch

from cache.storage import CHUNK, FloatChunk, check_kind

BLOCK_SIZE = 16  # tokens per block (vLLM's default)


class BlockPoolExhausted(RuntimeError):
    """Every block of a pool is in use: the store holds more than it was sized for."""


class BlockPool:
    """One layer's blocks (a pool may also be shared, e.g. by a fork): keys/values [kv_heads, blocks, block_size, head_dim]
    (head-major, so a run of consecutive blocks is one strided view attention reads without a gather),
    a free list and ref counts. At most `max_blocks` blocks ever exist (the storage behind them grows in
    steps up to that); asking for one more raises BlockPoolExhausted instead of growing without bound.
    Blocks are never moved, only reused."""

    def __init__(self, max_blocks: int, block_size: int = BLOCK_SIZE, dtype: torch.dtype | None = None):
        self.max_blocks = max_blocks
        self.block_size = block_size
        self.dtype = dtype  # None: take the dtype of the first keys written
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.free_blocks: list[int] = []
        self.refs: list[int] = []

    @property
    def num_blocks(self) -> int:
        return len(self.refs)

    def block_bytes(self) -> int:
        """Bytes of one block, keys plus values."""
        return 2 * self.keys[:, 0].numel() * self.keys.element_size() if self.keys is not None else 0

    def nbytes(self) -> int:
        """Bytes the pool holds, used or free."""
        return self.num_blocks * self.block_bytes()

    @torch.inference_mode(False)
    def _grow(self, like: torch.Tensor) -> None:
        """like: [kv_heads, tokens, head_dim]; fixes the pool's shape, device and dtype on first use.
        The pool is a normal tensor even when first filled under inference mode (the model's forward):
        compaction writes into it outside inference mode, which inference tensors forbid."""
        old = self.num_blocks
        if old >= self.max_blocks:
            raise BlockPoolExhausted(f"KV block pool exhausted: all {self.max_blocks} blocks of {self.block_size} "
                                     f"tokens are in use (size the store for more tokens)")
        new = min(self.max_blocks, old + max(16, old // 4))  # steps of a quarter: at most 25 % slack held
        shape = (like.shape[0], new, self.block_size, like.shape[2])
        keys = torch.zeros(shape, dtype=self.dtype or like.dtype, device=like.device)
        values = torch.zeros_like(keys)
        if self.keys is not None:
            keys[:, :old], values[:, :old] = self.keys, self.values
        self.keys, self.values = keys, values
        self.refs.extend([0] * (new - old))
        self.free_blocks.extend(range(new - 1, old - 1, -1))  # pop() hands out low ids first

    def allocate(self, like: torch.Tensor) -> int:
        if not self.free_blocks:
            self._grow(like)
        block = self.free_blocks.pop()
        self.refs[block] = 1
        return block

    def incref(self, block: int) -> None:
        self.refs[block] += 1

    def free(self, block: int) -> None:
        """Drop one reference; the block returns to the free list when nobody holds it."""
        if self.refs[block] <= 0:
            raise ValueError(f"block {block} freed more often than allocated")
        self.refs[block] -= 1
        if self.refs[block] == 0:
            self.free_blocks.append(block)


class PagedStorage:
    """LayerStorage over a BlockPool. `nbytes()` counts the blocks this sequence holds (its real share),
    not the pool's spare capacity, so it is comparable with ContiguousStorage and drops on compaction;
    the pool's own footprint is `pool.nbytes()`."""

    exact_truncate = True

    def __init__(self, pool: BlockPool):
        self.pool = pool
        self.table: list[int] = []
        self.length = 0
        self.compute_dtype: torch.dtype | None = None

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    def _writable(self, slot: int, like: torch.Tensor) -> int:
        """Block id for table slot `slot`, allocating it, or copying it first if a fork shares it."""
        if slot == len(self.table):
            self.table.append(self.pool.allocate(like))
        block = self.table[slot]
        if self.pool.refs[block] > 1:
            fresh = self.pool.allocate(like)
            self.pool.keys[:, fresh], self.pool.values[:, fresh] = self.pool.keys[:, block], self.pool.values[:, block]
            self.pool.free(block)
            self.table[slot] = block = fresh
        return block

    def _write(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Append [kv_heads, tokens, head_dim] block by block."""
        done, count = 0, keys.shape[1]
        while done < count:
            slot, offset = divmod(self.length, self.block_size)
            take = min(self.block_size - offset, count - done)
            block = self._writable(slot, keys)
            self.pool.keys[:, block, offset : offset + take] = keys[:, done : done + take]
            self.pool.values[:, block, offset : offset + take] = values[:, done : done + take]
            done += take
            self.length += take

    def append(self, keys, values):
        self.compute_dtype = keys.dtype
        self._write(keys[0], values[0])

    def update_and_fetch(self, keys, values):
        self.append(keys, values)
        return self.fetch()

    def _gather(self, pool: torch.Tensor) -> torch.Tensor:
        """Blocks of the table, in order, as one contiguous [1, kv_heads, length, head_dim] tensor."""
        index = torch.tensor(self.table, dtype=torch.long, device=pool.device)
        return pool.index_select(1, index).flatten(1, 2)[None, :, : self.length]

    def fetch(self):
        """Contiguous keys and values in compute precision (a copy: for compaction and saving)."""
        dtype = self.compute_dtype or self.pool.keys.dtype
        return self._gather(self.pool.keys).to(dtype), self._gather(self.pool.values).to(dtype)

    @staticmethod
    def _consecutive(blocks: list[int]) -> bool:
        return all(b - a == 1 for a, b in zip(blocks, blocks[1:]))

    def view(self, dtype):
        """When the table's blocks lie in order in the pool (the usual case: a layer's blocks are allocated
        in order), the held tokens are one strided view of it in the pool's dtype, and attention reads them
        in one call, as from contiguous storage; otherwise None (attention goes block run by block run)."""
        if not self.table or self.pool.keys.dtype != dtype or not self._consecutive(self.table):
            return None
        first, last = self.table[0], self.table[-1]
        return tuple(pool[None, :, first : last + 1].flatten(2, 3)[:, :, : self.length]
                     for pool in (self.pool.keys, self.pool.values))

    def chunks(self, dtype):
        """CHUNK tokens at a time, at the same positions as the other float kinds: a chunk whose blocks
        are consecutive in the pool (the usual case, a layer's blocks being allocated in order) is one
        strided view of it; only a chunk broken up by a fork's copied block or by reuse is gathered."""
        per_chunk = max(1, CHUNK // self.block_size)
        for slot in range(0, len(self.table), per_chunk):
            blocks = self.table[slot : slot + per_chunk]
            first, stop = slot * self.block_size, min(self.length, (slot + len(blocks)) * self.block_size)
            if self._consecutive(blocks):
                keys, values = (pool[:, blocks[0] : blocks[-1] + 1].flatten(1, 2)[:, : stop - first]
                                for pool in (self.pool.keys, self.pool.values))
            else:
                index = torch.tensor(blocks, dtype=torch.long, device=self.pool.keys.device)
                keys, values = (pool.index_select(1, index).flatten(1, 2)[:, : stop - first]
                                for pool in (self.pool.keys, self.pool.values))
            yield first, FloatChunk(keys.to(dtype), values.to(dtype))

    def replace(self, keys, values):
        """Install a compacted sequence: every block goes back to the pool, then the kept tokens are written
        afresh (the free list is LIFO, so mostly into the same blocks)."""
        self.truncate(0)
        self.append(keys, values)

    def truncate(self, length: int) -> None:
        """Crop to `length` tokens, freeing every block past the last one still used."""
        self.length = min(self.length, max(0, length))
        used = -(-self.length // self.block_size)
        for block in reversed(self.table[used:]):  # the free list is LIFO: refilled in table order, ids ascend
            self.pool.free(block)
        del self.table[used:]

    def fit(self, reserve: int = 0) -> None:
        """Nothing to give back: `truncate` already freed every block past the last one used."""

    def fork(self) -> "PagedStorage":
        """A second sequence sharing this one's blocks (ref counted); either side copies a shared block
        before writing into it."""
        child = PagedStorage(pool=self.pool)
        for block in self.table:
            self.pool.incref(block)
        child.table, child.length, child.compute_dtype = list(self.table), self.length, self.compute_dtype
        return child

    def nbytes(self) -> int:
        return len(self.table) * self.pool.block_bytes()

    def state(self) -> dict:
        keys, values = (self._gather(self.pool.keys), self._gather(self.pool.values)) if self.table else (None, None)
        return {"kind": "paged", "block_size": self.block_size, "keys": keys, "values": values}

    def load_state(self, state: dict) -> None:
        check_kind(state, "paged")
        if state["block_size"] != self.block_size:
            raise ValueError(f"paged state of {state['block_size']}-token blocks cannot go into a pool of {self.block_size}")
        self.truncate(0)
        if state["keys"] is not None:
            self.replace(state["keys"], state["values"])

    @classmethod
    def from_state(cls, state: dict, pool: BlockPool) -> "PagedStorage":
        storage = cls(pool)
        storage.load_state(state)
        return storage

