"""Replay a finished greedy run's answers through the suffix proposer: what suffix drafting could gain.

    python benchmarks/suffix_replay.py RESULTS.jsonl PROMPTS [--recipe R] [--ks 2,3,4,7]

RESULTS.jsonl is the output of a greedy `specgen run` (its `token_ids`), PROMPTS the prompts it ran
(the same `--prompts` value). For each K, every answer is replayed in order as a job at one slot
would see it (the job-wide index fed by the answers before it): each step proposes up to K tokens
and keeps the prefix that matches the answer, plus one token. Prints tokens per step (the most
suffix drafting can commit per target forward at that K, every proposal verified), the share of
steps with a proposal, the acceptance length over those, and the proposer's time per call. No model
runs: seconds for a few thousand tokens.
"""

from __future__ import annotations

import argparse
import json
import time

from specgen.checkpoints.loading import target_config
from specgen.checkpoints.tokenizer import load_tokenizer
from specgen.data import read_prompts
from specgen.drafts.suffix import SuffixProposer
from specgen.job import resolve
from specgen.job.run import job_requests
from specgen.recipe import load_recipe


def replay(answers: list[tuple[list[int], list[int]]], k: int) -> dict:
    proposer = SuffixProposer(1)
    steps = tokens = drafted = accepted = calls = 0
    seconds = 0.0
    for prompt, answer in answers:
        proposer.admit(0, prompt)
        proposer.extend(0, answer[:1])          # the prefill's token
        i = 1
        while i < len(answer):
            start = time.perf_counter()
            proposal = proposer.propose(0, k)
            seconds += time.perf_counter() - start
            calls += 1
            a = 0
            while a < len(proposal) and i + a < len(answer) and proposal.tokens[a] == answer[i + a]:
                a += 1
            n = min(a + 1, len(answer) - i)
            proposer.extend(0, answer[i:i + n])
            i += n
            steps += 1
            tokens += n
            drafted += len(proposal) > 0
            accepted += a
        proposer.finish(0)
    return {"k": k, "tokens_per_step": tokens / max(steps, 1), "drafted_steps": drafted / max(steps, 1),
            "acceptance_length": 1 + accepted / max(drafted, 1), "us_per_proposal": 1e6 * seconds / max(calls, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results")
    parser.add_argument("prompts")
    parser.add_argument("--recipe", default="recipes/smollm2-ar.yaml", help="the run's recipe (its tokenizer)")
    parser.add_argument("--ks", default="2,3,4,7")
    args = parser.parse_args()
    recipe = load_recipe(args.recipe)
    resolved = resolve(recipe)
    tokenizer = load_tokenizer(resolved.target_folder, target_config(resolved.target_config).vocab_size)
    requests = {r.id: r for r in job_requests(list(read_prompts(args.prompts)), tokenizer, recipe)}
    with open(args.results, encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    answers = [(requests[r["id"]].prompt_ids, r["token_ids"]) for r in records
               if r["id"] in requests and r["token_ids"]]
    for k in (int(k) for k in args.ks.split(",")):
        figures = replay(answers, k)
        print(f"K={k}: {figures['tokens_per_step']:.2f} tokens a step, {figures['drafted_steps']:.0%} of steps "
              f"with a proposal, acceptance length {figures['acceptance_length']:.2f} there, "
              f"{figures['us_per_proposal']:.0f} us a proposal")


if __name__ == "__main__":
    main()
