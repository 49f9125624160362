"""Kimi K2.5 with its routed experts kept packed INT4, as released (kernels/int4_experts.py), through
`build_runner` (what `specgen run` uses): the experts really stay packed (`target.quantization: auto` on a
CPU; `none` dequantises them), the logits match the dequantised model within the activations' bf16
rounding, speculative output equals plain output with the same kept weights for each draft Kimi
pairs with (greedy and seeded, eager and compiled), and the memory estimate counts the kept bytes.
A dense DeepSeek-V3 quantized on load (int4: its experts into the same layout; int8) keeps its MTP
output. The unpacking and the kernels against independent references are test_int4_experts.py's; the
tensor-parallel cut of the packed weights, test_tensor_parallel.py's."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from checkpoints_deepseek import (
    tiny_kimi_config,
    tiny_mla_eagle3_config,
    write_kimi_checkpoint,
    write_mla_eagle3_checkpoint,
)
from checkpoints_dflash import tiny_dflash_config, write_dflash_checkpoint
from test_oracle_drafts import oracle_runner
from test_speculative import prompts, references_of, run, runner_for

from specgen.job import estimate_bytes, resolve
from specgen.models.moe import RoutedExperts
from specgen.recipe import recipe_from_dict


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    root = tmp_path_factory.mktemp("kimi-int4")
    config = tiny_kimi_config(int4=True, vocab_size=96)
    text = config["text_config"]
    target = write_kimi_checkpoint(root / "kimi", config)
    drafts = {"eagle3": write_mla_eagle3_checkpoint(root / "eagle3", tiny_mla_eagle3_config(text), text),
              "dflash": write_dflash_checkpoint(root / "dflash", tiny_dflash_config(text, target_layer_ids=[0, 2],
                                                                                     block_size=4))}
    return target, drafts


def recipe(target, method="none", draft=None, quantization="auto", batch=4, dtype="float32", **sampling):
    d = {"method": method}
    if method != "none":
        d.update(num_speculative_tokens=3, model=str(draft))
    return recipe_from_dict({
        "target": {"model": str(target), "dtype": dtype, "quantization": quantization}, "draft": d,
        "sampling": {"max_tokens": 24, "ignore_eos": True, "seed": 7, **sampling},
        "runtime": {"device": "cpu", "batch_size": batch, "max_seq_len": 80, "compile": False},
        "chat_template": False,
    })


def experts_of(runner) -> list[RoutedExperts]:
    return [m for m in runner.unified.target.modules() if isinstance(m, RoutedExperts)]


def test_auto_keeps_the_experts_packed_and_none_dequantises_them(kimi):
    target, _ = kimi
    kept = runner_for(recipe(target))
    assert all(e.int4_group == 32 and e.gate_up_proj_packed.dtype == torch.uint8 for e in experts_of(kept))
    assert "routed experts INT4 as published" in kept.header
    dense = runner_for(recipe(target, quantization="none"))
    assert all(e.int4_group is None and e.gate_up_proj.dtype == torch.float32 for e in experts_of(dense))


def test_kept_logits_match_the_dequantised_model_within_the_activations_rounding(kimi):
    """Kept and dequantised hold the same real weights (test_int4_experts.py); what differs is that the
    kept product takes its activations in bf16. That costs far less than running the whole model in
    bf16 does."""
    from model_calls import logits

    target, _ = kimi
    ids = torch.tensor(prompts()[0][:8]).unsqueeze(0)
    positions = torch.arange(ids.shape[1]).unsqueeze(0)

    def first_logits(quantization, dtype):
        model = runner_for(recipe(target, quantization=quantization, dtype=dtype)).unified.target
        cache = model.new_cache(1, 32, getattr(torch, dtype), "cpu")
        with torch.no_grad():
            return logits(model, ids, positions, cache, 32)[0].float()

    kept, dequantised = first_logits("auto", "float32"), first_logits("none", "float32")
    bf16_run = first_logits("none", "bfloat16")
    assert not torch.equal(kept, dequantised)            # the kept path really ran
    kept_error = (kept - dequantised).abs().max().item()
    assert kept_error <= 1e-2 * dequantised.abs().max().item()
    assert kept_error < 0.2 * (bf16_run - dequantised).abs().max().item()


def spec_and_plain(kimi, method, sampling, compile=False):
    """Plain output, and the output of `method`'s real draft (its cache, the target features it reads)
    whose picks are plain decoding's tokens spoiled at chosen positions (test_oracle_drafts.py), so
    blocks of every acceptance length are verified against the kept experts."""
    target, drafts = kimi
    batch = 2 if compile else 4
    ids = prompts(lengths=(3, 11, 6, 17)) if compile else prompts()
    plain, _ = run(runner_for(recipe(target, batch=batch, **sampling)), ids)
    real = runner_for(recipe(target, method, drafts[method], batch=batch, **sampling))
    spec, totals = run(oracle_runner(real, references_of(ids, plain), compile), ids)
    histogram = totals.spec.acceptance_histogram
    assert histogram[0] > 0 and histogram[3] > 0, histogram
    return spec, plain


@pytest.mark.parametrize("method", ["eagle3", "dflash"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_speculative_equals_plain_with_the_experts_kept(kimi, method, sampled):
    spec, plain = spec_and_plain(kimi, method, {"temperature": 0.8, "top_p": 0.9} if sampled else {})
    assert spec == plain


def test_compiled_speculative_equals_plain_with_the_experts_kept(kimi):
    spec, plain = spec_and_plain(kimi, "dflash", {}, compile=True)
    assert spec == plain


def test_the_memory_estimate_counts_the_kept_bytes(kimi):
    target, _ = kimi
    base = recipe(target, dtype="bfloat16")
    model = runner_for(base).unified.target
    held = sum(t.numel() * t.element_size() for t in {id(t): t for t in model.parameters()}.values())
    estimate = estimate_bytes(base, resolve(base))["target weights"]
    dense = replace(base, target=replace(base.target, quantization="none"))
    assert abs(estimate - held) <= 0.02 * held, (estimate, held)
    assert estimate < estimate_bytes(dense, resolve(dense))["target weights"]


# ------------------------------------------------------------------ a dense MoE target quantized on load


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    from checkpoints_deepseek import tiny_deepseek_config, write_deepseek_checkpoint

    # every projection in whole 32-groups and 16-row packs (q_lora_rank 32, a 16-wide rope part):
    # what real shapes have, so every product but kv_b_proj is kept and the estimate can be held to it
    config = tiny_deepseek_config(vocab_size=96, q_lora_rank=32, qk_rope_head_dim=16)
    return write_deepseek_checkpoint(tmp_path_factory.mktemp("ds") / "deepseek", config)


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_a_dense_deepseek_target_quantized_on_load_keeps_its_mtp_output(deepseek, kind):
    """`target.quantization: int4 / int8` on a bf16 DeepSeek-V3 checkpoint: the layers' products
    quantized (MLA's kv_b_proj, read as a matrix, stays dense), the routed experts in the published
    INT4 layout under int4 (dense under int8), the head and the embedding kept; its MTP layer's
    output, with oracle picks through every acceptance length, equals its own plain output."""
    from specgen.models.quantized import QuantizedEmbedding, QuantizedLinear

    ids = prompts()
    plain_runner = runner_for(recipe(deepseek, quantization=kind))
    model = plain_runner.unified.target
    experts = experts_of(plain_runner)
    assert all((e.int4_group == 32) == (kind == "int4") for e in experts)
    attention = model.model.layers[0].self_attn
    assert isinstance(attention.q_b_proj, QuantizedLinear) and not isinstance(attention.kv_b_proj, QuantizedLinear)
    assert isinstance(model.lm_head, QuantizedLinear) and isinstance(model.model.embed_tokens, QuantizedEmbedding)
    assert f"{kind} weights" in plain_runner.header
    plain, _ = run(plain_runner, ids)
    dense, _ = run(runner_for(recipe(deepseek, quantization="none")), ids)
    assert plain != dense
    real = runner_for(recipe_from_dict({
        "target": {"model": str(deepseek), "dtype": "float32", "quantization": kind},
        "draft": {"method": "mtp", "num_speculative_tokens": 2},
        "sampling": {"max_tokens": 24, "ignore_eos": True, "seed": 7},
        "runtime": {"device": "cpu", "batch_size": 4, "max_seq_len": 80, "compile": False},
        "chat_template": False}))
    spec, totals = run(oracle_runner(real, references_of(ids, plain), False), ids)
    assert spec == plain
    assert totals.spec.acceptance_histogram[0] > 0 and totals.spec.acceptance_histogram[2] > 0
    estimate = estimate_bytes(recipe(deepseek, quantization=kind), resolve(recipe(deepseek, quantization=kind)))
    held = sum(m.quantized.nbytes() for m in model.modules() if isinstance(m, QuantizedLinear))
    held += model.model.embed_tokens.nbytes() + sum(
        t.numel() * t.element_size() for t in {id(t): t for t in model.parameters()}.values())
    # within 10%: the estimate counts the few weights that stay dense (kv_b_proj, the router) as kept
    assert abs(estimate["target weights"] - held) <= 0.1 * held, (estimate["target weights"], held)
