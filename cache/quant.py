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

Batch 1 only: the engine feeds one sequence, so tensors are [1, kv_heads, tokens, head_dim] at the edges;
inside, [kv_heads, tokens, head_dim]."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import torch

from cache import native
from cache.storage import CHUNK, FloatChunk, check_kind

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

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.parts())

    def narrow(self, start: int, stop: int, copy: bool = False) -> "Packed":
        """Entries [start, stop) along dim 1; `copy` when keeping them, so dropped entries really free memory."""
        cut = lambda t: None if t is None else t[:, start:stop].clone() if copy else t[:, start:stop]  # noqa: E731
        return Packed(cut(self.codes), cut(self.scale), cut(self.zero))

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


class QuantChunk:
    """Whole key groups of one tier as attention reads them, without dequantizing when the queries are
    few (decode, scoring): a key is levels x scale + zero per channel over its group, so a query's dot
    product is (query x scale) . levels + query . zero, the scale folded into the query once per group;
    a value is levels x scale + zero per token and channel group, so the scale folds into the attention
    weights. On the CPU the C kernels of `cache.native` do this reading each code once; elsewhere (or
    without a compiler) torch's ops do, converting only the levels to float. Many queries (prefill) would
    make those folded copies larger than the chunk: then it dequantizes."""

    def __init__(self, codec, keys: Packed, values: Packed):
        self.codec, self.keys, self.values = codec, keys, values
        self.kv_heads = keys.codes.shape[0]

    def dense_keys(self) -> torch.Tensor:
        """Dequantized [kv_heads, n, head_dim] keys."""
        return self.codec.decode(self.keys).flatten(1, 2)

    def dense_values(self) -> torch.Tensor:
        return self.codec.decode(self.values).flatten(2)

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.dense_keys(), self.dense_values()

    def scores(self, grouped: torch.Tensor) -> torch.Tensor:
        if grouped.shape[1] > FOLD_ROWS:
            return torch.matmul(grouped.float(), self.dense_keys().transpose(-1, -2))
        keys = self.keys
        if native.available(grouped, keys.codes):
            return native.key_scores(grouped, keys.codes, keys.scale, keys.zero, self.codec.name, self.codec.unit)
        return self.folded_scores(grouped)

    def weighted(self, weights: torch.Tensor) -> torch.Tensor:
        if weights.shape[1] > FOLD_ROWS:
            return torch.matmul(weights, self.dense_values())
        values = self.values
        if native.available(weights, values.codes):
            return native.value_weighted(weights, values.codes, values.scale, values.zero, self.codec.name,
                                         self.codec.unit)
        return self.folded_weighted(weights)

    def folded_scores(self, grouped: torch.Tensor) -> torch.Tensor:
        """`scores` in torch ops (the reference the C kernel is tested against, and the path off the CPU)."""
        grouped = grouped.float()
        heads, rows, _ = grouped.shape
        levels = self.codec.unpack(self.keys.codes)  # [kv, groups, group, dim]
        folded = grouped[:, None] * (self.keys.scale.float() * self.codec.unit)  # [kv, groups, rows, dim]
        scores = torch.matmul(folded, levels.transpose(-1, -2))  # [kv, groups, rows, group]
        if self.keys.zero is not None:
            scores += torch.matmul(grouped[:, None], self.keys.zero.float().transpose(-1, -2))  # [kv, groups, rows, 1]
        return scores.transpose(1, 2).reshape(heads, rows, -1)

    def folded_weighted(self, weights: torch.Tensor) -> torch.Tensor:
        """`weighted` in torch ops, as `folded_scores` is for `scores`."""
        levels = self.codec.unpack(self.values.codes)  # [kv, n, channel groups, channels]
        scale = (self.values.scale[..., 0].float() * self.codec.unit).transpose(1, 2).contiguous()  # [kv, groups, n]
        parts = [torch.matmul(weights * scale[:, None, j], levels[:, :, j]) for j in range(levels.shape[2])]
        out = torch.stack(parts, dim=2)  # [kv, rows, channel groups, channels]
        if self.values.zero is not None:
            out += torch.matmul(weights, self.values.zero.float()[..., 0])[..., None]
        return out.flatten(2)


class Tier:
    """Tokens held at one precision, oldest first, always a whole number of key groups."""

    def __init__(self, kind: str, group: int, channel_group: int, capacity: int | None = None):
        self.kind, self.codec = kind, CODECS[kind]()
        self.group, self.channel_group, self.capacity = group, channel_group, capacity
        self.keys: Packed | None = None
        self.values: Packed | None = None
        self.length = 0

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """keys/values [kv_heads, n * group, head_dim], the newest tokens of this tier."""
        heads, count, dim = keys.shape
        channels = min(self.channel_group, dim)
        if dim % channels:
            raise ValueError(f"head_dim {dim} is not a multiple of the value channel group {channels}")
        new_keys = self.codec.encode(keys.reshape(heads, count // self.group, self.group, dim), dim=2)
        new_values = self.codec.encode(values.reshape(heads, count, dim // channels, channels), dim=3)
        self.keys = new_keys if self.keys is None else self.keys.cat(new_keys)
        self.values = new_values if self.values is None else self.values.cat(new_values)
        self.length += count

    def read(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized float32 tokens [start, stop), decoding only the groups that cover them."""
        first = start // self.group * self.group
        keys, values = self.chunk(first, -(-stop // self.group) * self.group).dense()
        return keys[:, start - first : stop - first], values[:, start - first : stop - first]

    def chunk(self, start: int, stop: int) -> QuantChunk:
        """Tokens [start, stop), both on group boundaries, as attention reads them (no copy)."""
        return QuantChunk(self.codec, self.keys.narrow(start // self.group, stop // self.group),
                          self.values.narrow(start, stop))

    def keep(self, start: int, stop: int) -> None:
        """Hold only tokens [start, stop), both on group boundaries."""
        if start == stop:
            self.keys = self.values = None
        else:
            self.keys = self.keys.narrow(start // self.group, stop // self.group, copy=True)
            self.values = self.values.narrow(start, stop, copy=True)
        self.length = stop - start

    def nbytes(self) -> int:
        return self.keys.nbytes() + self.values.nbytes() if self.keys is not None else 0

    def state(self) -> dict:
        packed = lambda p: None if p is None else {f.name: getattr(p, f.name) for f in fields(p)}  # noqa: E731
        return {"length": self.length, "keys": packed(self.keys), "values": packed(self.values)}

    def load(self, state: dict) -> None:
        self.length = state["length"]
        self.keys = Packed(**state["keys"]) if state["keys"] is not None else None
        self.values = Packed(**state["values"]) if state["values"] is not None else None


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
    are quantized into the first tier, and a tier over capacity hands its oldest groups to the next."""

    Config = QuantConfig
    kind = "quantized"
    exact_truncate = False  # groups quantized after the cut stay quantized

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
        parts.append((self.tail_keys, self.tail_values))
        keys = torch.cat([k.to(self.dtype) for k, _ in parts], dim=1)
        values = torch.cat([v.to(self.dtype) for _, v in parts], dim=1)
        return keys[None], values[None]

    def view(self, dtype):
        return None  # nothing is held in float but the residual window

    def chunks(self, dtype):
        """Oldest first: each tier dequantized a chunk (whole key groups) at a time, then the float tail."""
        start, size = 0, max(self.config.group, CHUNK // self.config.group * self.config.group)
        for tier in reversed(self.tiers):
            for first in range(0, tier.length, size):
                yield start + first, tier.chunk(first, min(first + size, tier.length))
            start += tier.length
        if self.tail_length:
            yield start, FloatChunk(self.tail_keys.to(dtype), self.tail_values.to(dtype))

    def replace(self, keys, values):
        """Install a compacted sequence by quantizing it afresh (keys were re-rotated, so old codes are stale)."""
        for tier in self.tiers:
            tier.keep(0, 0)
        self.tail_keys = self.tail_values = None
        if keys.shape[2]:
            self.append(keys, values)

    def truncate(self, length: int) -> None:
        """Crop to `length` tokens. Whole groups before the cut stay quantized as they are; the partial
        group the cut falls in is dequantized into the tail, so nothing is quantized twice."""
        length = max(0, length)
        if length >= self.length:
            return
        start = self.length - self.tail_length
        if length >= start:
            keep = length - start
            self.tail_keys, self.tail_values = self.tail_keys[:, :keep].clone(), self.tail_values[:, :keep].clone()
            return
        for tier in self.tiers:  # newest first: every tier after the cut is emptied
            start -= tier.length
            if length >= start:
                cut = length - start
                whole = cut // self.config.group * self.config.group
                keys, values = tier.read(whole, cut)
                self.tail_keys, self.tail_values = keys.to(self.dtype).clone(), values.to(self.dtype).clone()  # not views of a decoded group
                tier.keep(0, whole)
                return
            tier.keep(0, 0)

    def fit(self, reserve: int = 0) -> None:
        """Nothing to give back: groups and the tail are allocated to size."""

    def nbytes(self) -> int:
        """Bytes really held: codes, scales, zero points and the full-precision tail."""
        tail = 0 if self.tail_keys is None else 2 * self.tail_keys.numel() * self.tail_keys.element_size()
        return tail + sum(tier.nbytes() for tier in self.tiers)

    def state(self) -> dict:
        return {"kind": self.kind, "config": asdict(self.config), "dtype": self.dtype,
                "tiers": [tier.state() for tier in self.tiers], "tail": (self.tail_keys, self.tail_values)}

    def load_state(self, state: dict) -> None:
        check_kind(state, self.kind)
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
