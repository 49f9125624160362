"""A stand-in for bench/llamacpp.py's child (tests/test_llamacpp_baseline.py): the same argv and
JSON protocol; with FAKE_LLAMACPP=die-batched it dies (as llama.cpp's batched prompt evaluation did
in one VM) unless prompts are evaluated a token at a time (n_batch 1); with FAKE_LLAMACPP=die it
always dies at the first request. Each prompt "generates" max_tokens tokens."""

import json
import os
import sys


def main() -> None:
    gguf, threads, context, eos, n_batch = sys.argv[1:]
    mode = os.environ.get("FAKE_LLAMACPP", "")
    for line in sys.stdin:
        request = json.loads(line)
        if request.get("ready"):
            reply = {"ready": True}
        elif mode == "die" or (mode == "die-batched" and n_batch != "1"):
            sys.stderr.write(f"GGML_ASSERT failed (n_batch {n_batch})\n")
            os.abort()
        else:
            reply = {"tokens": len(request["prompts"]) * request["max_tokens"], "seconds": 0.5, "n_batch": n_batch}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
