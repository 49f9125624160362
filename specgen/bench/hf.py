"""The `hf` baseline: transformers' `generate` on the same weights, prompts and stopping rule.

Greedy, batches of `batch` prompts left-padded (what a user of `generate` writes), the default
dynamic cache, eager. Tokens counted per row up to and including its first EOS (or `max_tokens`),
as specgen counts them; rows that finished early still ride along in their batch: that is the cost
of static batching, and part of what the baseline measures.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from specgen.pipelines.stops import eos_ids_from


class HFGenerate:
    def __init__(self, folder: Path, device: torch.device, dtype: torch.dtype, sampling, tokenizer) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
        self.device = device
        config = json.loads((folder / "config.json").read_text())
        generation = {}
        if (folder / "generation_config.json").is_file():
            generation = json.loads((folder / "generation_config.json").read_text())
        self.eos = sorted(eos_ids_from(tokenizer, generation, config)) if not sampling.ignore_eos else []
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
