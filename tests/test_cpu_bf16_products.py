"""Eager bf16 products in float32 on CPUs without native bf16 (kernels/cpu_bf16_products.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from test_speculative import make_recipe, models, prompts, run, runner_for  # noqa: F401  (fixture)

import specgen.kernels.cpu_bf16_products as products
import specgen.pipelines.compiled as compiled
from specgen.kernels.cpu_bf16_products import MIN_ROWS, float32_products


def _bf16(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


def _float64_rounded(result: torch.Tensor) -> torch.Tensor:
    return result.to(torch.float64).bfloat16()


@pytest.mark.parametrize("rows", [MIN_ROWS, 3 * MIN_ROWS])
def test_many_row_products_are_the_exact_products_summed_in_float32_and_rounded_once(rows):
    x, w, b = _bf16(2, rows // 2, 96, seed=1), _bf16(40, 96, seed=2), _bf16(40, seed=3)
    a3, b3 = _bf16(3, rows, 96, seed=4), _bf16(3, 96, 24, seed=5)
    with torch.inference_mode(), float32_products():
        got = {"linear": F.linear(x, w, b), "mm": x[0] @ w.T if rows // 2 >= MIN_ROWS else None,
               "addmm": torch.addmm(b, x.flatten(0, 1), w.T), "bmm": torch.bmm(a3, b3)}
    want = {"linear": F.linear(x.float(), w.float(), b.float()).bfloat16(),
            "mm": (x[0].float() @ w.T.float()).bfloat16(),
            "addmm": torch.addmm(b.float(), x.flatten(0, 1).float(), w.T.float()).bfloat16(),
            "bmm": torch.bmm(a3.float(), b3.float()).bfloat16()}
    reference = {"linear": F.linear(x.double(), w.double(), b.double()),
                 "bmm": torch.bmm(a3.double(), b3.double())}
    for name, value in got.items():
        if value is None:
            continue
        assert value.dtype == torch.bfloat16, name
        assert torch.equal(value, want[name]), name
        if name in reference:       # float32 sums: within one bf16 rounding of the float64 result
            exact = _float64_rounded(reference[name]).float()
            assert (value.float() - exact).abs().le(exact.abs() * 2 ** -7 + 1e-6).all(), name


def test_few_rows_and_float32_products_are_left_as_they_are():
    few, w = _bf16(MIN_ROWS - 1, 64, seed=6), _bf16(32, 64, seed=7)
    many32, w32 = _bf16(4 * MIN_ROWS, 64, seed=8).float(), w.float()
    with torch.inference_mode(), float32_products():
        got = (F.linear(few, w), F.linear(many32, w32), torch.bmm(few[None], w.T[None]))
    with torch.inference_mode():
        want = (F.linear(few, w), F.linear(many32, w32), torch.bmm(few[None], w.T[None]))
    for g, e in zip(got, want):
        assert g.dtype == e.dtype and torch.equal(g, e)


@pytest.mark.parametrize("native, dtype, draft_dtype, expected", [
    (False, "bfloat16", "bfloat16", True), (False, "float32", "bfloat16", False), (True, "bfloat16", "bfloat16", False)])
def test_an_eager_bf16_prefill_multiplies_in_float32_where_the_cpu_lacks_bf16(  # noqa: F811
        models, monkeypatch, native, dtype, draft_dtype, expected):
    """A runner turns the mode on for its (eager, CPU) prefill where its target's weights are bf16
    and the CPU has no bf16 products (not for a bf16 draft alone: the mode's per-op cost would fall on
    the float32 target's prefill); there the prefill's products run in float32, and speculative
    greedy decoding still gives plain decoding's tokens (both take the same prefill)."""
    target, draft = models
    monkeypatch.setattr(compiled, "cpu_has_bf16", lambda: native)
    converted = []
    worth = products._worth_converting
    monkeypatch.setattr(products, "_worth_converting",
                        lambda *args: converted.append(worth(*args)) or converted[-1])

    def in_dtype(recipe):
        recipe = dataclasses.replace(recipe, target=dataclasses.replace(recipe.target, dtype=dtype))
        if recipe.draft.method == "none":
            return recipe
        return dataclasses.replace(recipe, draft=dataclasses.replace(recipe.draft, dtype=draft_dtype))

    ids = prompts()
    plain_runner = runner_for(in_dtype(make_recipe(target, batch=4)))
    spec_runner = runner_for(in_dtype(make_recipe(target, draft, k=3, batch=4)))
    assert plain_runner.functions._prefill_in_float32 is expected
    assert spec_runner.functions._prefill_in_float32 is expected
    plain, _ = run(plain_runner, ids)
    assert any(converted) is expected
    converted.clear()
    spec, totals = run(spec_runner, ids)
    assert any(converted) is expected
    assert totals.steps > 0 and spec == plain
