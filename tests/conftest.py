"""Shared fixtures: a tiny random GQA Llama (fast) and the real embedded model (loaded once)."""

import pytest
import torch

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tiny():
    from tests.helpers import tiny_llama

    return tiny_llama(seed=0, layers=2)


@pytest.fixture(scope="session")
def embedded():
    from agent.model import load_model

    return load_model("embedded", device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A tiny random Llama with the embedded tokenizer, saved as a local model directory."""
    from tests.helpers import tiny_model_dir

    return tiny_model_dir(tmp_path_factory.mktemp("tiny-model"))
