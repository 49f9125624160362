"""Weights kept quantized (models/quantized.py): the codes against an independent NumPy quantizer, the
products against the dense weights they stand for, each row's bits whatever shares its product, and
speculative decoding on a quantized target equal to plain decoding on the same quantized weights."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from test_speculative import make_recipe, models, prompts, run  # noqa: F401 (a fixture)

from specgen.job import build_runner, resolve
from specgen.job.errors import InputError
from specgen.models.quantized import QuantizedLinear, int4_codes, quantize_int4, quantize_int8
from specgen.recipe import recipe_from_dict


def numpy_int4(w: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric group-wise int4 as the format defines it, written apart from specgen's: per group of
    `group` input columns, scale = max |w| / 7, value = clip(rint(w / scale), -8, 7), code = value + 8."""
    n, k = w.shape
    g = w.astype(np.float32).reshape(n, k // group, group)
    scale = np.abs(g).max(axis=-1) / np.float32(7)
    safe = np.where(scale > 0, scale, 1).astype(np.float32)
    values = np.clip(np.rint(g / safe[..., None]), -8, 7)
    return (values + 8).astype(np.int32).reshape(n, k), scale


def bf16(a: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.ascontiguousarray(a)).to(torch.bfloat16).float().numpy()


@pytest.mark.parametrize(("n", "k", "group"), [(64, 128, 32), (96, 64, 32), (48, 256, 64)])
def test_int4_codes_and_weights_are_the_formats(n, k, group):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n + k)) * 0.05
    w[0, :group] = 0                                             # an all-zero group: codes 8, value 0
    codes, scales = int4_codes(w, group)
    ref_codes, ref_scales = numpy_int4(w.numpy(), group)
    assert np.array_equal(codes.numpy(), ref_codes)
    np.testing.assert_allclose(scales.numpy(), ref_scales, rtol=1e-7)
    # the dense weights the packed product multiplies by: (code - 8) x the bf16 scale, exactly
    dense = quantize_int4(w, group, symmetric=True).dequantized().numpy()
    expected = (ref_codes - 8).reshape(n, k // group, group) * bf16(ref_scales)[..., None]
    assert np.array_equal(dense, expected.reshape(n, k).astype(np.float32))


def numpy_affine_int4(w: np.ndarray, group: int) -> np.ndarray:
    """Affine group-wise int4 written apart from specgen's: per group, scale = bf16((max - min) / 15),
    zero = bf16(min + 8 scale), code = clip(rint((w - zero) / scale) + 8, 0, 15); the weights it keeps."""
    n, k = w.shape
    g = w.astype(np.float32).reshape(n, k // group, group)
    low, high = g.min(axis=-1), g.max(axis=-1)
    scale = bf16((high - low) / np.float32(15))
    zero = bf16(low + 8 * scale)
    safe = np.where(scale > 0, scale, 1).astype(np.float32)
    codes = np.clip(np.rint((g - zero[..., None]) / safe[..., None]) + 8, 0, 15)
    return ((codes - 8) * scale[..., None] + zero[..., None]).reshape(n, k).astype(np.float32)


@pytest.mark.parametrize(("n", "k", "group"), [(64, 128, 32), (48, 256, 64)])
def test_affine_int4_keeps_the_formats_weights_and_lands_on_a_4_bit_grid_exactly(n, k, group):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(7)) * 0.05
    kept = quantize_int4(w, group).dequantized().numpy()
    np.testing.assert_allclose(kept, numpy_affine_int4(w.numpy(), group), rtol=0, atol=1e-7)
    # weights already on a group's 16-level grid (as a Q4_1 GGUF's are) come back as they were
    grid = (torch.randint(0, 16, (n, k)) - 8).float() * 0.015625 + 0.25
    grid.view(n, k // group, group)[..., 0] = -8 * 0.015625 + 0.25      # each group spans all 16 levels
    grid.view(n, k // group, group)[..., 1] = 7 * 0.015625 + 0.25
    assert torch.equal(quantize_int4(grid, group).dequantized(), grid)


def test_int8_codes_and_weights_are_the_formats():
    w = torch.randn(40, 96, generator=torch.Generator().manual_seed(1))
    q = quantize_int8(w)
    scale = bf16(np.abs(w.numpy()).max(axis=1) / np.float32(127))
    codes = np.clip(np.rint(w.numpy() / scale[:, None]), -127, 127).astype(np.int8)
    assert np.array_equal(q.codes.numpy(), codes)
    assert np.array_equal(q.dequantized().numpy(), codes.astype(np.float32) * scale[:, None])


@pytest.mark.parametrize("kind", ["int4", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_product_is_the_dense_product_of_the_kept_weights(kind, dtype):
    w = torch.randn(80, 128, generator=torch.Generator().manual_seed(2)) * 0.1
    q = quantize_int4(w) if kind == "int4" else quantize_int8(w)
    x = torch.randn(5, 3, 128, generator=torch.Generator().manual_seed(3)).to(dtype)
    # the activations go in as bf16 (torch's kernels' fast path), the sums are float32's
    expected = x.to(torch.bfloat16).float() @ q.dequantized().t()
    out = QuantizedLinear(q)(x)
    assert out.shape == (5, 3, 80) and out.dtype == dtype
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("kind", ["int4", "int8"])
@pytest.mark.parametrize("threads", [1, 2])
def test_each_row_gets_the_same_bits_alone_and_beside_others(kind, threads):
    """What makes speculative decoding exact on a quantized target: a token verified beside k drafts
    (and other slots) is computed as plain decoding computes it alone."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        w = torch.randn(576, 576, generator=torch.Generator().manual_seed(4)) * 0.05
        q = quantize_int4(w) if kind == "int4" else quantize_int8(w)
        x = torch.randn(40, 576, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
        alone = torch.cat([q.matmul(x[i:i + 1]) for i in range(40)])
        for m in (2, 4, 5, 16, 40):
            assert torch.equal(q.matmul(x[:m]), alone[:m]), m
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("kind", ["int4", "int8"])
@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "top_p": 0.9}], ids=["greedy", "seeded"])
def test_speculative_output_on_a_quantized_target_equals_plain_output_on_it(models, kind, sampling):  # noqa: F811
    target, draft = models
    ids = prompts()

    def quantized(recipe):
        return replace(recipe, target=replace(recipe.target, quantization=kind, dtype="bfloat16"))

    plain_recipe = quantized(make_recipe(target, **sampling))
    plain, _ = run(build_runner(plain_recipe, resolve(plain_recipe), 7)[0], ids)
    dense_recipe = replace(plain_recipe, target=replace(plain_recipe.target, quantization="none"))
    dense, _ = run(build_runner(dense_recipe, resolve(dense_recipe), 7)[0], ids)
    spec_recipe = quantized(make_recipe(target, draft, k=3, **sampling))
    runner = build_runner(spec_recipe, resolve(spec_recipe), 7)[0]
    assert isinstance(runner.unified.target.lm_head, QuantizedLinear) and f"{kind} weights" in runner.header
    spec, totals = run(runner, ids)
    assert spec == plain and totals.spec.num_drafts > 0
    assert dense != plain            # the quantized target is a model of its own (the test is not vacuous)


def test_compiled_speculative_steps_on_a_quantized_target_equal_compiled_plain_steps(models):  # noqa: F811
    """Compiled (Inductor calls the same weight-only kernels inside the step's graph): spec == plain."""
    target, draft = models
    ids = prompts()[:3]

    def quantized(recipe):
        return replace(recipe, target=replace(recipe.target, quantization="int4", dtype="bfloat16"))

    plain_recipe = quantized(make_recipe(target, batch=2, compile=True))
    plain, _ = run(build_runner(plain_recipe, resolve(plain_recipe), 7)[0], ids, max_tokens=12)
    spec_recipe = quantized(make_recipe(target, draft, k=2, batch=2, compile=True))
    runner = build_runner(spec_recipe, resolve(spec_recipe), 7)[0]
    assert runner.compiled
    spec, totals = run(runner, ids, max_tokens=12)
    assert spec == plain and totals.spec.num_drafts > 0


def test_what_quantization_cannot_run_on_yet_is_a_clear_error(models):  # noqa: F811
    target, _ = models
    base = {"target": {"model": str(target), "quantization": "int4"}, "chat_template": False,
            "runtime": {"device": "cpu", "tensor_parallel_size": 2}}
    with pytest.raises(InputError, match="target.quantization: int4: not yet with runtime.tensor_parallel_size"):
        resolve(recipe_from_dict(base))


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_the_memory_estimate_counts_the_kept_bytes(models, kind):  # noqa: F811
    """job/memory.py's "target weights" for a quantized target: what the loaded model holds (codes
    and scales, the 8-bit embedding; no dense head beside an EAGLE-3 draft), within 2%, and less than
    the dense model's."""
    from specgen.job import estimate_bytes

    target, _ = models
    recipe = replace(make_recipe(target), target=replace(make_recipe(target).target, quantization=kind,
                                                         dtype="bfloat16"))
    runner = build_runner(recipe, resolve(recipe), 7)[0]
    model = runner.unified.target
    held = sum(m.quantized.nbytes() for m in model.modules() if isinstance(m, QuantizedLinear))
    held += model.model.embed_tokens.nbytes()                   # 8-bit codes, a scale and offset per 32
    assert model.lm_head.dense is None                          # EAGLE-3 has a head of its own
    held += sum(t.numel() * t.element_size() for t in {id(t): t for t in model.parameters()}.values())
    estimate = estimate_bytes(recipe, resolve(recipe))["target weights"]
    dense = estimate_bytes(replace(recipe, target=replace(recipe.target, quantization="none")),
                           resolve(recipe))["target weights"]
    assert abs(estimate - held) <= 0.02 * held, (estimate, held)
    assert estimate < dense


def test_suffix_drafts_on_a_quantized_target_keep_its_plain_output(models, tmp_path):  # noqa: F811
    """The host-side draft (a suffix index over earlier answers, drafts/suffix.py) verified by an int4
    target: its plain answers as the history, so most drafts are accepted, and every output is plain
    decoding's on the same weights."""
    import json

    from specgen.recipe import recipe_from_dict

    target, _ = models
    ids = prompts()

    def recipe(draft):
        return recipe_from_dict({
            "target": {"model": str(target), "dtype": "bfloat16", "quantization": "int4"}, "draft": draft,
            "sampling": {"max_tokens": 24, "ignore_eos": True, "seed": 7},
            "runtime": {"device": "cpu", "batch_size": 4, "max_seq_len": 96, "compile": False},
            "chat_template": False})

    plain_recipe = recipe({"method": "none"})
    plain, _ = run(build_runner(plain_recipe, resolve(plain_recipe), 7)[0], ids)
    history = tmp_path / "history.jsonl"
    history.write_text("".join(json.dumps({"id": k, "token_ids": v}) + "\n" for k, v in plain.items()))
    spec_recipe = recipe({"method": "suffix", "num_speculative_tokens": 3, "suffix_history": str(history)})
    spec, totals = run(build_runner(spec_recipe, resolve(spec_recipe), 7)[0], ids)
    assert spec == plain
    assert totals.spec.num_accepted_tokens > 0.5 * totals.spec.num_draft_tokens > 0
