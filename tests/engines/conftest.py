import math

import pytest
import torch

from saorl.models.tiny import build_tiny
from saorl.models.tokenizer import load_tokenizer


@pytest.fixture(scope="session")
def tok():
    return load_tokenizer()


@pytest.fixture(scope="session")
def tiny_moe():
    return build_tiny("tiny-moe", seed=0)


PROMPTS = ["def foo(x):\n    return", "the sweet moon", "import os\nimport sys\n\nclass A:", "a"]


def naive(logits, temperature, top_k, top_p):
    """Reference log-probs over the vocabulary, one row in a Python loop (HF / vLLM order): tempered
    softmax; keep the top k; renormalise; keep the smallest prefix (by descending probability)
    whose mass reaches top_p; renormalise. Tokens outside the kept set get -inf."""
    probs = torch.softmax(logits.double() / temperature, -1).tolist()
    order = sorted(range(len(probs)), key=lambda i: -probs[i])[: top_k or None]
    total = sum(probs[i] for i in order)
    kept, mass = [], 0.0
    for i in order:
        if mass >= top_p:
            break
        kept.append(i)
        mass += probs[i] / total
    z = sum(probs[i] for i in kept)
    return [math.log(probs[i] / z) if i in kept else -math.inf for i in range(len(probs))]
