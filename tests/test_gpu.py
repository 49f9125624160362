"""GPU checks (skipped without CUDA): bf16 on cuda, the step captured as a CUDA graph, Triton verify."""

from __future__ import annotations

import pytest
import torch
from test_speculative import models, prompts, run, runner_for  # noqa: F401  (fixture)

from specgen.recipe import recipe_from_dict

pytestmark = pytest.mark.gpu


def cuda_recipe(target, draft=None, compile=False, **sampling):
    return recipe_from_dict({
        "target": {"model": str(target), "dtype": "float32"},
        "draft": {"method": "eagle3", "model": str(draft), "num_speculative_tokens": 3} if draft
        else {"method": "none"},
        "sampling": {"max_tokens": 24, "ignore_eos": True, "seed": 7, **sampling},
        "runtime": {"device": "cuda", "batch_size": 4, "max_seq_len": 96, "compile": compile},
        "chat_template": False,
    })


def test_greedy_speculative_equals_plain_on_cuda(models):  # noqa: F811
    target, draft = models
    ids = prompts()
    plain, _ = run(runner_for(cuda_recipe(target)), ids)
    spec, _ = run(runner_for(cuda_recipe(target, draft)), ids)
    assert spec == plain


def test_seeded_sampled_speculative_equals_plain_on_cuda_with_the_kernel(models):  # noqa: F811
    target, draft = models
    ids = prompts()
    plain, _ = run(runner_for(cuda_recipe(target, temperature=0.8, top_p=0.9)), ids)
    spec, _ = run(runner_for(cuda_recipe(target, draft, temperature=0.8, top_p=0.9)), ids)
    assert spec == plain


def test_cuda_graph_step_equals_eager(models):  # noqa: F811
    target, draft = models
    ids = prompts()
    eager, _ = run(runner_for(cuda_recipe(target, draft)), ids)
    graphed, _ = run(runner_for(cuda_recipe(target, draft, compile=True)), ids)
    assert graphed == eager
    assert torch.cuda.is_available()
