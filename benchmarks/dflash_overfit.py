"""Can the DFlash trainer fit a handful of sequences? A bug check, not a training run.

A DFlash draft trained on a few of the target's own answers, every step on the same sequences, must
learn them: its top-1 agreement at block position 1 on those very sequences has to pass 90%. Far
below that, and not rising, something between the target's features, the block mask, the labels
and the mask token is wrong, and no amount of data will help. The script also compares settings
side by side (mask token, feature layers, anchors per sequence), each from the same seed, on the same sequences: how fast each fits, which says nothing
yet about held-out acceptance (that needs `train-draft` on real data).

    python benchmarks/dflash_overfit.py [--sequences 8] [--steps 150] [--anchors 64]
        [--settings default mask=49151,features=2 anchors=32] [--answer-tokens 128] [--lr 3e-3]

Each setting prints the loss and the per-position agreement every `--every` steps, and a last line
`setting: position-1 agreement X% after N steps (PASS/FAIL at 90%)`. The answers come from
specgen's distillation cache (generated on first use, as `train-draft` does).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

import torch

from specgen.checkpoints.loading import load_target
from specgen.checkpoints.tokenizer import load_tokenizer
from specgen.job import resolve
from specgen.recipe import load_recipe
from specgen.training.distill import DistillSpec, answer_token_counts, distilled_responses, training_sequences
from specgen.training.evaluate import heldout_agreement
from specgen.training.features import padded_batch, target_features
from specgen.training.methods import TRAINERS, mask_candidates

RECIPE = "recipes/smollm2-dflash.yaml"


def parse_setting(text: str) -> dict:
    """'default' or 'mask=16,features=5,anchors=256' -> TrainSpec fields."""
    names = {"mask": "mask_token_id", "features": "feature_layers", "anchors": "anchors"}
    fields = {}
    if text != "default":
        for part in text.split(","):
            key, value = part.split("=")
            fields[names[key]] = int(value)
    return fields


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--anchors", type=int, default=64, help="blocks per sequence per step")
    parser.add_argument("--answer-tokens", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--every", type=int, default=25)
    parser.add_argument("--settings", nargs="+", default=["default"])
    args = parser.parse_args()

    recipe = load_recipe(RECIPE, ["runtime.compile=false"])
    r = resolve(replace(recipe, draft=replace(recipe.draft, method="none")))
    target = load_target(r.target_config, r.target_folder, dtype=torch.float32, device=r.device, dummy=False)
    target.requires_grad_(False)
    tokenizer = load_tokenizer(r.target_folder, target.vocab_size)
    spec = replace(recipe.train, anchors=args.anchors, answer_tokens=args.answer_tokens)
    data = DistillSpec(target=recipe.target.model, num_prompts=args.sequences, split="train",
                       max_new_tokens=args.answer_tokens, max_prompt_chars=spec.max_prompt_chars,
                       batch_size=args.sequences, chat_template=recipe.chat_template, dtype="float32",
                       device=recipe.runtime.device)
    results = distilled_responses(data)
    sequences = training_sequences(results, results.parent / "prompts.jsonl", tokenizer, recipe.chat_template,
                                   spec.max_seq_len)[: args.sequences]
    counts = answer_token_counts(sequences, target.vocab_size)
    unused = mask_candidates(tokenizer, target.vocab_size, [ids for ids, _ in sequences])
    answer = sum(len(ids) - prompt for ids, prompt in sequences)
    print(f"{len(sequences)} sequences, {answer} answer tokens; mask candidates {list(unused[:3])}", flush=True)
    tokens, scored = padded_batch(sequences)
    trainer = TRAINERS["dflash"]
    for text in args.settings:
        setting = replace(spec, **parse_setting(text))
        torch.manual_seed(0)
        config, extra = trainer.new_config(target.shape, setting, counts, unused)
        draft = trainer.build(config, extra, target, setting.block_size - 1)
        aux = target_features(target, tokens, draft.aux_layer_ids)        # the same sequences every step
        optimizer = torch.optim.AdamW(draft.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
        print(f"== {text}: {config['dflash_config']}", flush=True)
        start, agreement = time.perf_counter(), []
        for step in range(1, args.steps + 1):
            generator = torch.Generator().manual_seed(step)
            loss, _, _ = trainer.loss(draft, aux, tokens, scored, setting, generator)
            loss_value = float(loss.detach())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
            optimizer.step()
            if step % args.every == 0 or step == args.steps:
                draft.eval()
                agreement = heldout_agreement(draft, target, trainer, sequences, setting, autocast=None,
                                              batch_size=len(sequences))
                draft.train()
                shown = " ".join(f"{a:.2f}" for a in agreement)
                print(f"  step {step:4d} loss {loss_value:.3f}  agreement by position {shown}  "
                      f"({time.perf_counter() - start:.0f} s)", flush=True)
        verdict = "PASS" if agreement[0] > 0.9 else "FAIL"
        print(f"{text}: position-1 agreement {agreement[0]:.1%} after {args.steps} steps ({verdict} at 90%)",
              flush=True)


if __name__ == "__main__":
    main()
