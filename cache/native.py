"""The C kernels of `quant_kernels.c` (quantized keys' scores and values' weighted sum for a few queries),
`compact_kernels.c` (a float layer's rows moved with their re-rotation in one pass: a compaction in place, a
splice; gathers of evicted and recalled rows),
`attention_kernels.c` (one new token's attention over a float32 layer, with the mass each key receives) and
`agent/weight_kernels.c` (int8 weights times a few activation rows: the output layer in decode; int4 weights
times activations quantized per group, by integer dot products; float32 rows times bfloat16 weights or Q4_1 codes
widened in registers), compiled
on first use with the machine's C compiler into one library and loaded through ctypes.

Why C: decode over int8 / int4 / fp8 KV is bound by the bytes it reads, but torch needs several full
passes to turn codes into floats (widen, shift, mask, convert) before its matmul reads them again. The
kernels decode each row into a few registers' worth of floats and use it at once, so the codes are
read once. The library is built for this CPU (-march=native) into the model cache, keyed by the source,
the flags and the CPU, so a changed machine rebuilds. It links OpenMP by the same soname as torch's
bundled libgomp, so both share one thread pool.

Where no compiler works, or tensors are not on the CPU, `available()` is False and callers keep torch's
ops (the reference path, tested against these). PALACE_NATIVE=0 turns the kernels off."""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import subprocess
import sys
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from cache.quant import QuantRows

SOURCES = (*(Path(__file__).with_name(name) for name in ("quant_kernels.c", "compact_kernels.c", "attention_kernels.c")),
           *(Path(__file__).resolve().parent.parent / "agent" / name for name in ("weight_kernels.c", "bf16_glue.c")))
HEADERS = tuple(Path(__file__).with_name(name) for name in ("kernel_math.h", "attention_kernels.h"))  # part of the build's key
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
KINDS = {"int8": 8, "int4": 4, "fp8": 0}  # the codes' layout, as the kernels name it

_i, _i64, _f, _p = ctypes.c_int, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
SIGNATURES = {"key_scores": [_p, _i, _i, _i, _p, _i64, _i, _p, _p, _p, _i, _p, _p, _i64, _p, _p, _f, _p, _i],
              "value_weighted": [_p, _i, _i, _i, _p, _i64, _i, _i, _i, _p, _p, _i64, _f, _p, _i],
              "move_rows": [_p, _p, _p, _i, _i, _i, _i, _p, _p, _p, _p, _i, _p, _p, _p, _i, _i],
              "gather_tokens": [_p, _p, _p, _i, _i64, _p, _p, _i, _i],
              "gather_layer_rows": [_p, _p, _p, _i, _i, _i64, _p, _i, _i],
              "q8_matmul": [_p, _i, _i, _p, _p, _i, _p, _i],
              "w16_matmul": [_p, _i, _i, _p, _p, _i, _p, _i],
              "q4f_matmul": [_p, _i, _i, _p, _p, _p, _p, _i, _p, _i],
              "q4_matmul": [_p, _i, _i, _i, _p, _f, _p, _p, _i, _p, _p, _p, _i, _i, _p, _i],
              "q4_mlp": [_p, _p, _i, _i, _i, _p, _p, _p, _f, _p, _p, _p, _p, _p, _i],
              "attend_one": [_p, _i, _i, _i, _p, _p, _i64, _i, _f, _p, _p, _i],
              "prepare_rows": [_p, _i, _i, _i, _p, _f, _p, _i],
              "rotate_rows": [_p, _i, _i, _i, _i, _p, _p, _i],
              "q4_decode_layer": [_p, _p, _p, _p, _p, _p, _i64, _i, _f, _p, _p, _i],
              "q4_dense": [_p, _p, _i, _i, _p, _i],
              "bf16_rms_norm": [_p, _i, _i, _p, _f, _p, _i],
              "bf16_swiglu": [_p, _i, _i, _p, _i],
              "bf16_rotate": [_p, _i, _i, _i, _i, _p, _p, _i]}


def _cpu_id() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return next((line for line in lines if line.startswith("flags")), platform.processor())
    except OSError:
        return platform.processor()


def compiler() -> str:
    return os.environ.get("CC", "cc")


def library_path() -> Path:
    from agent.model import cache_dir

    key = hashlib.sha256("\0".join([*(source.read_text() for source in SOURCES + HEADERS), compiler(), *FLAGS, platform.machine(), _cpu_id()]).encode())
    return cache_dir() / "native" / f"kernels-{key.hexdigest()[:16]}.so"


def build(path: Path) -> None:
    """Compile into a temporary file and rename it into place, so a half-written library is never loaded;
    then remove the builds of other sources or CPUs beside it (a process that loaded one keeps its mapping)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".so", delete=False) as tmp:
        partial = Path(tmp.name)
    try:
        subprocess.run([compiler(), *FLAGS, *map(str, SOURCES), "-o", str(partial)], check=True,
                       capture_output=True, text=True, timeout=120)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    for stale in path.parent.glob("*kernels-*.so"):  # earlier builds were named quant_kernels-*
        if stale != path:
            stale.unlink(missing_ok=True)


@lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None (once, with a one-line reason on stderr) when they cannot be built."""
    if os.environ.get("PALACE_NATIVE", "1") == "0":
        return None
    path = library_path()
    try:
        if not path.exists():
            build(path)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as error:
        detail = getattr(error, "stderr", None) or error
        print(f"memory-palace: native KV kernels unavailable, using torch ops ({str(detail).strip().splitlines()[-1]})",
              file=sys.stderr)
        return None
    for name, signature in SIGNATURES.items():
        getattr(lib, name).argtypes, getattr(lib, name).restype = signature, None
    lib.q4_matmul.restype = lib.q4_mlp.restype = lib.attend_one.restype = lib.q4_decode_layer.restype = ctypes.c_int
    lib.q4f_matmul.restype = ctypes.c_int
    for probe in (lib.q8_fast, lib.q4_fast, lib.attend_fast, lib.w16_block):
        probe.argtypes, probe.restype = [], ctypes.c_int
    return lib


def available(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" for t in tensors) and library() is not None


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _operands(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None):
    """Codes, scales and zero points with every axis after the head axis contiguous (a chunk is a narrow
    view along axis 1, so the head axis keeps the whole tier's stride: the kernels take that stride and
    walk the rest densely), scales and zero points with one head stride."""
    dense = lambda t: t if t is None or t[0].is_contiguous() else t.contiguous()  # noqa: E731
    codes, scale, zero = dense(codes), dense(scale), dense(zero)
    if zero is not None and zero.stride(0) != scale.stride(0):
        scale, zero = scale.contiguous(), zero.contiguous()
    return codes, scale, zero


def key_scores(grouped: torch.Tensor, rows: "QuantRows", kind: str, unit: float) -> torch.Tensor:
    """grouped [kv, rows, dim] float32 queries against quantized key rows (cache.quant.QuantRows, a narrow
    view of a tier's) -> [kv, rows, tokens] scores, each row's shift applied."""
    grouped = _dense(grouped)
    codes, scale, zero = _operands(rows.keys, rows.key_scale, rows.key_zero)
    starts, groups, shifts = rows.runs()
    cos, sin = rows.shifts.cos.contiguous(), rows.shifts.sin.contiguous()
    heads, count, dim = grouped.shape
    out = torch.empty(heads, count, len(rows), dtype=torch.float32)
    library().key_scores(grouped.data_ptr(), heads, count, dim, codes.data_ptr(), codes.stride(0), len(groups),
                         starts.data_ptr(), groups.data_ptr(), shifts.data_ptr(), KINDS[kind], scale.data_ptr(),
                         _ptr(zero), scale.stride(0), cos.data_ptr(), sin.data_ptr(), unit, out.data_ptr(),
                         torch.get_num_threads())
    return out


def value_weighted(weights: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                   kind: str, unit: float) -> torch.Tensor:
    """weights [kv, rows, n] float32; codes [kv, n, channel groups, channels (int4: channels/2)]; scale and
    zero [kv, n, channel groups, 1] float16 -> [kv, rows, channel groups * channels]."""
    weights = _dense(weights)
    codes, scale, zero = _operands(codes, scale, zero)
    heads, rows, tokens = weights.shape
    channel_groups = codes.shape[2]
    channels = codes.shape[3] * (2 if kind == "int4" else 1)
    out = torch.empty(heads, rows, channel_groups * channels, dtype=torch.float32)
    library().value_weighted(weights.data_ptr(), heads, rows, tokens, codes.data_ptr(), codes.stride(0),
                             channel_groups, channels, KINDS[kind], scale.data_ptr(), _ptr(zero), scale.stride(0),
                             unit, out.data_ptr(), torch.get_num_threads())
    return out


COMPACT_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def compact_rows(layers: list[tuple[torch.Tensor, torch.Tensor]], index: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, rotate: torch.Tensor) -> None:
    """In place, for every layer's keys and values [1, heads, rows, dim] (its buffers from the first row
    rewritten, rows contiguous in each head) and every head: row j takes row index[j] (ascending, index[j] >=
    j), and the keys where `rotate` [n] is set are turned by cos / sin [n, dim / 2]. float32 or bfloat16; one
    call for all layers."""
    index = index.to(torch.int64).contiguous()
    _move_rows(layers, layers, [keys.stride(1) for keys, _ in layers], index, index.numel(), cos, sin, rotate,
               fused=False)


def place_rows(layers: list[tuple[torch.Tensor, torch.Tensor]], span_keys: torch.Tensor, span_values: torch.Tensor,
               cos: torch.Tensor, sin: torch.Tensor, rotate: torch.Tensor) -> None:
    """Row j of every head of every layer's keys and values [1, heads, rows, dim] (its buffers from the first
    row written, rows contiguous in each head) takes row j of that layer's span_keys / span_values [layers,
    heads, n, dim] (contiguous, the buffers' dtype), the key turned by cos / sin [n, dim / 2] where `rotate`
    [n] is set, rounded as torch's out-of-place rotation (cache/rope.py) rounds it. One call for all layers."""
    sources = [(keys, values) for keys, values in zip(span_keys, span_values)]
    _move_rows(layers, sources, [span_keys.stride(1)] * len(layers), None, span_keys.shape[2], cos, sin, rotate,
               fused=True)


def _move_rows(layers: list[tuple[torch.Tensor, torch.Tensor]], sources: list[tuple[torch.Tensor, torch.Tensor]],
               source_strides: list[int], index: torch.Tensor | None, n: int, cos: torch.Tensor, sin: torch.Tensor,
               rotate: torch.Tensor, fused: bool) -> None:
    first = layers[0][0]
    heads, dim = first.shape[1], first.shape[3]
    pointers = lambda tensors: torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64)  # noqa: E731
    keys, values = pointers(k for k, _ in layers), pointers(v for _, v in layers)
    source_keys, source_values = pointers(k for k, _ in sources), pointers(v for _, v in sources)
    strides = torch.tensor([k.stride(1) for k, _ in layers], dtype=torch.int64)
    source_strides = torch.tensor(source_strides, dtype=torch.int64)
    cos, sin = _dense(cos), _dense(sin)
    rotate = rotate.to(torch.uint8).contiguous()
    library().move_rows(keys.data_ptr(), values.data_ptr(), strides.data_ptr(), len(layers), heads, dim,
                        COMPACT_DTYPES[first.dtype], source_keys.data_ptr(), source_values.data_ptr(),
                        source_strides.data_ptr(), _ptr(index), n, cos.data_ptr(), sin.data_ptr(), rotate.data_ptr(),
                        int(fused), torch.get_num_threads())


def gather_layer_rows(layers: list[torch.Tensor], index: torch.Tensor) -> torch.Tensor:
    """[len(layers), heads, n, dim] from layers' [1, heads, rows, dim] views (each head's rows dense, any
    head stride; one dtype): token j is every layer's row index[j]. One call for all layers."""
    first = layers[0]
    out = first.new_empty((len(layers), first.shape[1], index.numel(), first.shape[3]))
    if not index.numel():
        return out
    pointers = torch.tensor([layer.data_ptr() for layer in layers], dtype=torch.int64)
    strides = torch.tensor([layer.stride(1) * layer.element_size() for layer in layers], dtype=torch.int64)
    index = index.to(torch.int64).contiguous()
    library().gather_layer_rows(out.data_ptr(), pointers.data_ptr(), strides.data_ptr(), len(layers), first.shape[1],
                                first.shape[3] * first.element_size(), index.data_ptr(), index.numel(),
                                torch.get_num_threads())
    return out


def rows_dense(*tensors: torch.Tensor) -> bool:
    """Whether these [1, heads, rows, dim] views can be read row by row by the kernels: on the CPU, one
    dtype they know, each head's rows dense."""
    return available(*tensors) and all(t.dtype in COMPACT_DTYPES and t.dtype == tensors[0].dtype and t.stride(3) == 1
                                       and t.stride(2) == t.shape[3] for t in tensors)


def gather_tokens(sources: list[torch.Tensor], part: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """[a, b, n, d] from contiguous sources [a, b, n_p, d] of one dtype: token j is sources[part[j]]'s token
    index[j]; each token copied once (torch would join the sources first, then gather: twice)."""
    first = sources[0]
    out = first.new_empty((*first.shape[:2], part.numel(), first.shape[3]))
    if not part.numel():
        return out
    pointers = torch.tensor([source.data_ptr() for source in sources], dtype=torch.int64)
    lengths = torch.tensor([source.shape[2] for source in sources], dtype=torch.int64)
    part, index = part.to(torch.int64).contiguous(), index.to(torch.int64).contiguous()
    library().gather_tokens(out.data_ptr(), pointers.data_ptr(), lengths.data_ptr(), first.shape[0] * first.shape[1],
                            first.shape[3] * first.element_size(), part.data_ptr(), index.data_ptr(), part.numel(),
                            torch.get_num_threads())
    return out


def q8_fast() -> bool:
    """Whether the int8 output-layer kernel beats a float32 matmul on this machine (its vector code: AVX-512,
    or AVX2 with FMA and F16C)."""
    return library() is not None and bool(library().q8_fast())


def q8_matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [rows, k] float32 times int8 weights (codes [n, k], one float32 scale per 32 inputs: scales
    [n, k / 32]), transposed -> [rows, n] float32."""
    x = _dense(x)
    out = torch.empty(x.shape[0], codes.shape[0], dtype=torch.float32)
    library().q8_matmul(x.data_ptr(), x.shape[0], x.shape[1], codes.data_ptr(), scales.data_ptr(), codes.shape[0],
                        out.data_ptr(), torch.get_num_threads())
    return out


def w16_pack(weight: torch.Tensor) -> torch.Tensor:
    """A linear layer's weight [n, k] rounded to bfloat16 and laid out for `w16_matmul`: blocks of
    `w16_block()` outputs, each [k, block] (n a multiple of the block)."""
    block = library().w16_block()
    n, k = weight.shape
    return weight.detach().to(torch.bfloat16).reshape(n // block, block, k).transpose(1, 2).contiguous()


def w16_matmul(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, k] float32 times a weight packed by `w16_pack`, transposed, plus a float32 bias [n] ->
    [rows, n] float32: the float32 product with the weight rounded to bfloat16, read at half the bytes."""
    x = _dense(x)
    out = torch.empty(x.shape[0], packed.shape[0] * packed.shape[2], dtype=torch.float32)
    library().w16_matmul(x.data_ptr(), x.shape[0], x.shape[1], packed.data_ptr(), _ptr(_dense(bias)), out.shape[1],
                         out.data_ptr(), torch.get_num_threads())
    return out


Q4F_GROUP = 32  # Q4_1's inputs a scale and minimum


def q4f_pack(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A float32 weight [n, k] that is exactly GGUF Q4_1 (per 32 inputs a float16 scale and minimum, codes 0..15)
    as `q4f_matmul` reads it: codes uint8 [n / block, k, block / 2] (byte j: output j's code in the low nibble,
    output j + block / 2's in the high one) and float32 scales and minimums [n / block, k / 32, 2, block].
    None when the weight is not exactly that (or the shapes do not fit): then it is not the same product."""
    block = library().w16_block()
    n, k = weight.shape
    if n % block or k % Q4F_GROUP or weight.dtype != torch.float32:
        return None
    groups = weight.detach().reshape(n, k // Q4F_GROUP, Q4F_GROUP)
    low, high = torch.aminmax(groups, dim=-1, keepdim=True)  # one pass (amin then amax took 4x as long)
    scale, low = ((high - low) / 15).half().float(), low.half().float()
    codes = ((groups - low) / scale.clamp_min(torch.finfo(torch.float32).tiny)).round_()  # a flat group: code 0
    least, most = torch.aminmax(codes)
    if least < 0 or most > 15 or not torch.equal(torch.addcmul(low, codes, scale), groups):
        return None
    codes, half = codes.to(torch.uint8).reshape(n // block, block, k), block // 2
    packed = (codes[:, :half] | codes[:, half:] << 4).transpose(1, 2).contiguous()  # [blocks, k, block / 2]
    params = torch.stack([scale, low], -1).reshape(n // block, block, k // Q4F_GROUP, 2).permute(0, 2, 3, 1)
    return packed, params.contiguous()


def q4f_matmul(x: torch.Tensor, codes: torch.Tensor, params: torch.Tensor, bias: torch.Tensor | None = None,
               residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, k] float32 times a weight packed by `q4f_pack`, transposed, plus a float32 bias [n] and a
    residual [rows, n] where given -> [rows, n] float32: the float32 product of the weight it holds exactly, read
    at an eighth of the bytes."""
    x = _dense(x)
    out = torch.empty(x.shape[0], codes.shape[0] * codes.shape[2] * 2, dtype=torch.float32)
    if library().q4f_matmul(x.data_ptr(), x.shape[0], x.shape[1], codes.data_ptr(), params.data_ptr(),
                            _ptr(_dense(bias)), _ptr(_dense(residual)), out.shape[1], out.data_ptr(),
                            torch.get_num_threads()):
        raise MemoryError("q4f_matmul: no memory for a block's widened weights")
    return out


def q4_fast() -> bool:
    """Whether the int4 kernel runs on integer dot products here (AVX-512 VNNI, or AVX2 without AVX-512);
    elsewhere its scalar reference is exact but slow, so Int4Linear keeps torch's layout and kernel."""
    return library() is not None and bool(library().q4_fast())


def q4_matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, norm: tuple[torch.Tensor, float] | None = None,
              residual: torch.Tensor | None = None, swiglu: bool = False,
              rotary: tuple[torch.Tensor, torch.Tensor, int, int] | None = None) -> torch.Tensor:
    """x [rows, k] times int4 weights in the kernel's layout (codes uint8 [n / 16, k * 8]; scales float16
    [n / 16, k / 32, 2, 16], scale then minimum), transposed -> [rows, n] float32. Folded in where given:
    with `swiglu`, x is [rows, 2k] and the product reads silu(gate) * up of its halves; `norm` (weight
    [k] float32, eps) RMS-normalizes each row first; `residual` [rows, n] float32 is added to the result;
    `rotary` (cos, sin [rows, head_dim] float32, outputs to rotate, head_dim) rotates the first outputs of
    each row head by head (queries and keys)."""
    x = _dense(x)
    k = x.shape[1] // 2 if swiglu else x.shape[1]
    out = torch.empty(x.shape[0], codes.shape[0] * 16, dtype=torch.float32)
    weight, eps = norm if norm is not None else (None, 0.0)
    cos, sin, rotated, head_dim = rotary if rotary is not None else (None, None, 0, 0)
    if library().q4_matmul(x.data_ptr(), x.shape[0], k, int(swiglu), _ptr(weight), eps, codes.data_ptr(),
                           scales.data_ptr(), out.shape[1], _ptr(_dense(residual)), _ptr(_dense(cos)), _ptr(_dense(sin)),
                           rotated, head_dim, out.data_ptr(), torch.get_num_threads()):
        raise MemoryError(f"q4_matmul: no memory for {x.shape[0]} rows of quantized activations")
    return out


def q4_mlp(attended: torch.Tensor, stream: torch.Tensor, o: tuple[torch.Tensor, torch.Tensor], norm: tuple[torch.Tensor, float],
           gate_up: tuple[torch.Tensor, torch.Tensor], down: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """A Llama layer after attention in one call: stream + attended @ o^T, RMS norm, gate and up, SwiGLU, down,
    residual add; attended and stream [rows, d] float32; each weight (codes, scales) in q4_matmul's layout."""
    attended, stream = _dense(attended), _dense(stream)
    rows, d = stream.shape
    ff = gate_up[0].shape[0] * 8
    out = torch.empty(rows, d, dtype=torch.float32)
    if library().q4_mlp(attended.data_ptr(), stream.data_ptr(), rows, d, ff, o[0].data_ptr(), o[1].data_ptr(),
                        norm[0].data_ptr(), norm[1], gate_up[0].data_ptr(), gate_up[1].data_ptr(), down[0].data_ptr(),
                        down[1].data_ptr(), out.data_ptr(), torch.get_num_threads()):
        raise MemoryError(f"q4_mlp: no memory for {rows} rows of quantized activations")
    return out


def q4_dense(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 weights [n, k] of int4 codes in q4_matmul's layout (codes uint8 [n / 16, k * 8])."""
    out = torch.empty(codes.shape[0] * 16, codes.shape[1] // 8, dtype=torch.float32)
    library().q4_dense(codes.data_ptr(), scales.data_ptr(), out.shape[0], out.shape[1], out.data_ptr(), torch.get_num_threads())
    return out


class Q4Layer(ctypes.Structure):
    """A decoder layer's int4 weights and norms for `q4_decode_layer` (weight_kernels.c's q4_layer). It keeps
    the tensors it points into alive."""

    _fields_ = [*((name, _p) for name in ("qkv_codes", "o_codes", "gate_up_codes", "down_codes", "qkv_scales",
                                          "o_scales", "gate_up_scales", "down_scales", "norm_in", "norm_post")),
                ("eps_in", _f), ("eps_post", _f), *((name, _i) for name in ("d", "ff", "heads", "kv_heads", "head_dim"))]

    @classmethod
    def of(cls, qkv: tuple[torch.Tensor, torch.Tensor], o: tuple[torch.Tensor, torch.Tensor],
           gate_up: tuple[torch.Tensor, torch.Tensor], down: tuple[torch.Tensor, torch.Tensor],
           norms: tuple[tuple[torch.Tensor, float], tuple[torch.Tensor, float]], heads: int, kv_heads: int,
           head_dim: int) -> "Q4Layer":
        """Each weight (codes, scales) in q4_matmul's layout; norms (input, post-attention) as (float32 weight, eps)."""
        tensors = (qkv, o, gate_up, down)
        (norm_in, eps_in), (norm_post, eps_post) = norms
        layer = cls(*(codes.data_ptr() for codes, _ in tensors), *(scales.data_ptr() for _, scales in tensors),
                    norm_in.data_ptr(), norm_post.data_ptr(), eps_in, eps_post, o[0].shape[0] * 16,
                    gate_up[0].shape[0] * 8, heads, kv_heads, head_dim)
        layer.held = (tensors, norms)
        return layer


def q4_decode_layer(layer: Q4Layer, stream: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor,
                    values: torch.Tensor, length: int, scale: float, mass: torch.Tensor | None) -> torch.Tensor:
    """One decode token through a decoder layer in one call: stream [1, d] float32 -> the new stream; the token's
    key and value are written at row `length` of keys and values ([1, kv_heads, capacity, head_dim] float32
    buffers, capacity > length) and attention reads rows 0..length; cos and sin [1, head_dim] of its position;
    mass (float32 [length + 1] or None) gains the attention each key receives, summed over heads."""
    out = torch.empty_like(stream)
    if library().q4_decode_layer(ctypes.byref(layer), stream.data_ptr(), cos.data_ptr(), sin.data_ptr(), keys.data_ptr(),
                                 values.data_ptr(), keys.stride(1), length, scale, _ptr(mass), out.data_ptr(),
                                 torch.get_num_threads()):
        raise MemoryError(f"q4_decode_layer: no memory for attention over {length + 1} tokens")
    return out


def prepare_rows(x: torch.Tensor, norm: tuple[torch.Tensor, float] | None = None, swiglu: bool = False) -> torch.Tensor:
    """x [rows, k] float32 RMS-normalized by `norm` (weight [k] float32, eps), or with `swiglu` x [rows, 2k]
    -> silu(gate) * up [rows, k]: a float decoder layer's glue in one call (q4_matmul folds the same in)."""
    x = _dense(x)
    k = x.shape[1] // 2 if swiglu else x.shape[1]
    out = torch.empty(x.shape[0], k, dtype=torch.float32)
    weight, eps = norm if norm is not None else (None, 0.0)
    library().prepare_rows(x.data_ptr(), x.shape[0], k, int(swiglu), _ptr(weight), eps, out.data_ptr(), torch.get_num_threads())
    return out


def rotate_rows(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotated: int, head_dim: int) -> None:
    """In place: the first `rotated` columns of x [rows, n] float32 (contiguous) rotated head by head, cos and sin
    [rows, head_dim] float32, as q4_matmul's `rotary` does."""
    if not x.is_contiguous() or x.dtype != torch.float32:
        raise ValueError("rotate_rows needs a contiguous float32 tensor")
    library().rotate_rows(x.data_ptr(), x.shape[0], x.shape[1], rotated, head_dim, _dense(cos).data_ptr(),
                          _dense(sin).data_ptr(), torch.get_num_threads())


def _bf16_rows(x: torch.Tensor) -> torch.Tensor:
    if x.dtype != torch.bfloat16 or not x.is_contiguous() or x.dim() != 2:
        raise ValueError(f"the bfloat16 glue reads contiguous [rows, k] bfloat16 tensors, not {x.dtype} {tuple(x.shape)}")
    return x


def bf16_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm of x [rows, k] bfloat16 with its bfloat16 weight [k], in one pass (agent/bf16_glue.c)."""
    x, weight = _bf16_rows(x), _bf16_rows(weight.reshape(1, -1))
    out = torch.empty_like(x)
    library().bf16_rms_norm(x.data_ptr(), x.shape[0], x.shape[1], weight.data_ptr(), eps, out.data_ptr(), torch.get_num_threads())
    return out


def bf16_swiglu(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of x [rows, 2k] bfloat16 (gate first) -> [rows, k], in one pass."""
    x = _bf16_rows(x)
    out = torch.empty(x.shape[0], x.shape[1] // 2, dtype=x.dtype)
    library().bf16_swiglu(x.data_ptr(), x.shape[0], out.shape[1], out.data_ptr(), torch.get_num_threads())
    return out


def bf16_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotated: int, head_dim: int) -> None:
    """In place: the first `rotated` columns of x [rows, n] bfloat16 turned head by head, cos and sin [rows,
    head_dim] (bfloat16 values, read as float32), as the module path rotates queries and keys."""
    x = _bf16_rows(x)
    library().bf16_rotate(x.data_ptr(), x.shape[0], x.shape[1], rotated, head_dim, _dense(cos).data_ptr(),
                          _dense(sin).data_ptr(), torch.get_num_threads())


def _dense(t: torch.Tensor | None) -> torch.Tensor | None:
    """float32 and contiguous, as every kernel reads its operands (no copy when it already is)."""
    return None if t is None else t.float().contiguous()


ATTEND_DIM = 64  # the head size attend_one has dense vector code for (other sizes run its scalar loops)
ATTEND_GROUP = 16  # the most query heads a KV head may serve (attention_kernels.h's MAX_GROUP)


def attend_fast() -> bool:
    """Whether `attend_one` beats SDPA here (built with AVX-512 or AVX2) for heads of ATTEND_DIM."""
    return library() is not None and bool(library().attend_fast())


def attend_one(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
               want_mass: bool) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """One query per head, query [1, heads, 1, dim] float32, over keys and values [1, kv_heads, n, dim] float32
    views of a store (tokens dense, heads `stride(1)` apart, the same for both) -> ([1, 1, heads, dim], the
    attention mass [kv_heads, n] or None). None when the views are not laid out so (the caller uses SDPA)."""
    _, heads, _, dim = query.shape
    kv_heads, length = keys.shape[1], keys.shape[2]
    if keys.stride()[2:] != (dim, 1) or values.stride() != keys.stride() or keys.dtype != torch.float32:
        return None
    query = _dense(query)
    out = torch.empty(1, 1, heads, dim, dtype=torch.float32)
    mass = torch.empty(kv_heads, length, dtype=torch.float32) if want_mass else None
    if library().attend_one(query.data_ptr(), heads, kv_heads, dim, keys.data_ptr(), values.data_ptr(), keys.stride(1),
                            length, scale, out.data_ptr(), _ptr(mass), torch.get_num_threads()):
        return None
    return out, mass
