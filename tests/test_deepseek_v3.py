"""DeepSeek-V3 and Kimi K2.5 targets: our logits == transformers' on the same tiny weights.

Checked for MLA with and without q_lora_rank, yarn on and off, several routing settings, block-FP8
weights (dequantised on load), and Kimi K2.5's wrapper layout; over the expanded (long chunk) and the
absorbed (few queries per row) attention paths, in one prefill and token by token through the cache.
"""

from __future__ import annotations

import math

import pytest
import torch
from checkpoints import load_fp32_target
from checkpoints_deepseek import (
    hf_reference,
    pack_int4,
    quantize_fp8,
    tiny_deepseek_config,
    tiny_kimi_config,
    write_deepseek_checkpoint,
    write_kimi_checkpoint,
    write_tiktoken_tokenizer,
)
from model_calls import logits as our_logits

from specgen.checkpoints.quantized import dequantize_fp8_block, dequantize_int4_packed
from specgen.checkpoints.store import CheckpointError
from specgen.models.mla import ABSORB_MAX_QUERIES

def rms(x, weight, eps=1e-6):
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


SEQ = 24   # > ABSORB_MAX_QUERIES: the prefill takes the expanded path, decode steps the absorbed one

CONFIGS = {
    "yarn+q_lora+groups": {},
    "no-yarn": {"yarn": False},
    "no-q_lora": {"q_lora": False},
    "one-group, no renorm": {"n_group": 1, "topk_group": 1, "norm_topk_prob": False, "routed_scaling_factor": 1.0},
    "all-moe, 2 of 8 experts": {"first_k_dense_replace": 0, "num_experts_per_tok": 2, "n_group": 2,
                                "topk_group": 1, "rope_interleave": False},
}


def tokens(n=SEQ, batch=2, vocab=96, seed=5):
    return torch.randint(3, vocab, (batch, n), generator=torch.Generator().manual_seed(seed))


def check_against_transformers(folder):
    ours, ref = load_fp32_target(folder), hf_reference(folder)
    ids = tokens()
    with torch.no_grad():
        expected = ref(ids).logits
        positions = torch.arange(SEQ).expand(2, SEQ)
        cache = ours.new_cache(2, 64, torch.float32, "cpu")
        prefill, _ = our_logits(ours, ids, positions, cache, SEQ)
        torch.testing.assert_close(prefill, expected, atol=2e-4, rtol=1e-4)
        # the same sequence again, the first 8 tokens at once, then one token per call (absorbed)
        cache = ours.new_cache(2, 64, torch.float32, "cpu")
        first, _ = our_logits(ours, ids[:, :8], positions[:, :8], cache, 8)
        steps = [first] + [our_logits(ours, ids[:, t:t + 1], positions[:, t:t + 1], cache, t + 1)[0]
                           for t in range(8, SEQ)]
        torch.testing.assert_close(torch.cat(steps, 1), expected, atol=2e-4, rtol=1e-4)
    return ours


@pytest.mark.parametrize("changes", CONFIGS.values(), ids=CONFIGS.keys())
def test_logits_equal_transformers(tmp_path, changes):
    config = tiny_deepseek_config(**changes)
    check_against_transformers(write_deepseek_checkpoint(tmp_path / "ds", config))
    assert SEQ > ABSORB_MAX_QUERIES


def test_fp8_checkpoint_is_dequantised_on_load(tmp_path):
    folder = write_deepseek_checkpoint(tmp_path / "fp8", tiny_deepseek_config(fp8=True))
    ours = check_against_transformers(folder)
    # the FP8 rounding is really there: our weights are the dequantised ones, not the originals
    reference = write_deepseek_checkpoint(tmp_path / "bf", tiny_deepseek_config())
    a = ours.model.layers[0].self_attn.kv_b_proj.weight
    b = load_fp32_target(reference).model.layers[0].self_attn.kv_b_proj.weight
    assert 0 < (a - b).abs().max() < 0.05


def test_fp8_block_dequantisation_matches_a_blockwise_loop():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(40, 72, generator=gen)       # not a multiple of the block: ragged edge blocks
    q, scale_inv = quantize_fp8(weight, [16, 32])
    assert scale_inv.shape == (3, 3)
    got = dequantize_fp8_block(q, scale_inv, (16, 32))
    expected = torch.empty(40, 72)
    for i in range(40):
        for j in range(72):
            expected[i, j] = q[i, j].float() * scale_inv[i // 16, j // 32]
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert (got - weight).abs().max() < 0.1 * weight.abs().max()       # e4m3 keeps ~2 significant digits
    with pytest.raises(ValueError, match="does not tile"):
        dequantize_fp8_block(q, scale_inv[:2], (16, 32))


def test_kimi_k25_wrapper_loads_the_text_model(tmp_path):
    config = tiny_kimi_config()
    folder = write_kimi_checkpoint(tmp_path / "kimi", config)
    ours = check_against_transformers(folder)
    assert ours.config.moe.n_group == 1 and ours.config.num_nextn_predict_layers == 0


def test_kimi_int4_experts_are_dequantised_on_load(tmp_path):
    """Kimi K2.5's release format: routed experts in compressed-tensors packed INT4 (groups of 32)."""
    folder = write_kimi_checkpoint(tmp_path / "kimi", tiny_kimi_config(int4=True))
    ours = check_against_transformers(folder)
    plain = load_fp32_target(write_kimi_checkpoint(tmp_path / "bf", tiny_kimi_config()))
    a, b = ours.model.layers[1].mlp.experts.down_proj, plain.model.layers[1].mlp.experts.down_proj
    assert 0 < (a - b).abs().max() < 0.05      # the INT4 rounding is really there, and small


def test_int4_unpacking_matches_the_format_elementwise():
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(6, 64, generator=gen)
    parts = pack_int4(weight, 32)
    got = dequantize_int4_packed(parts["weight_packed"], parts["weight_scale"], parts["weight_shape"])
    scale = parts["weight_scale"].float()
    for i in range(6):
        for j in range(64):
            word = int(parts["weight_packed"][i, j // 8]) & 0xFFFFFFFF
            stored = (word >> (4 * (j % 8))) & 0xF
            assert got[i, j] == (stored - 8) * scale[i, j // 32]
    assert (got - weight).abs().max() <= 0.5 * scale.max() + 1e-6     # round to nearest
    with pytest.raises(ValueError, match="does not hold"):
        dequantize_int4_packed(parts["weight_packed"][:, :4], parts["weight_scale"], parts["weight_shape"])


def test_int4_dequantisation_equals_compressed_tensors_on_the_same_bytes():
    """The format's own library (compressed-tensors, which wrote Kimi K2.5's release) packs random
    INT4 values and dequantises them; ours reads its bytes to the same numbers (the format's groups
    tile the inputs: compressed-tensors refuses a partial group)."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    gen = torch.Generator().manual_seed(2)
    rows, cols, group = 5, 96, 32
    values = torch.randint(-8, 8, (rows, cols), generator=gen, dtype=torch.int8)
    scale = (torch.rand(rows, -(-cols // group), generator=gen) + 0.05).to(torch.bfloat16)
    packed = pack_to_int32(values, 4)
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group)
    theirs = dequantize(unpack_from_int32(packed, 4, torch.Size([rows, cols])), scale.float(), None, args,
                        dtype=torch.float32)
    ours = dequantize_int4_packed(packed, scale, (rows, cols), group)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    assert torch.equal(ours, values.float() * scale.float().repeat_interleave(group, 1)[:, :cols])


def test_fp8_dequantisation_equals_transformers_on_the_same_bytes():
    """transformers' fine-grained FP8 integration (what loads DeepSeek-V3's release with
    `dequantize=True`) on the same e4m3 bytes and block scales, ragged edge blocks included."""
    fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")
    if not hasattr(fp8, "_dequantize_fp8_weight"):
        pytest.skip("this transformers has no _dequantize_fp8_weight")
    gen = torch.Generator().manual_seed(4)
    weight = torch.randn(40, 72, generator=gen)
    q, scale_inv = quantize_fp8(weight, [16, 32])
    theirs = fp8._dequantize_fp8_weight(q, scale_inv, [16, 32], torch.float32)
    torch.testing.assert_close(dequantize_fp8_block(q, scale_inv, (16, 32)), theirs, rtol=0, atol=0)


def test_kimi_accepts_both_spellings(tmp_path):
    config = tiny_kimi_config(model_type="deepseek_v3")
    text = config["text_config"]
    scaling = text.pop("rope_scaling")
    text["rope_parameters"] = {"rope_type": "yarn", "rope_theta": text.pop("rope_theta"),
                               **{k: v for k, v in scaling.items() if k != "type"}}
    config["dtype"] = config.pop("torch_dtype")
    folder = write_kimi_checkpoint(tmp_path / "kimi", config)
    check_against_transformers(folder)


def test_latent_cache_is_what_mla_promises(tmp_path):
    """The cache holds kv_lora_rank + rope dims per token and layer, not per-head K/V; for the real
    DeepSeek-V3 config that is 70,272 bytes per token in bf16 against 4,000,000+ for full K/V."""
    from specgen.checkpoints.loading import target_config
    from checkpoints import reference_config

    cfg = target_config(reference_config("deepseek-ai__DeepSeek-V3.config.json"))
    assert cfg.cache_bytes_per_token(torch.bfloat16) == 61 * (512 + 64) * 2 == 70_272
    assert cfg.full_kv_bytes_per_token(torch.bfloat16) == 61 * 128 * (192 + 128) * 2
    small = load_fp32_target(write_deepseek_checkpoint(tmp_path / "ds", tiny_deepseek_config()))
    cache = small.new_cache(3, 32, torch.float32, "cpu")
    assert [tuple(t.shape) for t in cache.tensors()] == [(3, 1, 32, 32 + 8)] * 3
    assert math.isclose(cfg.mla.softmax_scale(), (192 ** -0.5) * (0.1 * math.log(40) + 1) ** 2)


def test_unsupported_quantisation_and_routing_are_named(tmp_path):
    from specgen.checkpoints.loading import load_target

    config = tiny_deepseek_config()
    config["quantization_config"] = {"quant_method": "compressed-tensors"}
    folder = write_deepseek_checkpoint(tmp_path / "q", tiny_deepseek_config())
    with pytest.raises(CheckpointError, match="compressed-tensors"):
        load_target(config, folder, dtype=torch.float32, device="cpu", dummy=False)
    with pytest.raises(CheckpointError, match="scoring_func"):
        load_target(tiny_deepseek_config(scoring_func="tanh"), folder, dtype=torch.float32, device="cpu",
                    dummy=False)


def test_mtp_layer_is_deepseeks_block_n(tmp_path):
    """The MTP draft over a prompt == the definition, with transformers' DeepseekV3 decoder layer N
    (MLA + MoE, weights of model.layers.{N}.*) as the block:
    logits_t = head(shared_head.norm(layer_N(eh_proj(cat(enorm(embed(x_{t+1})), hnorm(norm(h_t)))))))."""
    from checkpoints_deepseek import hf_model
    from safetensors.torch import load_file

    from specgen.checkpoints import read_config
    from specgen.checkpoints.loading import load_draft
    from specgen.models.attention import AttentionBatch

    config = tiny_deepseek_config()
    folder = write_deepseek_checkpoint(tmp_path / "ds", config)
    target = load_fp32_target(folder)
    draft = load_draft("mtp", read_config(folder), folder, target, num_speculative_tokens=1,
                       dtype=torch.float32, device="cpu", dummy=False)
    n = config["num_hidden_layers"]
    ref = hf_model(config, 0, layers=n + 1)           # the writer's weights: layer N is the block
    ref.config._attn_implementation = "eager"
    ids = tokens(n=12, batch=1)
    T = ids.shape[1] - 1
    positions = torch.arange(T).unsqueeze(0)
    with torch.no_grad():
        hidden, aux = target(ids[:, :T], positions, target.new_cache(1, 32, torch.float32, "cpu"),
                             AttentionBatch.build(positions, None, torch.arange(T), False),
                             capture=draft.aux_layer_ids)
        feature = draft.first_feature(aux)
        cache = draft.new_cache(1, 32, torch.float32, "cpu")
        out = draft._pass(feature, ids[:, 1:], cache, AttentionBatch.build(positions, None, torch.arange(T), False))
        ours = draft.draft_logits(out)

        layer = ref.model.layers[n]
        extra = load_file(str(folder / "model.safetensors"))
        p = f"model.layers.{n}."
        x = torch.cat((rms(ref.model.embed_tokens(ids[:, 1:]), extra[p + "enorm.weight"]),
                       rms(ref.model.norm(hidden), extra[p + "hnorm.weight"])), -1) @ extra[p + "eh_proj.weight"].T
        mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
        o = layer(x, attention_mask=mask, position_embeddings=ref.model.rotary_emb(x, positions))
        expected = rms(o, extra[p + "shared_head.norm.weight"]) @ extra[p + "shared_head.head.weight"].T
    torch.testing.assert_close(ours, expected, atol=2e-4, rtol=1e-4)


def test_grouped_and_gathered_experts_equal_a_loop_over_tokens():
    """Both batched expert paths (grouped GEMM for bf16, gathered weights otherwise) == the definition."""
    from specgen.models.moe import MoE, MoeConfig

    cfg = MoeConfig.from_hf(tiny_deepseek_config())
    torch.manual_seed(0)
    moe = MoE(cfg)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.1)
        x = torch.randn(13, cfg.hidden_size)
        weights, experts = moe.gate(x)
        expected = torch.zeros_like(x)
        for t in range(13):
            for w, e in zip(weights[t], experts[t]):
                gate, up = (moe.experts.gate_up_proj[e] @ x[t]).chunk(2)
                expected[t] += w * (moe.experts.down_proj[e] @ (torch.nn.functional.silu(gate) * up))
        torch.testing.assert_close(moe.experts._gathered(x, weights, experts), expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(moe.experts._grouped(x, weights, experts), expected, atol=1e-5, rtol=1e-5)
        # the routing really spreads tokens over several experts, some unused
        assert 1 < len(set(experts.flatten().tolist())) <= cfg.n_routed_experts


def test_kimi_tiktoken_tokenizer_loads_without_remote_code(tmp_path):
    import json

    from specgen.checkpoints.tokenizer import load_tokenizer

    folder = tmp_path / "kimi"
    write_tiktoken_tokenizer(folder, {259: "[BOS]", 260: "<think>", 261: "</think>", 262: "[EOS]"})
    (folder / "config.json").write_text(json.dumps(tiny_kimi_config(vocab_size=300)))
    tokenizer = load_tokenizer(folder, 300)
    assert tokenizer.convert_tokens_to_ids("<think>") == 260 and tokenizer.convert_tokens_to_ids("</think>") == 261
    ids = tokenizer.encode("hello<think>", add_special_tokens=False)
    assert ids == [258, 260] and tokenizer.decode(ids) == "hello<think>"


def test_a_tokenizer_only_remote_code_can_read_is_refused_with_what_to_provide(tmp_path):
    import json

    from specgen.checkpoints.tokenizer import load_tokenizer

    folder = tmp_path / "remote"
    folder.mkdir()
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"auto_map": {"AutoTokenizer": ["tokenization_custom.CustomTokenizer", None]},
         "tokenizer_class": "CustomTokenizer"}))
    with pytest.raises(CheckpointError, match="never runs it: put a tokenizer.json"):
        load_tokenizer(folder, 300)


def test_full_deepseek_v3_config_builds_for_dummy_weights_and_is_estimated():
    """`load_format: dummy` with the real config: the model builds (on the meta device here: 671B
    parameters do not fit a test machine) with exactly the parameters the estimate counts, and the
    one-GPU timing recipe cuts it to 4 layers + the MTP layer through hf_overrides."""
    from pathlib import Path

    from checkpoints import reference_config

    from specgen.checkpoints.loading import target_config
    from specgen.job import estimate_bytes, resolve
    from specgen.models.deepseek_v3 import DeepseekV3ForCausalLM
    from specgen.recipe import load_recipe

    cfg = target_config(reference_config("deepseek-ai__DeepSeek-V3.config.json"))
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(cfg)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_parameters() == 671_026_419_200
    recipe = load_recipe(Path(__file__).parent.parent / "recipes" / "deepseek-v3-dummy-mtp.yaml",
                         ["runtime.device=cpu", "target.dtype=bfloat16"])
    r = resolve(recipe)
    assert r.target_config["num_hidden_layers"] == 4 and r.draft_config is r.target_config
    parts = estimate_bytes(recipe, r)
    assert parts["target weights"] == target_config(r.target_config).num_parameters() * 2
    assert 50e9 < parts["target weights"] + parts["draft weights"] < 60e9     # fits one 80 GB GPU


def test_mla_through_the_attention_kernel_equals_the_reference_path(tmp_path):
    """The latent cache read by the latent Triton kernel (interpreted on CPU; each entry loaded once
    for keys and values) == the SDPA reference path, prefill then decode steps."""
    from specgen.models.attention import AttentionBatch

    from kernel_device import KERNEL_DEVICE

    model = load_fp32_target(write_deepseek_checkpoint(tmp_path / "ds", tiny_deepseek_config()), KERNEL_DEVICE)
    ids = tokens(n=10).to(KERNEL_DEVICE)

    def logits_through(use_kernel: bool) -> torch.Tensor:
        cache = model.new_cache(2, 32, torch.float32, KERNEL_DEVICE)
        out = []
        for start, end in ((0, 6), (6, 7), (7, 10)):
            positions = torch.arange(start, end, device=KERNEL_DEVICE).expand(2, end - start).contiguous()
            batch = AttentionBatch.build(positions, None, torch.arange(end, device=KERNEL_DEVICE), use_kernel)
            with torch.no_grad():
                hidden, _ = model(ids[:, start:end], positions, cache, batch)
            out.append(model.logits(hidden))
        return torch.cat(out, 1)

    torch.testing.assert_close(logits_through(True), logits_through(False), atol=1e-4, rtol=1e-4)


def test_a_tokens_experts_are_summed_in_a_fixed_order_not_by_atomic_adds(monkeypatch):
    """GPU_NOTES 2: adding each token's k expert outputs with `index_add` runs atomics on CUDA, in
    bf16, in whatever order the threads land, so the output's last bits changed from run to run. The
    grouped path sums a token's k rows in the order of its choices instead. Here every index_add
    adds its rows one at a time, each add rounded to the tensor's dtype, in a shuffled order (what
    bf16 atomics do; CPU's own index_add accumulates in float32, whatever the order): the output keeps
    its bits. The old `index_add` of the k rows fails this (checked by hand)."""
    from specgen.models.moe import MoE, MoeConfig

    cfg = MoeConfig.from_hf(tiny_deepseek_config())
    torch.manual_seed(0)
    moe = MoE(cfg).to(torch.bfloat16)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.1)
        x = torch.randn(29, cfg.hidden_size, dtype=torch.bfloat16)
        weights, experts = moe.gate(x)
        base = moe.experts._grouped(x, weights, experts)
        for seed in range(4):
            def atomic(self, dim, index, source, seed=seed):
                assert dim == 0
                out = self.clone()
                for i in torch.randperm(index.numel(), generator=torch.Generator().manual_seed(seed)).tolist():
                    out[index[i]] = out[index[i]] + source[i]          # rounded to bf16 at every add
                return out

            monkeypatch.setattr(torch.Tensor, "index_add", atomic)
            assert torch.equal(moe.experts._grouped(x, weights, experts), base), seed
            monkeypatch.undo()
