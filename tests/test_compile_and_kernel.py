"""The step compiled with torch.compile gives the same tokens as eager, and the Triton verify kernel
(run by the interpreter on CPU) gives the same tokens as the PyTorch reference inside the pipeline."""

from __future__ import annotations

import functools

import pytest
from test_speculative import make_recipe, models, prompts, run, runner_for  # noqa: F401  (fixture)

import specgen.pipelines.unified as unified


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "top_p": 0.9}], ids=["greedy", "sampled"])
def test_compiled_step_equals_eager(models, sampling):  # noqa: F811
    target, draft = models
    ids = prompts(lengths=(3, 11, 6))
    eager, eager_totals = run(runner_for(make_recipe(target, draft, k=2, batch=2, **sampling)), ids, max_tokens=12)
    compiled_runner = runner_for(make_recipe(target, draft, k=2, batch=2, compile=True, **sampling))
    assert compiled_runner.compiled
    compiled, compiled_totals = run(compiled_runner, ids, max_tokens=12)
    assert compiled == eager
    assert compiled_totals.spec.acceptance_histogram == eager_totals.spec.acceptance_histogram


def test_triton_kernel_inside_the_pipeline_equals_reference(models, monkeypatch):  # noqa: F811
    target, draft = models
    ids = prompts(lengths=(4, 9))
    recipe = make_recipe(target, draft, k=2, batch=2, stochastic=True, temperature=0.9, top_k=20)
    reference, _ = run(runner_for(recipe), ids, max_tokens=6)
    monkeypatch.setattr(unified, "verify", functools.partial(unified.verify, force_kernel=True))
    kernel, totals = run(runner_for(recipe), ids, max_tokens=6)
    assert kernel == reference and totals.spec.num_drafts > 0
