"""The `hf` baseline: transformers' `generate` on the same weights, prompts and stopping rule, in its
own process.

Greedy, batches of `batch` prompts left-padded (what a user of `generate` writes), the default
dynamic cache, eager. Tokens counted per row up to and including its first EOS (or `max_tokens`),
as specgen counts them; rows that finished early still ride along in their batch: that is the cost
of static batching, and part of what the baseline measures.

In the dtype its users would pick: on a CPU transformers' bf16 path can be slower than its float32
one (an Intel Xeon: ar / hf at one slot was 2.65x against bf16 and 1.36-1.45x with both in float32),
so there the child times its warm-up prompts in float32 and in bf16 and keeps the faster
(`HFProcess.choose_dtype`); the report names the dtype it ran in. On CUDA it runs the run's dtype.

Why a process of its own: a user runs transformers in a fresh Python, not in one that has compiled
and frozen specgen's steps and holds their caches. Measured in the same process after specgen's
configurations, `generate` ran at 14.1 tok/s where a fresh process gave 28.5-30.9 (SmolLM2, batch 1,
2 threads), which made specgen look twice as fast against it as it is. `HFProcess` runs the
baseline in a child process (`python -m specgen.bench.hf`) that loads the model once and runs each
request it is sent, so bench still interleaves it with the other configurations; it gets the same
thread count (the parent waits while it runs). `HFProcess.about()` reports what the child holds (its
pid, threads and the specgen modules it loaded: not the models or compiled steps), which is how the
tests check all this without timing anything: a timed test fails whenever the machine is busy.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

from specgen.bench.child import JsonChild
from specgen.pipelines.stops import eos_ids_from


def process_facts() -> dict:
    """This process's pid, torch threads and the specgen modules it has loaded (the child: only what
    this module and the tokenizer need, none of the models or compiled steps)."""
    loaded = sorted(name for name in sys.modules if name == "specgen" or name.startswith("specgen."))
    return {"pid": os.getpid(), "threads": torch.get_num_threads(), "specgen_modules": loaded}


class HFGenerate:
    def __init__(self, folder: Path, device: torch.device, dtype: torch.dtype, ignore_eos: bool,
                 tokenizer) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
        self.device = device
        config = json.loads((folder / "config.json").read_text())
        generation = {}
        if (folder / "generation_config.json").is_file():
            generation = json.loads((folder / "generation_config.json").read_text())
        self.eos = sorted(eos_ids_from(tokenizer, generation, config)) if not ignore_eos else []
        self.pad = self.model.generation_config.pad_token_id or 0
        self.compiled = False

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], batch: int, max_tokens: int) -> tuple[int, float]:
        """(output tokens, seconds) for all prompts in batches of `batch`."""
        produced, start = 0, time.perf_counter()
        for i in range(0, len(prompts), batch):
            chunk = prompts[i: i + batch]
            width = max(len(p) for p in chunk)
            ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in chunk], device=self.device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=self.device)
            out = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens,
                                      do_sample=False, pad_token_id=self.pad,
                                      eos_token_id=self.eos or None,
                                      min_new_tokens=0 if self.eos else max_tokens)
            for row in out[:, width:].tolist():
                produced += next((j + 1 for j, t in enumerate(row) if t in self.eos), len(row))
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return produced, time.perf_counter() - start

    def close(self) -> None:
        del self.model


class HFProcess:
    """`HFGenerate` in a child process: same interface (`generate`, `compiled`, `close`)."""

    def __init__(self, folder: Path, device: torch.device, dtype: torch.dtype, ignore_eos: bool,
                 threads: int) -> None:
        self.compiled = False
        self.child = JsonChild([sys.executable, "-m", "specgen.bench.hf", str(folder), str(device),
                                str(dtype).removeprefix("torch."), str(int(ignore_eos)), str(threads)],
                               "transformers baseline")
        self._ask({"ready": True})

    def _ask(self, request: dict) -> dict:
        return self.child.ask(request)

    def about(self) -> dict:
        """The child's `process_facts()`."""
        return self._ask({"about": True})

    def generate(self, prompts: list[list[int]], batch: int, max_tokens: int) -> tuple[int, float]:
        reply = self._ask({"prompts": prompts, "batch": batch, "max_tokens": max_tokens})
        return reply["tokens"], reply["seconds"]

    def choose_dtype(self, prompts: list[list[int]], batch: int, max_tokens: int) -> tuple[str, dict[str, float]]:
        """Time `prompts` in float32 and in bf16 (each run twice, the second timed) and keep the faster
        model; returns (its dtype, tokens/s of each)."""
        reply = self._ask({"choose_dtype": True, "prompts": prompts, "batch": batch, "max_tokens": max_tokens})
        return reply["dtype"], reply["tokens_per_second"]

    def close(self) -> None:
        self.child.close()


def main(argv: list[str]) -> None:
    """The child: load the model, then answer one JSON request per stdin line."""
    folder, device, dtype, ignore_eos, threads = argv
    torch.set_num_threads(int(threads))
    from specgen.checkpoints.tokenizer import load_tokenizer

    config = json.loads((Path(folder) / "config.json").read_text())
    tokenizer = load_tokenizer(Path(folder), config.get("vocab_size"))
    model = HFGenerate(Path(folder), torch.device(device), getattr(torch, dtype), ignore_eos == "1", tokenizer)
    for line in sys.stdin:
        request = json.loads(line)
        if request.get("ready"):
            reply = {"ready": True}
        elif request.get("choose_dtype"):
            speeds = {}
            for name in ("float32", "bfloat16"):
                if name != dtype:
                    model.close()          # one model in memory at a time
                    model = HFGenerate(Path(folder), torch.device(device), getattr(torch, name),
                                       ignore_eos == "1", tokenizer)
                model.generate(request["prompts"], request["batch"], request["max_tokens"])    # warm
                tokens, seconds = model.generate(request["prompts"], request["batch"], request["max_tokens"])
                speeds[name], dtype = tokens / seconds, name
            best = max(speeds, key=speeds.get)
            if best != dtype:
                model.close()
                model = HFGenerate(Path(folder), torch.device(device), getattr(torch, best), ignore_eos == "1",
                                   tokenizer)
                dtype = best
            reply = {"dtype": best, "tokens_per_second": speeds}
        elif request.get("about"):
            reply = process_facts()
        else:
            tokens, seconds = model.generate(request["prompts"], request["batch"], request["max_tokens"])
            reply = {"tokens": tokens, "seconds": seconds}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1:])
