"""Every real draft method, beside each target family, through the accept path: lossless when it accepts.

Random drafts accept almost nothing, so an equality test fed by them never commits a drafted token,
never absorbs a long accepted run into the draft's cache, never rolls a draft back after a partial
accept. Here each real draft (EAGLE-3 beside Llama and DeepSeek-V3, the MLA EAGLE-3 and DFlash beside
Kimi K2.5, MTP beside DeepSeek-V3) runs every pass as in a job (its cache, the ring of target
features, the catch-ups), but its `pick` returns the tokens plain decoding emits, made wrong at
chosen positions (0, 2, 3 mod 13: runs of one and of nine right tokens), so blocks of every
acceptance length 0..K occur. The output must still be plain decoding's, eager and compiled, greedy
and seeded sampled (argmax drafts: sample-and-match, where any proposal is lossless).
"""

from __future__ import annotations

import pytest
import torch
from test_deepseek_pairings import recipe, write_pairings
from test_speculative import (  # noqa: F401 (models: a fixture)
    make_recipe,
    models,
    prompts,
    references_of,
    run,
    runner_for,
    spoiled,
    store_references,
)

from specgen.pipelines.runner import Runner
from specgen.pipelines.unified import UnifiedStep

VOCAB = 96


class OracleCache:
    """The wrapped draft's own cache, and each slot's reference continuation (slot = dim 0 of both)."""

    def __init__(self, inner, table: torch.Tensor) -> None:
        self.inner, self.table = inner, table

    def tensors(self):
        return [*self.inner.tensors(), self.table]

    def narrow(self, slots):
        return OracleCache(self.inner.narrow(slots), self.table[:slots])


class OracleProposals(torch.nn.Module):
    """A real draft whose every pass runs, with its picks replaced by the reference continuation."""

    def __init__(self, draft, references: dict[tuple, list[int]], vocab: int = VOCAB) -> None:
        super().__init__()
        self.draft = draft                 # a submodule: its parameters give the step the draft's dtype
        self.references = references       # prompt[1:] -> prompt + plain output
        self.vocab = vocab                 # a spoiled token is the right one + 1, modulo this
        self.num_speculative_tokens = draft.num_speculative_tokens
        self.aux_layer_ids = draft.aux_layer_ids

    def new_cache(self, slots, max_len, dtype, device):
        table = torch.zeros(slots, max_len + 64, dtype=torch.long, device=device)
        return OracleCache(self.draft.new_cache(slots, max_len, dtype, device), table)

    def propose(self, aux, next_tokens, positions, last_index, cache, attn, pick, k=None):
        table = cache.table
        if attn.rows is not None:          # prefill (eager)
            store_references(table, self.references, next_tokens, last_index, attn.rows)
        rows = torch.arange(next_tokens.shape[0], device=next_tokens.device)

        def oracle(logits, where):
            # logits [B, V] (the draft's own, unused); where [B]: the drafted token's position
            return spoiled(table[rows, where], where, self.vocab), None

        return self.draft.propose(aux, next_tokens, positions, last_index, cache.inner, attn, oracle, k)


@pytest.fixture(scope="module")
def pairings(tmp_path_factory, models):
    pairs = write_pairings(tmp_path_factory.mktemp("oracle"), VOCAB)
    target, draft = models
    pairs["llama-eagle3"] = (target, "eagle3", draft, 3)
    return pairs


def recipe_for(pairings, name, with_draft=True, **settings):
    target, method, draft, k = pairings[name]
    if name == "llama-eagle3":
        return make_recipe(target, draft if with_draft else None, k=k, **settings)
    if not with_draft:
        return recipe(target, **settings)
    return recipe(target, method, draft, k, **settings)


def oracle_runner(real: Runner, references, compile: bool, use_kernel: bool = False) -> Runner:
    step = UnifiedStep(real.unified.target, OracleProposals(real.unified.draft, references),
                       use_kernel=use_kernel)
    return Runner(step, batch_size=real.batch_size, max_seq_len=real.max_seq_len, rules=real.rules,
                  sampling=real.sampling, seed=real.seed, device=real.device, dtype=torch.float32,
                  compile=compile)


NAMES = ("llama-eagle3", "deepseek-eagle3", "kimi-eagle3-mla", "kimi-dflash", "deepseek-mtp")
# compiled: one pairing per method (a CPU compile takes about a minute each): EAGLE-3's chain beside
# GQA attention, DFlash's block over an MLA target, MTP's chain through MLA + MoE
COMPILED = ("llama-eagle3", "kimi-dflash", "deepseek-mtp")
CASES = [(name, sampled, False) for name in NAMES for sampled in (False, True)] + \
        [(name, False, True) for name in COMPILED]


@pytest.mark.parametrize(("name", "sampled", "compile"), CASES,
                         ids=[f"{n}-{'sampled' if s else 'greedy'}{'-compiled' if c else ''}" for n, s, c in CASES])
def test_a_real_draft_that_proposes_the_targets_tokens_keeps_the_plain_output(pairings, name, sampled, compile):
    sampling = {"temperature": 0.8, "top_p": 0.9} if sampled else {}
    batch = 2 if compile else 4                       # compiled: fewer slots, a smaller graph to build
    ids = prompts(lengths=(3, 11, 6, 17)) if compile else prompts()
    plain, _ = run(runner_for(recipe_for(pairings, name, with_draft=False, batch=batch, **sampling)), ids)
    references = references_of(ids, plain)
    real = runner_for(recipe_for(pairings, name, batch=batch, **sampling))
    runner = oracle_runner(real, references, compile)
    assert runner.compiled == compile
    got, totals = run(runner, ids)
    assert got == plain
    k = pairings[name][3]
    histogram = totals.spec.acceptance_histogram
    # the accept path was taken at every length: rejected at once, and every draft of a step accepted
    assert histogram[0] > 0 and histogram[k] > 0, histogram
    assert totals.spec.mean_acceptance_length > 1.5, histogram


@pytest.mark.parametrize("name", ["llama-eagle3", "kimi-dflash"])
def test_the_attention_kernel_path_keeps_the_plain_output(pairings, name):
    """The step CUDA runs: the Triton attention kernels (interpreted here) over the whole allocation,
    GQA for Llama and the EAGLE-3 layer, the latent kernel for Kimi's MLA, DFlash's block through the
    cache's scratch; greedy, every acceptance length."""
    from kernel_device import KERNEL_DEVICE

    if KERNEL_DEVICE.type == "cuda":
        pytest.skip("test_gpu.py runs the kernel path on the GPU itself")
    ids = prompts(lengths=(3, 11, 6, 17))
    plain, _ = run(runner_for(recipe_for(pairings, name, with_draft=False, batch=2)), ids)
    real = runner_for(recipe_for(pairings, name, batch=2))
    runner = oracle_runner(real, references_of(ids, plain), compile=False, use_kernel=True)
    assert runner.kv_bucket(0) == runner.alloc_len       # the kernel path's bound: the whole allocation
    got, totals = run(runner, ids)
    assert got == plain
    k = pairings[name][3]
    assert totals.spec.acceptance_histogram[0] > 0 and totals.spec.acceptance_histogram[k] > 0
