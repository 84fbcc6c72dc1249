"""Weight-only quantized linear layers (`--weights int4` / `int8`): agreement with float32 and memory."""

import pytest
import torch

from agent.bench.bench import bench_text, tokenize, top1_agreement
from agent.model import ModelError, load_model, prepare
from tests.helpers import tiny_llama
from agent.qlinear import Int4Linear, Int8Linear, module_bytes

# Measured on agent/bench_text.txt (455 tokens): int4 99.8%, int8 97.1% (torch.ao dynamic int8 was ~48%).
FLOORS = {"int4": 0.99, "int8": 0.96}
MODULES = {"int4": Int4Linear, "int8": Int8Linear}


@pytest.fixture(scope="module", params=["int4", "int8"])
def quantized(request):
    return request.param, load_model("embedded", device="cpu", weights=request.param)


def test_top1_agreement_on_real_text(embedded, quantized):
    kind, loaded = quantized
    ids = tokenize(embedded.tokenizer, bench_text())
    agreement = top1_agreement(embedded.model, loaded.model, ids)
    assert agreement >= FLOORS[kind], f"{kind}: top-1 agreement {agreement:.3f} < {FLOORS[kind]}"


def test_quantized_layers_are_smaller(embedded, quantized):
    kind, loaded = quantized
    down_proj = loaded.model.model.layers[0].mlp.down_proj
    assert isinstance(down_proj, MODULES[kind])
    assert isinstance(loaded.model.lm_head, torch.nn.Linear)  # kept float32: bfloat16 logits flip near-ties
    float_bytes = module_bytes(embedded.model.model.layers)
    quant_bytes = module_bytes(loaded.model.model.layers)
    assert quant_bytes < float_bytes / (5 if kind == "int4" else 3)
    assert module_bytes(loaded.model) < module_bytes(embedded.model)


def test_int4_recovers_q4_1_weights_exactly(embedded):
    """The embedded weights are GGUF Q4_1: a group-32 int4 layer reproduces them up to bfloat16 scales."""
    linear = embedded.model.model.layers[3].mlp.gate_proj
    layer = Int4Linear(linear)
    eye = torch.eye(linear.in_features)
    with torch.inference_mode():
        dequantized = layer(eye).t()  # row i of the identity picks column i of the weight
    error = (dequantized - linear.weight).abs().max() / linear.weight.abs().max()
    assert error < 0.01


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_tiny_model_and_copy_semantics(kind):
    from agent.model import quantize_linear_int4, quantize_linear_int8

    model = tiny_llama()
    quantize = quantize_linear_int4 if kind == "int4" else quantize_linear_int8
    quantized = quantize(model)
    assert type(model.model.layers[0].mlp.up_proj) is torch.nn.Linear  # the original is untouched
    x = torch.randint(0, 512, (1, 12))
    with torch.inference_mode():
        want, got = model(input_ids=x).logits, quantized(input_ids=x).logits
    assert torch.allclose(want, got, atol=0.2), (want - got).abs().max()


def test_weights_mode_errors():
    with pytest.raises(ModelError, match="unknown weights mode"):
        prepare(tiny_llama(), torch.device("cpu"), weights="int3")
    with pytest.raises(ModelError, match="float32"):
        prepare(tiny_llama().to(torch.bfloat16), torch.device("cpu"), weights="int4")


def test_auto_weights_are_int4_only_where_that_is_exact_and_fast(tiny_dir):
    """`palace chat`'s default: the embedded model's Q4_1 weights in int4 on a CPU in float32 where the native
    kernel runs on integer dot products; float for any other model, dtype or device."""
    from agent.model import EMBEDDED, resolve_weights
    from cache import native

    cpu = torch.device("cpu")
    assert resolve_weights("auto", EMBEDDED, cpu, torch.float32) == ("int4" if native.q4_fast() else "float")
    assert resolve_weights("auto", EMBEDDED, cpu, torch.bfloat16) == "float"
    assert resolve_weights("auto", EMBEDDED, torch.device("cuda"), torch.float32) == "float"
    assert resolve_weights("auto", str(tiny_dir), cpu, torch.float32) == "float"
    assert resolve_weights("int8", EMBEDDED, cpu, torch.float32) == "int8"
    loaded = load_model("embedded", device="cpu", weights="auto")
    assert isinstance(loaded.model.model.layers[0].mlp.down_proj, Int4Linear) == native.q4_fast()
