import pytest

from saorl.models.tokenizer import load_tokenizer


@pytest.fixture(scope="session")
def tok():
    return load_tokenizer()
