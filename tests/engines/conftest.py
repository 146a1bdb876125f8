import pytest

from saorl.models.tiny import build_tiny
from saorl.models.tokenizer import load_tokenizer


@pytest.fixture(scope="session")
def tok():
    return load_tokenizer()


@pytest.fixture(scope="session")
def tiny_moe():
    return build_tiny("tiny-moe", seed=0)


PROMPTS = ["def foo(x):\n    return", "the sweet moon", "import os\nimport sys\n\nclass A:", "a"]
