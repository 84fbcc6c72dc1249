"""Quantized KV storage (KIVI-style). The newest tokens stay in full precision in a residual window; older
tokens are quantized in groups as they leave it, keys per channel and values per token:

- Keys carry outlier channels (a few channels are consistently large), so each channel gets its own
  scale over a group of `group` tokens. That is why tokens are quantized a group at a time, not singly:
  per-channel statistics need several tokens.
- Values have no such channel structure and are read as a weighted sum over tokens, so each token gets
  its own scales, over groups of `channel_group` channels.

The same grouping is used by every codec (int8, int4, fp8), so one code path serves all of them. Scales
and zero points are float16: half the bytes of float32, and their 2^-11 relative error is far below any
8- or 4-bit step. `DynamicStorage` chains precisions by age: full, then int8, then int4.

Codes are written once per precision a token passes through. Compaction keeps any subset of tokens and
moves their keys to new positions: each key row points at its group's scales wherever it goes
(`QuantRows`), and owes the rotation of its move (`KeyShifts`), which attention applies in float, so
quantization error does not grow with the number of compactions.

Batch 1 only: the engine feeds one sequence, so tensors are [1, kv_heads, tokens, head_dim] at the edges;
inside, [kv_heads, tokens, head_dim]."""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass, fields

import torch

from cache import native
from cache.rope import Rerotator
from cache.storage import CHUNK, FloatChunk, check_kind, held_bytes

SCALE_DTYPE = torch.float16
TINY_SCALE = torch.finfo(SCALE_DTYPE).tiny  # smallest normal float16: a constant group must not divide by 0
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448


@dataclass
class Packed:
    """Codes plus their scales (and zero points), token axis at dim 1: key groups or value tokens."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None = None

    def parts(self) -> list[torch.Tensor]:
        return [t for t in (self.codes, self.scale, self.zero) if t is not None]

    def narrow(self, start: int, stop: int) -> "Packed":
        """Entries [start, stop) along dim 1, as views."""
        cut = lambda t: None if t is None else t[:, start:stop]  # noqa: E731
        return Packed(cut(self.codes), cut(self.scale), cut(self.zero))

    def select(self, index: torch.Tensor) -> "Packed":
        """These entries along dim 1 (a copy)."""
        pick = lambda t: None if t is None else t.index_select(1, index.to(t.device))  # noqa: E731
        return Packed(pick(self.codes), pick(self.scale), pick(self.zero))

    def cat(self, other: "Packed") -> "Packed":
        join = lambda a, b: torch.cat((a, b), dim=1) if a is not None else None  # noqa: E731
        return Packed(join(self.codes, other.codes), join(self.scale, other.scale), join(self.zero, other.zero))


class IntCodec:
    """Asymmetric min/max integer quantization to `bits` (8 or 4); 4-bit codes are packed two per byte
    along the last axis. Asymmetric because KV groups are often skewed (e.g. all-positive channels)."""

    def __init__(self, bits: int):
        self.bits, self.levels, self.name = bits, 2**bits - 1, f"int{bits}"

    def encode(self, x: torch.Tensor, dim: int) -> Packed:
        """Statistics over `dim` (the group axis); the stored float16 scale/zero are the ones coded against."""
        x = x.float()
        low = x.amin(dim, keepdim=True).to(SCALE_DTYPE)
        scale = ((x.amax(dim, keepdim=True) - low.float()) / self.levels).clamp_min(TINY_SCALE).to(SCALE_DTYPE)
        codes = ((x - low.float()) / scale.float()).round_().clamp_(0, self.levels).to(torch.uint8)
        if self.bits == 4:
            codes = codes[..., 0::2] | (codes[..., 1::2] << 4)
        return Packed(codes, scale, low)

    unit = 1.0  # unpack() gives the levels themselves

    def unpack(self, codes: torch.Tensor) -> torch.Tensor:
        """The integer levels as float32 (4-bit codes written straight into their channels, no stack)."""
        if self.bits == 8:
            return codes.float()
        levels = torch.empty((*codes.shape[:-1], 2 * codes.shape[-1]), dtype=torch.float32, device=codes.device)
        levels[..., 0::2] = codes & 0xF
        levels[..., 1::2] = codes >> 4
        return levels

    def decode(self, packed: Packed) -> torch.Tensor:
        return torch.addcmul(packed.zero.float(), self.unpack(packed.codes), packed.scale.float())


class Fp8Codec:
    """float8 e4m3 with a symmetric scale per group that maps the group's largest magnitude to 448;
    e4m3's own exponent then covers the spread inside the group."""

    name = "fp8"

    def encode(self, x: torch.Tensor, dim: int) -> Packed:
        x = x.float()
        scale = (x.abs().amax(dim, keepdim=True) / FP8_MAX).clamp_min(TINY_SCALE).to(SCALE_DTYPE)
        return Packed((x / scale.float()).clamp_(-FP8_MAX, FP8_MAX).to(FP8), scale)

    unit = 256.0  # unpack() gives the values / 256 (see there)

    @staticmethod
    def unpack(codes: torch.Tensor) -> torch.Tensor:
        """float8 codes as float32 values / 256, by moving their bits into float16 (e4m3's exponent field
        then reads with float16's bias, 8 more): about 8x faster than torch's own float8 conversion on
        CPU, and exact, subnormals included. Shifting the sign-extended int16 by 7 puts the magnitude in
        bits 7-13 and the sign in 15; bit 14 is cleared."""
        bits = codes.view(torch.int8).to(torch.int16).bitwise_left_shift_(7).bitwise_and_(~0x4000)
        return bits.view(torch.float16).float()

    def decode(self, packed: Packed) -> torch.Tensor:
        return self.unpack(packed.codes) * (packed.scale.float() * self.unit)


CODECS = {"int8": lambda: IntCodec(8), "int4": lambda: IntCodec(4), "fp8": Fp8Codec}
FOLD_ROWS = 32  # query rows (group heads x queries) up to which QuantChunk folds scales instead of dequantizing


LAYOUT = 2  # of a quantized layer's state: 2, keys a row each pointing at their group and shift
SPAN, TAIL = -2, -1  # in `QuantizedStorage.rearrange`: where a token comes from, if not from a tier


@dataclass
class KeyShifts:
    """The distinct rotations that quantized keys still owe. A compaction moves a kept key from position p
    to p' (cache/rope.py); rotating codes would mean re-quantizing them, adding a rounding error at every
    compaction. So a key keeps the codes it was quantized with and points at the shift p' - p it owes,
    which attention applies in float (to the few queries, in decode). Row 0 is always no shift.

    A compaction moves every layer's tokens alike, so all layers owe the same shifts: equal tables are one
    object (`of` keeps the last few made), never written in place, and a store counts each once."""

    delta: torch.Tensor  # [shifts] int64 positions
    cos: torch.Tensor  # [shifts, head_dim / 2] float32: both halves of a head turn by the same angles
    sin: torch.Tensor
    inv_freq: torch.Tensor | None  # the RoPE frequencies of the angles (None when nothing is owed)

    @classmethod
    def of(cls, delta: torch.Tensor, inv_freq: torch.Tensor | None, half: int, device) -> "KeyShifts":
        """The table of these distinct deltas (0 first), angles in float64 (a shift of thousands of
        positions would lose its low bits in float32); the same object as an equal table made lately."""
        if len(delta) == 1:
            inv_freq = None
        elif inv_freq is None:
            raise ValueError("shifts other than 0 need the model's RoPE frequencies")
        key = (tuple(delta.tolist()), None if inv_freq is None else tuple(inv_freq.tolist()), half, str(device))
        with _SHIFT_LOCK:  # agents in other threads share the tables (they are never written)
            table = _SHIFT_TABLES.pop(key, None)
            if table is None:
                frequencies = torch.zeros(half, dtype=torch.float64) if inv_freq is None else inv_freq.double().cpu()
                angles = delta.double()[:, None] * frequencies[None, :]
                table = cls(delta.clone(), angles.cos().float().to(device), angles.sin().float().to(device),
                            None if inv_freq is None else inv_freq.detach().clone())
            _SHIFT_TABLES[key] = table  # newest last
            while len(_SHIFT_TABLES) > SHARED_SHIFT_TABLES:
                _SHIFT_TABLES.pop(next(iter(_SHIFT_TABLES)))
        return table

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.delta, self.cos, self.sin, self.inv_freq) if t is not None]

    def nbytes(self) -> int:
        return held_bytes(self.tensors())


SHARED_SHIFT_TABLES = 16  # a dynamic store's two tiers, and a compaction's tables before and after, fit
_SHIFT_TABLES: dict[tuple, KeyShifts] = {}
_SHIFT_LOCK = threading.Lock()


@dataclass
class QuantRows:
    """Quantized tokens of one codec, a row each, oldest first. A key row is codes [kv, n, head_dim (int4:
    /2)] plus the index of its group's per-channel scale and zero point (`key_scale` / `key_zero`
    [kv, groups, head_dim]) and of the shift it owes (`shifts`). Rows point at their group instead of
    sitting in fixed blocks so that keeping any subset of them, in any order, moves codes and never
    re-quantizes. Values are codes per token with per-token scales (`values`)."""

    keys: torch.Tensor
    key_scale: torch.Tensor
    key_zero: torch.Tensor | None
    key_group: torch.Tensor  # [n] int32
    key_shift: torch.Tensor  # [n] int32
    shifts: KeyShifts
    values: Packed

    def __len__(self) -> int:
        return self.keys.shape[1]

    @classmethod
    def encode(cls, codec, keys: torch.Tensor, values: torch.Tensor, group: int, channel_group: int) -> "QuantRows":
        """keys/values [kv_heads, n, head_dim] at the positions they sit at: keys per channel over runs of
        `group` tokens (the last run may be shorter), values per token over `channel_group` channels."""
        heads, count, dim = keys.shape
        channels = min(channel_group, dim)
        if dim % channels:
            raise ValueError(f"head_dim {dim} is not a multiple of the value channel group {channels}")
        full = count // group * group
        parts = [codec.encode(keys[:, a:b].reshape(heads, -1, min(b - a, group), dim), dim=2)
                 for a, b in ((0, full), (full, count)) if b > a]
        codes = torch.cat([p.codes.flatten(1, 2) for p in parts], dim=1)
        scale = torch.cat([p.scale[:, :, 0] for p in parts], dim=1)
        zero = None if parts[0].zero is None else torch.cat([p.zero[:, :, 0] for p in parts], dim=1)
        index = torch.arange(count, dtype=torch.int32)
        return cls(codes, scale, zero, index // group, torch.zeros(count, dtype=torch.int32),
                   KeyShifts.of(torch.zeros(1, dtype=torch.long), None, dim // 2, keys.device),
                   codec.encode(values.reshape(heads, count, dim // channels, channels), dim=3))

    def narrow(self, start: int, stop: int) -> "QuantRows":
        """Rows [start, stop) as views (what attention reads: nothing is copied)."""
        return QuantRows(self.keys[:, start:stop], self.key_scale, self.key_zero, self.key_group[start:stop],
                         self.key_shift[start:stop], self.shifts, self.values.narrow(start, stop))

    def select(self, index: torch.Tensor) -> "QuantRows":
        """These rows (a copy), in this order; groups and shifts no row uses any more are dropped."""
        picked = QuantRows(self.keys.index_select(1, index.to(self.keys.device)), self.key_scale, self.key_zero,
                           self.key_group[index], self.key_shift[index], self.shifts, self.values.select(index))
        return picked.compacted()

    def cat(self, other: "QuantRows") -> "QuantRows":
        join = lambda a, b: None if a is None else torch.cat((a, b), dim=1)  # noqa: E731
        inv_freq = self.shifts.inv_freq if self.shifts.inv_freq is not None else other.shifts.inv_freq
        joined = QuantRows(join(self.keys, other.keys), join(self.key_scale, other.key_scale),
                           join(self.key_zero, other.key_zero),
                           torch.cat((self.key_group, other.key_group + self.key_scale.shape[1])),
                           self.key_shift, self.shifts, self.values.cat(other.values))
        return joined.owing(torch.cat((self.owed(), other.owed())), inv_freq)

    def owed(self) -> torch.Tensor:
        """[n] int64: the shift each row owes."""
        return self.shifts.delta[self.key_shift.long()]

    def owing(self, owed: torch.Tensor, inv_freq: torch.Tensor | None) -> "QuantRows":
        """The same codes, each row owing `owed` [n] positions of rotation; unused groups dropped."""
        used, group = torch.unique(self.key_group, return_inverse=True)
        keep = lambda t: None if t is None else t.index_select(1, used.to(t.device))  # noqa: E731
        distinct, index = _zero_first(owed.long())
        return QuantRows(self.keys, keep(self.key_scale), keep(self.key_zero), group.to(torch.int32),
                         index[1:].to(torch.int32),
                         KeyShifts.of(distinct, inv_freq, self.key_scale.shape[-1] // 2, self.keys.device), self.values)

    def shifted(self, delta: torch.Tensor, inv_freq: torch.Tensor) -> "QuantRows":
        """The same codes, each row owing `delta` [n] more positions of rotation."""
        return self.owing(self.owed() + delta.long(), inv_freq)

    def compacted(self) -> "QuantRows":
        """Drop the groups and shifts no row points at, and merge equal shifts."""
        return self.owing(self.owed(), self.shifts.inv_freq)

    def dense_keys(self, codec) -> torch.Tensor:
        """Keys [kv, n, head_dim] in float32 at the positions they sit at now."""
        group = self.key_group.long().to(self.keys.device)
        levels = codec.unpack(self.keys)
        scale = self.key_scale.index_select(1, group).float() * codec.unit
        keys = levels.mul_(scale) if self.key_zero is None else levels.mul_(scale).add_(self.key_zero.index_select(1, group))
        if not bool(self.key_shift.any()):
            return keys
        shift = self.key_shift.long().to(self.keys.device)
        cos, sin = self.shifts.cos.index_select(0, shift), self.shifts.sin.index_select(0, shift)
        return Rerotator.shift(keys, (torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)), in_place=True)

    def dense_values(self, codec) -> torch.Tensor:
        return codec.decode(self.values).flatten(2)

    def runs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Maximal runs of rows that share a key group and a shift, as the kernel reads them: first rows
        [runs + 1] (the last one past the end), and each run's group and shift [runs], int32."""
        group, shift = self.key_group, self.key_shift
        cuts = torch.nonzero((group[1:] != group[:-1]) | (shift[1:] != shift[:-1])).flatten() + 1
        starts = torch.cat((torch.zeros(1, dtype=torch.long), cuts, torch.tensor([len(group)])))
        return starts.to(torch.int32), group[starts[:-1]], shift[starts[:-1]]

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor held, the shift table included (other layers share it: `held_bytes` counts it once)."""
        return [t for t in (self.keys, self.key_scale, self.key_zero, self.key_group, self.key_shift,
                            *self.shifts.tensors(), *self.values.parts()) if t is not None]

    def state(self) -> dict:
        """Its tensors by reference (a fork's snapshot relies on rows never being written in place)."""
        return {**_fields(self), "shifts": _fields(self.shifts), "values": _fields(self.values)}

    @classmethod
    def from_state(cls, state: dict) -> "QuantRows":
        shifts = state["shifts"]
        table = KeyShifts.of(shifts["delta"], shifts["inv_freq"], shifts["cos"].shape[1], shifts["cos"].device)
        return cls(**{**state, "shifts": table, "values": Packed(**state["values"])})


def _zero_first(owed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct values of [0, *owed] with 0 first, and each entry's index among them."""
    distinct, index = torch.unique(torch.cat((torch.zeros(1, dtype=torch.long), owed)), return_inverse=True)
    order = torch.argsort((distinct != 0).to(torch.uint8), stable=True)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(len(order))
    return distinct[order], rank[index]


def _fields(item) -> dict:
    """A dataclass's fields by reference (asdict would deep-copy every tensor)."""
    return {f.name: getattr(item, f.name) for f in fields(item)}


class QuantChunk:
    """Rows of one tier as attention reads them. With few queries (decode, scoring) on the CPU, the C
    kernels of `cache.native` read each code once: a key is levels x scale + zero per channel over its
    group, rotated by the shift it owes, so a query's dot product is (R(-shift) query x scale) . levels +
    R(-shift) query . zero, the rotation and the scale folded into the query once per run of rows that
    share both; a value is levels x scale + zero per token and channel group, so the scale folds into
    the attention weights. Many queries (prefill), or no kernels (another device, no compiler), and the
    chunk is dequantized for a matmul: one chunk of float KV at a time, never the layer's."""

    def __init__(self, codec, rows: QuantRows):
        self.codec, self.rows = codec, rows
        self.kv_heads = rows.keys.shape[0]

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rows.dense_keys(self.codec), self.rows.dense_values(self.codec)

    def scores(self, grouped: torch.Tensor) -> torch.Tensor:
        rows = self.rows
        if grouped.shape[1] > FOLD_ROWS or not native.available(grouped, rows.keys):
            return torch.matmul(grouped.float(), rows.dense_keys(self.codec).transpose(-1, -2))
        return native.key_scores(grouped, rows, self.codec.name, self.codec.unit)

    def weighted(self, weights: torch.Tensor) -> torch.Tensor:
        values = self.rows.values
        if weights.shape[1] > FOLD_ROWS or not native.available(weights, values.codes):
            return torch.matmul(weights, self.rows.dense_values(self.codec))
        return native.value_weighted(weights, values.codes, values.scale, values.zero, self.codec.name, self.codec.unit)


class Tier:
    """Tokens held at one precision, oldest first (`rows`, None when empty)."""

    def __init__(self, kind: str, group: int, channel_group: int, capacity: int | None = None):
        self.kind, self.codec = kind, CODECS[kind]()
        self.group, self.channel_group, self.capacity = group, channel_group, capacity
        self.rows: QuantRows | None = None

    @property
    def length(self) -> int:
        return 0 if self.rows is None else len(self.rows)

    def encode(self, keys: torch.Tensor, values: torch.Tensor) -> QuantRows:
        """keys/values [kv_heads, n, head_dim] quantized afresh for this tier."""
        return QuantRows.encode(self.codec, keys, values, self.group, self.channel_group)

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """keys/values [kv_heads, n, head_dim], the newest tokens of this tier."""
        self.install(self.encode(keys, values) if self.rows is None else self.rows.cat(self.encode(keys, values)))

    def install(self, rows: QuantRows | None) -> None:
        self.rows = rows if rows is not None and len(rows) else None

    def read(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized float32 tokens [start, stop), at the positions they sit at."""
        return QuantChunk(self.codec, self.rows.narrow(start, stop)).dense()

    def chunk(self, start: int, stop: int) -> QuantChunk:
        """Tokens [start, stop) as attention reads them (no copy)."""
        return QuantChunk(self.codec, self.rows.narrow(start, stop))

    def keep(self, start: int, stop: int) -> None:
        """Hold only tokens [start, stop) (copied, so what is dropped really frees memory)."""
        self.install(None if start >= stop else self.rows.select(torch.arange(start, stop)))

    def tensors(self) -> list[torch.Tensor]:
        return [] if self.rows is None else self.rows.tensors()

    def state(self) -> dict:
        return {"rows": None if self.rows is None else self.rows.state()}

    def load(self, state: dict) -> None:
        self.rows = None if state["rows"] is None else QuantRows.from_state(state["rows"])


@dataclass(frozen=True)
class QuantConfig:
    kind: str = "int8"  # int8 | int4 | fp8
    residual: int = 32  # newest tokens always in full precision (the window holds residual..residual+group-1)
    group: int = 32  # tokens per key quantization group (per-channel statistics)
    channel_group: int = 32  # channels per value quantization group (per-token statistics; capped at head_dim)

    def tiers(self) -> list[tuple[str, int | None]]:
        """(codec, capacity in tokens) from newest to oldest; None = unbounded."""
        return [(self.kind, None)]


@dataclass(frozen=True)
class DynamicConfig:
    """Precision by age: the newest residual..residual+group-1 tokens full, the next `int8_tokens` int8,
    everything older int4. Recent tokens get most of the attention, so they get most of the bits."""

    residual: int = 32
    int8_tokens: int = 512  # a multiple of `group`
    group: int = 32
    channel_group: int = 32

    def tiers(self) -> list[tuple[str, int | None]]:
        return [("int8", self.int8_tokens), ("int4", None)]


class QuantizedStorage:
    """LayerStorage holding a full-precision tail (the residual window) and quantized tiers, newest tier
    first. Appends land in the tail; once the tail reaches residual + group tokens its oldest whole groups
    are quantized into the first tier, and a tier over capacity hands its oldest tokens to the next.
    Compaction moves codes (`rearrange`): a token's keys are quantized once per precision it passes
    through, never again for moving."""

    Config = QuantConfig
    kind = "quantized"
    exact_truncate = False  # tokens the cut leaves, but that were quantized out of the window since, stay quantized

    def __init__(self, config: QuantConfig | DynamicConfig | None = None):
        self.config = config or self.Config()
        if any(capacity is not None and capacity % self.config.group for _, capacity in self.config.tiers()):
            raise ValueError(f"tier capacities must be multiples of the group size {self.config.group}")
        self.tiers = [Tier(kind, self.config.group, self.config.channel_group, capacity)
                      for kind, capacity in self.config.tiers()]
        self.tail_keys: torch.Tensor | None = None  # [kv_heads, tokens, head_dim], compute dtype
        self.tail_values: torch.Tensor | None = None
        self.dtype: torch.dtype | None = None  # compute dtype, from the last keys given

    @property
    def tail_length(self) -> int:
        return 0 if self.tail_keys is None else self.tail_keys.shape[1]

    @property
    def length(self) -> int:
        return self.tail_length + sum(tier.length for tier in self.tiers)

    def _settle(self) -> None:
        """Quantize whole groups out of the tail, then push each tier's overflow down to the next."""
        group = self.config.group
        spill = (self.tail_length - self.config.residual) // group * group
        if spill > 0:
            self.tiers[0].append(self.tail_keys[:, :spill], self.tail_values[:, :spill])
            self.tail_keys, self.tail_values = self.tail_keys[:, spill:].clone(), self.tail_values[:, spill:].clone()
        for newer, older in zip(self.tiers, self.tiers[1:]):
            if newer.length > newer.capacity:
                move = newer.length - newer.capacity
                older.append(*newer.read(0, move))
                newer.keep(move, newer.length)

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.dtype = keys.dtype
        if self.tail_keys is None:
            self.tail_keys, self.tail_values = keys[0].clone(), values[0].clone()
        else:
            self.tail_keys = torch.cat((self.tail_keys.to(self.dtype), keys[0]), dim=1)
            self.tail_values = torch.cat((self.tail_values.to(self.dtype), values[0]), dim=1)
        self._settle()

    def update_and_fetch(self, keys, values):
        self.append(keys, values)
        return self.fetch()

    def fetch(self):
        """All tokens dequantized to the compute dtype, oldest first: [1, kv_heads, length, head_dim]."""
        parts = [tier.read(0, tier.length) for tier in reversed(self.tiers) if tier.length]
        if self.tail_length:
            parts.append((self.tail_keys, self.tail_values))
        keys = torch.cat([k.to(self.dtype) for k, _ in parts], dim=1)
        values = torch.cat([v.to(self.dtype) for _, v in parts], dim=1)
        return keys[None], values[None]

    def view(self, dtype):
        return None  # nothing is held in float but the residual window

    def chunks(self, dtype):
        """Oldest first: each tier a chunk at a time, then the float tail."""
        start = 0
        for tier in reversed(self.tiers):
            for first in range(0, tier.length, CHUNK):
                yield start + first, tier.chunk(first, min(first + CHUNK, tier.length))
            start += tier.length
        if self.tail_length:
            yield start, FloatChunk(self.tail_keys.to(dtype), self.tail_values.to(dtype))

    def replace(self, keys, values):
        """Install a sequence by quantizing it afresh (a snapshot restored, a session loaded)."""
        for tier in self.tiers:
            tier.install(None)
        self.tail_keys = self.tail_values = None
        if keys.shape[2]:
            self.append(keys, values)

    def rearrange(self, start: int, order: torch.Tensor | None, delta: torch.Tensor,
                  span: tuple[torch.Tensor, torch.Tensor] | None, rerotator: Rerotator) -> None:
        """A compaction or splice that re-quantizes nothing it need not (`KVStore._rewrite` decides what
        goes where): tokens [0, start) stay; after them come the sources (the span's float keys and values
        [kv_heads, n, head_dim], if any, then the held tokens from `start` on) picked by `order` (None: all),
        each moved by `delta` [moved] positions. A quantized token keeps its codes and owes the shift
        (`KeyShifts`); a float one is rotated. A token is quantized afresh only where its tier cannot hold
        it: a float token landing before quantized ones, or (dynamic kind) an int8 one landing before int4
        ones, which then ages into int4 as it would have."""
        oldest_first = range(len(self.tiers) - 1, -1, -1)
        kind = torch.cat([torch.full((self.tiers[i].length,), i) for i in oldest_first]
                         + [torch.full((self.tail_length,), TAIL)])  # where each held token is: a tier, or the tail
        local = torch.cat([torch.arange(self.tiers[i].length) for i in oldest_first] + [torch.arange(self.tail_length)])
        spanned = 0 if span is None else span[0].shape[1]
        moved_kind = torch.cat((torch.full((spanned,), SPAN), kind[start:]))
        moved_local = torch.cat((torch.arange(spanned), local[start:]))
        if order is not None:
            moved_kind, moved_local = moved_kind[order], moved_local[order]
        kind, local = torch.cat((kind[:start], moved_kind)), torch.cat((local[:start], moved_local))
        shift = torch.cat((torch.zeros(start, dtype=torch.long), delta.long()))
        floats = kind < 0
        tail = len(kind) - int(floats.flip(0).long().cumprod(0).sum())  # the trailing float run stays float
        oldest = torch.where(floats, len(self.tiers) - 1, kind)[:tail]
        target = torch.cummin(oldest, dim=0).values if tail else oldest  # precision never rises with age
        self.dtype = self.dtype or (span[0].dtype if span is not None else torch.float32)
        installed = []
        for index, tier in enumerate(self.tiers):
            rows = torch.nonzero(target == index).flatten()
            kept, fresh = kind[rows] == index, rows[kind[rows] != index]
            pick, parts = torch.empty(len(rows), dtype=torch.long), []
            if bool(kept.any()):
                pick[kept] = local[rows[kept]]
                parts.append(tier.rows)
            if len(fresh):
                pick[~kept] = (tier.length if parts else 0) + torch.arange(len(fresh))
                parts.append(tier.encode(*self._float_rows(kind[fresh], local[fresh], shift[fresh], span, rerotator)))
            if not parts:
                installed.append(None)
                continue
            rows_now = (parts[0] if len(parts) == 1 else parts[0].cat(parts[1])).select(pick)
            owed = torch.where(kept, shift[rows], 0)
            installed.append(rows_now.shifted(owed, rerotator.inv_freq) if bool(owed.any()) else rows_now)
        rest = torch.arange(tail, len(kind))
        tail_kv = self._float_rows(kind[rest], local[rest], shift[rest], span, rerotator)
        for tier, rows in zip(self.tiers, installed):
            tier.install(rows)
        self.tail_keys, self.tail_values = (None, None) if tail_kv is None else (t.to(self.dtype) for t in tail_kv)
        self._settle()

    def _float_rows(self, kind: torch.Tensor, local: torch.Tensor, shift: torch.Tensor,
                    span: tuple[torch.Tensor, torch.Tensor] | None,
                    rerotator: Rerotator) -> tuple[torch.Tensor, torch.Tensor] | None:
        """float32 keys and values [kv_heads, n, head_dim] of these tokens (held in a tier or the tail, or
        the span's), rotated by `shift` to where they land; None for none."""
        if not len(kind):
            return None
        parts = []
        for source in kind.unique().tolist():
            at = torch.nonzero(kind == source).flatten()
            if source == SPAN:
                kv = tuple(t[:, local[at].to(t.device)] for t in span)
            elif source == TAIL:
                kv = tuple(t[:, local[at].to(t.device)] for t in (self.tail_keys, self.tail_values))
            else:
                tier = self.tiers[source]
                kv = QuantChunk(tier.codec, tier.rows.select(local[at])).dense()
            parts.append((at, kv))
        (heads, _, dim), device = parts[0][1][0].shape, parts[0][1][0].device
        keys = torch.empty(heads, len(kind), dim, device=device)
        values = torch.empty(heads, len(kind), parts[0][1][1].shape[-1], device=device)
        for at, (k, v) in parts:
            keys[:, at.to(device)], values[:, at.to(device)] = k.float(), v.float()
        if bool(shift.any()):
            keys = rerotator.shift(keys, rerotator.rotation(shift, device), in_place=True)
        return keys, values

    def truncate(self, length: int) -> None:
        """Crop to `length` tokens: rows past the cut go, every kept one stays as it is."""
        start = 0
        for tier in reversed(self.tiers):  # oldest first
            held = tier.length
            if length - start < held:
                tier.keep(0, max(0, length - start))
            start += held
        keep = max(0, length - start)
        if keep < self.tail_length:
            self.tail_keys, self.tail_values = self.tail_keys[:, :keep].clone(), self.tail_values[:, :keep].clone()

    def fit(self, reserve: int = 0) -> None:
        """Nothing to give back: groups and the tail are allocated to size."""

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor held: the tail, and each tier's codes, scales, zero points, indices and shift table."""
        tail = [] if self.tail_keys is None else [self.tail_keys, self.tail_values]
        return tail + [t for tier in self.tiers for t in tier.tensors()]

    def nbytes(self) -> int:
        """Bytes really held, a shift table two tiers share counted once."""
        return held_bytes(self.tensors())

    def state(self) -> dict:
        return {"kind": self.kind, "layout": LAYOUT, "config": asdict(self.config), "dtype": self.dtype,
                "tiers": [tier.state() for tier in self.tiers], "tail": (self.tail_keys, self.tail_values)}

    def load_state(self, state: dict) -> None:
        check_kind(state, self.kind)
        if state.get("layout") != LAYOUT:
            raise ValueError(f"a quantized layer saved in layout {state.get('layout', 1)} cannot be read by this code "
                             f"(layout {LAYOUT}: keys a row each, owing their shifts)")
        if self.Config(**state["config"]) != self.config:
            raise ValueError(f"a layer quantized as {state['config']} cannot be loaded into one configured {self.config}")
        self.dtype = state["dtype"]
        self.tail_keys, self.tail_values = state["tail"]
        for tier, tier_state in zip(self.tiers, state["tiers"]):
            tier.load(tier_state)

    @classmethod
    def from_state(cls, state: dict) -> "QuantizedStorage":
        storage = cls(cls.Config(**state["config"]))
        storage.load_state(state)
        return storage


class DynamicStorage(QuantizedStorage):
    """kv-dtype `dynamic`: full precision, then int8, then int4 as tokens age (see DynamicConfig)."""

    Config = DynamicConfig
    kind = "dynamic"
