"""Block-FP8 weights kept as FP8 (`target.fp8_weights: keep`): every weight and scale lands in the
layer that multiplies it (exact against the dequantised model once activations are not rounded to
FP8), the model takes a byte a weight, the memory estimate and inspect say so, and speculative
decoding on the kept weights is lossless. On CPU the layers run the PyTorch reference of
kernels/block_fp8.py; the kernels themselves are tested in test_block_fp8_kernel.py."""

from __future__ import annotations

import pytest
import torch
from checkpoints_deepseek import tiny_deepseek_config, write_deepseek_checkpoint
from model_calls import logits
from test_speculative import prompts, run, runner_for

from specgen.checkpoints.loading import load_target
from specgen.checkpoints.store import CheckpointError, read_config
from specgen.kernels import block_fp8 as bf
from specgen.models.fp8_layers import BlockFP8Linear
from specgen.recipe import recipe_from_dict


@pytest.fixture(scope="module")
def fp8_target(tmp_path_factory):
    return write_deepseek_checkpoint(tmp_path_factory.mktemp("fp8") / "deepseek", tiny_deepseek_config(fp8=True))


def forward(model):
    tokens = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(0))
    cache = model.new_cache(2, 16, torch.float32, "cpu")
    return logits(model, tokens, torch.arange(8).repeat(2, 1), cache, 16)[0]


def load(folder, keep: bool):
    return load_target(read_config(folder), folder, dtype=torch.float32, device="cpu", dummy=False, keep_fp8=keep)


def test_kept_weights_sit_in_fp8_layers_and_give_the_dequantised_logits(fp8_target, monkeypatch):
    kept, whole = load(fp8_target, True), load(fp8_target, False)
    attn, moe = kept.model.layers[1].self_attn, kept.model.layers[1].mlp
    assert isinstance(attn.q_b_proj, BlockFP8Linear) and attn.q_b_proj.weight.dtype == bf.FP8
    assert moe.experts.gate_up_proj.dtype == bf.FP8 and moe.experts.fp8_block == 16
    assert isinstance(moe.shared_experts.gate_up_proj, BlockFP8Linear)
    assert isinstance(kept.model.layers[0].mlp.down_proj, BlockFP8Linear)          # the dense layer
    assert attn.kv_b_proj.weight.dtype == torch.float32     # absorbed into the queries: dequantised
    size = lambda m: sum(p.numel() * p.element_size() for p in m.parameters())  # noqa: E731
    assert size(kept) < 0.5 * size(whole)
    # FP8 activations apart (DeepSeek's own inference rounds them too), the product is the same one
    monkeypatch.setattr(bf, "quantize_activations",
                        lambda x, group=bf.BLOCK: (x.float(), torch.ones(x.shape[0], -(-x.shape[1] // group))))
    torch.testing.assert_close(forward(kept), forward(whole), rtol=1e-5, atol=1e-5)


def test_with_fp8_activations_the_logits_move_but_stay_close(fp8_target):
    kept, whole = forward(load(fp8_target, True)), forward(load(fp8_target, False))
    assert not torch.equal(kept, whole)
    assert (kept - whole).norm() / whole.norm() < 0.25        # 3 tiny sharp layers of e4m3 rounding


def fp8_recipe(target, keep: str, method="none", **sampling):
    draft = {"method": method, **({"num_speculative_tokens": 2} if method != "none" else {})}
    return recipe_from_dict({
        "target": {"model": str(target), "dtype": "float32", "fp8_weights": keep}, "draft": draft,
        "sampling": {"max_tokens": 16, "ignore_eos": True, "seed": 7, **sampling},
        "runtime": {"device": "cpu", "batch_size": 3, "max_seq_len": 64, "compile": False},
        "chat_template": False})


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8}], ids=["greedy", "seeded-sampled"])
def test_mtp_on_kept_fp8_weights_is_lossless(fp8_target, sampling):
    ids = prompts()
    plain, _ = run(runner_for(fp8_recipe(fp8_target, "keep", **sampling)), ids, max_tokens=16)
    spec, totals = run(runner_for(fp8_recipe(fp8_target, "keep", "mtp", **sampling)), ids, max_tokens=16)
    assert spec == plain and totals.spec.num_drafts > 0
    dequantized, _ = run(runner_for(fp8_recipe(fp8_target, "dequantize", **sampling)), ids, max_tokens=16)
    assert dequantized != plain          # the recipe field reaches the loader


def test_the_memory_estimate_and_inspect_count_a_byte_a_kept_weight(fp8_target):
    from specgen.inspection.report import inspect_checkpoint
    from specgen.job import estimate_bytes, resolve

    kept, whole = (estimate_bytes(recipe, resolve(recipe))["target weights"]
                   for recipe in (fp8_recipe(fp8_target, "keep"), fp8_recipe(fp8_target, "dequantize")))
    assert kept < 0.5 * whole
    report = inspect_checkpoint(str(fp8_target))
    assert report.memory["fp8_weights_bytes"] < 0.7 * report.memory["weights_bytes"]


def test_an_fp8_weight_whose_rows_straddle_a_block_is_not_fused(tmp_path):
    # gate and up of 40 rows each in 16-row blocks: fused, a block would mix the two
    folder = write_deepseek_checkpoint(tmp_path / "odd", tiny_deepseek_config(fp8=True, intermediate_size=40))
    with pytest.raises(CheckpointError, match="40 rows do not fill 16-row FP8 blocks"):
        load(folder, True)
    assert load(folder, False) is not None                          # dequantised, it loads as before


def test_loading_kept_fp8_weights_runs_the_scaled_mm_probe_before_any_step(fp8_target, monkeypatch):
    """GPU_NOTES 6: the probe copies to the host and syncs, which a CUDA graph capture (the first
    compiled step) cannot hold; `load_target` runs it for the device, and a probe asked for the first
    time during a capture is refused, not run."""
    probed = []
    monkeypatch.setattr(bf, "scaled_mm_works", lambda device: probed.append(device) or False)
    load(fp8_target, True)
    assert probed == [torch.device("cpu")]
    load(fp8_target, False)
    assert len(probed) == 1                       # nothing kept as FP8: nothing to probe
    monkeypatch.undo()
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="before a CUDA graph capture"):
        bf.scaled_mm_works(torch.device("cuda", 7))


def test_the_probe_at_load_and_the_step_share_one_key_per_gpu(monkeypatch):
    """`load_target` probes `torch.device("cuda")`, a step asks for its tensors' `cuda:0`: one probe."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.nn.functional, "ScalingType", None, raising=False)
    monkeypatch.delattr(torch.nn.functional, "ScalingType")       # no blockwise scaled_mm: probe says no
    monkeypatch.setattr(bf, "_SCALED_MM_WORKS", {})
    assert bf.scaled_mm_works(torch.device("cuda")) is False
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert bf.scaled_mm_works(torch.device("cuda", 0)) is False      # cached: no probe inside a capture
    assert list(bf._SCALED_MM_WORKS) == ["cuda:0"]
