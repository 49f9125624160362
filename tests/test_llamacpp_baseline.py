"""bench's `llamacpp` baseline (bench/llamacpp.py): its process protocol, the fallback when llama.cpp
dies (prompts evaluated a token at a time), a clean failure when that dies too, and, where
llama-cpp-python is installed (never in CI: it builds from source), a real greedy run on the embedded
GGUF."""

from __future__ import annotations

from pathlib import Path

import pytest

from specgen.bench import llamacpp

TESTS = Path(__file__).parent


@pytest.fixture
def fake_child(monkeypatch):
    monkeypatch.setattr(llamacpp.LlamaCppProcess, "CHILD", "fake_llamacpp_child")
    monkeypatch.setenv("PYTHONPATH", str(TESTS))

    def start(mode: str) -> llamacpp.LlamaCppProcess:
        monkeypatch.setenv("FAKE_LLAMACPP", mode)
        return llamacpp.LlamaCppProcess(Path("model.gguf"), 2, 256, [2])
    return start


def test_tokens_and_seconds_come_back_from_the_child(fake_child):
    process = fake_child("")
    assert process.generate([[1, 2, 3], [4, 5]], 1, 8) == (16, 0.5)
    assert process.fallback is None
    process.close()


def test_a_dying_llamacpp_is_run_again_with_prompts_a_token_at_a_time(fake_child):
    process = fake_child("die-batched")
    assert process.generate([[1, 2, 3]], 1, 8) == (8, 0.5)
    assert process.fallback.startswith("prompts evaluated one token at a time")
    assert "GGML_ASSERT failed (n_batch 512)" in process.fallback      # what it died of, said
    process.close()


def test_when_the_fallback_dies_too_the_error_says_so(fake_child):
    process = fake_child("die")
    with pytest.raises(RuntimeError, match=r"llama.cpp baseline process died .*n_batch 1"):
        process.generate([[1, 2, 3]], 1, 8)


@pytest.mark.skipif(not llamacpp.available(), reason="llama-cpp-python is not installed (the llamacpp extra)")
def test_llamacpp_decodes_the_embedded_gguf_to_the_token_budget():
    from specgen.checkpoints.store import MODEL_ALIASES

    gguf = MODEL_ALIASES["smollm2-135m-instruct"].locate()
    process = llamacpp.LlamaCppProcess(gguf, 2, 256, [])     # no EOS: every prompt runs to the budget
    tokens, seconds = process.generate([[1, 504, 3458, 314], [1, 2683, 253]], 1, 12)
    process.close()
    assert tokens == 24 and seconds > 0
