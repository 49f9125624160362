"""The `llamacpp` baseline: llama.cpp (through llama-cpp-python, the optional extra `specgen[llamacpp]`)
decoding the same GGUF file, prompts and token budget greedily, in its own process.

What it runs: the GGUF the target was converted from (a target that is not a GGUF has no such
baseline), the prompts as the token ids specgen tokenized them to (llama.cpp reads the same vocabulary
from the same file), greedy (`temp 0`), one prompt at a time (llama.cpp's own decode is batch 1; a
bench batch size > 1 runs its prompts one after another), the KV cache cleared before each prompt (no
prefix reuse between prompts, which specgen does not do either), the same thread count. Tokens are
counted as specgen counts them: up to and including the first EOS, or `max_tokens`.

If the child dies (llama.cpp's batched prompt evaluation crashed in one VM with AMX: GGML's AMX path),
`LlamaCppProcess` starts it again evaluating prompts one token at a time (`n_batch 1`) and says so
(`fallback`); if that dies too, bench reports the configuration as failed and measures the rest.

Why a process of its own: as for `hf` (bench/hf.py), a user runs llama.cpp in a fresh process, and a
crash in its native code must not take the bench with it.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from specgen.bench.child import ChildDied, JsonChild

PROMPT_BATCH = 512              # llama.cpp's default n_batch: prompt tokens evaluated per call


def available() -> bool:
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


class LlamaCppGenerate:
    def __init__(self, gguf: Path, threads: int, context: int, n_batch: int, eos: list[int]) -> None:
        from llama_cpp import Llama

        self.model = Llama(model_path=str(gguf), n_ctx=context, n_threads=threads, n_threads_batch=threads,
                           n_batch=n_batch, verbose=False)
        self.eos = set(eos)

    def generate(self, prompts: list[list[int]], max_tokens: int) -> tuple[int, float]:
        """(output tokens, seconds) for all prompts, one after another."""
        produced, start = 0, time.perf_counter()
        for prompt in prompts:
            self.model.reset()                      # no prefix reuse from the previous prompt
            n = 0
            for token in self.model.generate(prompt, temp=0.0, top_k=1, reset=False):
                n += 1
                if token in self.eos or n >= max_tokens:
                    break
            produced += n
        return produced, time.perf_counter() - start


class LlamaCppProcess:
    """`LlamaCppGenerate` in a child process, with bench's runner interface (`generate`, `compiled`,
    `close`). `fallback` names what it fell back to, if anything. `CHILD`: the module the child runs
    (`main` below; tests put a stand-in there)."""

    CHILD = "specgen.bench.llamacpp"

    def __init__(self, gguf: Path, threads: int, context: int, eos: list[int]) -> None:
        self.compiled = False
        self.fallback: str | None = None
        self.args = [str(gguf), str(threads), str(context), json.dumps(eos)]
        self._start(PROMPT_BATCH)

    def _start(self, n_batch: int) -> None:
        self.child = JsonChild([sys.executable, "-m", self.CHILD, *self.args, str(n_batch)], "llama.cpp baseline")
        self.child.ask({"ready": True})

    def generate(self, prompts: list[list[int]], batch: int, max_tokens: int) -> tuple[int, float]:
        request = {"prompts": prompts, "max_tokens": max_tokens}
        try:
            reply = self.child.ask(request)
        except ChildDied as err:
            if self.fallback is not None:
                raise ChildDied(f"{err}; after it had fallen back to {self.fallback}") from None
            # batched prompt evaluation is what crashed where llama.cpp crashed here: once more,
            # a token at a time
            self.child.close()
            self.fallback = f"prompts evaluated one token at a time ({err})"
            self._start(1)
            reply = self.child.ask(request)
        return reply["tokens"], reply["seconds"]

    def close(self) -> None:
        self.child.close()


def main(argv: list[str]) -> None:
    """The child: load the GGUF, then answer one JSON request per stdin line."""
    gguf, threads, context, eos, n_batch = argv
    model = LlamaCppGenerate(Path(gguf), int(threads), int(context), int(n_batch), json.loads(eos))
    for line in sys.stdin:
        request = json.loads(line)
        if request.get("ready"):
            reply = {"ready": True}
        else:
            tokens, seconds = model.generate(request["prompts"], request["max_tokens"])
            reply = {"tokens": tokens, "seconds": seconds}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1:])
