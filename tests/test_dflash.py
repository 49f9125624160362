"""The DFlash draft: loader, the cached batched block pass against the definition, and losslessness.

Checkpoints are tiny random ones in the real layout (tests/checkpoints_dflash.py). The reference
(`ReferenceDFlash`) is written from ALGORITHMS.md section 1.1 and z-lab `dflash/model.py`, from the
raw checkpoint tensors (unfused HF names), one sequence at a time, with plain attention over
[context features of positions 0..anchor-1, block] and no cache; it never calls the module.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from checkpoints import load_fp32_target, tiny_llama_config, write_llama_checkpoint
from checkpoints_dflash import tiny_dflash_config, write_dflash_checkpoint
from model_calls import propose
from safetensors.torch import load_file, save_file
from test_speculative import (  # noqa: F401  (small_vocab_models is a fixture)
    chi_square_p,
    exact_marginals,
    make_recipe,
    prompts,
    run,
    small_vocab_models,
)

from specgen.checkpoints import CheckpointError, read_config
from specgen.drafts.dflash import DFlashConfig, default_target_layer_ids, dummy_dflash_config
from specgen.job import build_runner, resolve
from specgen.checkpoints.loading import load_draft as load_method_draft
from specgen.pipelines.runner import Runner
from specgen.pipelines.unified import UnifiedStep

TARGET = tiny_llama_config()          # 6 layers, hidden 64, vocab 96
V, H = TARGET["vocab_size"], TARGET["hidden_size"]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    return write_llama_checkpoint(tmp_path_factory.mktemp("target") / "llama", TARGET)


@pytest.fixture(scope="module")
def target(target_dir):
    return load_fp32_target(target_dir)


def load_draft(folder: Path, target, k: int | None = 4):
    return load_method_draft("dflash", read_config(folder), folder, target, num_speculative_tokens=k,
                             dtype=torch.float32, device="cpu", dummy=False)


# ----------------------------------------------------------------------------------------- loader


@pytest.mark.parametrize("block_in_dflash", [False, True], ids=["top-level", "in-dflash_config"])
def test_block_size_is_read_from_either_place(tmp_path, target, block_in_dflash):
    folder = write_dflash_checkpoint(tmp_path / "d", tiny_dflash_config(TARGET, block_size=6,
                                                                         block_in_dflash=block_in_dflash))
    draft = load_draft(folder, target, k=None)
    assert draft.config.block_size == 6
    assert draft.num_speculative_tokens == 5          # default: block_size - 1
    assert draft.config.mask_token_id == V - 2
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        load_draft(folder, target, k=6)
    assert load_draft(folder, target, k=2).num_speculative_tokens == 2


@pytest.mark.parametrize("layers,n,expected", [(36, 5, (1, 9, 17, 25, 33)), (32, 5, (1, 8, 15, 22, 29)),
                                               (61, 6, (1, 12, 24, 35, 47, 58)), (36, 1, (18,))])
def test_default_target_layer_ids_rule(layers, n, expected):
    assert default_target_layer_ids(layers, n) == expected


def test_default_target_layer_ids_use_the_draft_depth(tmp_path, target):
    # No target_layer_ids: n = num_hidden_layers (the reference's build_target_layer_ids call).
    folder = write_dflash_checkpoint(tmp_path / "d", tiny_dflash_config(TARGET, layers=2))
    assert load_draft(folder, target).aux_layer_ids == (1, 3)
    folder = write_dflash_checkpoint(tmp_path / "e", tiny_dflash_config(TARGET, layers=2,
                                                                        target_layer_ids=[0, 2, 4]))
    assert load_draft(folder, target).aux_layer_ids == (0, 2, 4)


def test_real_config_parses_in_the_real_shape():
    from checkpoints import reference_config

    config = reference_config("z-lab__Qwen3-8B-DFlash-b16.config.json")
    cfg = DFlashConfig.from_hf(config, target_layers=36, target_hidden=4096, target_vocab=151936)
    assert cfg.block_size == 16 and cfg.mask_token_id == 151669
    assert cfg.target_layer_ids == (1, 9, 17, 25, 33) == default_target_layer_ids(36, 5)
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (5, 32, 8, 128)
    assert cfg.rope.theta == 1_000_000 and cfg.sliding_windows == (None,) * 5
    assert cfg.num_parameters() == 5 * (4096 * 6144 + 4096 * 4096 + 256 + 3 * 4096 * 12288 + 8192) \
        + 5 * 4096 * 4096 + 2 * 4096


@pytest.mark.parametrize("mask", [V, 10**6, -1])
def test_mask_token_outside_the_target_embedding_is_rejected(tmp_path, target, mask):
    config = tiny_dflash_config(TARGET)
    config["dflash_config"]["mask_token_id"] = mask
    folder = write_dflash_checkpoint(tmp_path / "d", config)
    with pytest.raises(CheckpointError, match="mask_token_id .* not a row of the target embedding"):
        load_draft(folder, target)


def test_missing_mask_token_and_wrong_width_are_rejected(tmp_path, target):
    config = tiny_dflash_config(TARGET)
    del config["dflash_config"]["mask_token_id"]
    with pytest.raises(CheckpointError, match="mask_token_id is missing"):
        load_draft(write_dflash_checkpoint(tmp_path / "a", config), target)
    config = tiny_dflash_config(TARGET, hidden_size=2 * H)
    with pytest.raises(CheckpointError, match="hidden_size"):
        load_draft(write_dflash_checkpoint(tmp_path / "b", config), target)


@pytest.mark.parametrize("edit", ["drop-k_norm", "drop-fc", "extra-lm_head", "bad-shape"])
def test_bad_weights_raise_checkpoint_errors_naming_the_folder(tmp_path, target, edit):
    folder = write_dflash_checkpoint(tmp_path / "d", tiny_dflash_config(TARGET))
    path = folder / "model.safetensors"
    state = load_file(str(path))
    if edit == "drop-k_norm":
        del state["layers.1.self_attn.k_norm.weight"]
    elif edit == "drop-fc":
        del state["fc.weight"]
    elif edit == "extra-lm_head":
        state["lm_head.weight"] = torch.zeros(V, H)
    else:
        state["fc.weight"] = torch.zeros(H, 3 * H)
    save_file(state, str(path))
    with pytest.raises(CheckpointError, match=str(folder)):
        load_draft(folder, target)


def test_dummy_config_builds_a_random_draft(target):
    config = dummy_dflash_config(target.shape)
    draft = load_method_draft("dflash", config, None, target, num_speculative_tokens=None, dtype=torch.float32,
                              device="cpu", dummy=True)
    assert draft.num_speculative_tokens == 7 and draft.aux_layer_ids == (1, 3)
    assert draft.config.mask_token_id == V - 1


def test_rope_spellings_agree(tmp_path, target):
    a = load_draft(write_dflash_checkpoint(tmp_path / "a", tiny_dflash_config(TARGET)), target)
    b = load_draft(write_dflash_checkpoint(tmp_path / "b", tiny_dflash_config(TARGET, rope="rope_parameters")),
                   target)
    assert a.config.rope == b.config.rope and a.config.rope.theta == 5000.0
    assert torch.equal(a.inv_freq, b.inv_freq)


# ------------------------------------------------------------------------------ the definition


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))


def rotate(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    # x: [T, heads, D]; rotate-half RoPE at the given absolute positions
    angles = positions.float().unsqueeze(-1) * inv_freq
    cos = torch.cat((angles, angles), -1).cos().unsqueeze(1)
    sin = torch.cat((angles, angles), -1).sin().unsqueeze(1)
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


class ReferenceDFlash:
    """One block by the definition: ctx = hidden_norm(fc(features of positions 0..c-1)); block
    [anchor, MASK..] embedded with the target's table at c..c+K; per layer Q from the normed block,
    K/V from cat(ctx, normed block) with shared projections, k_norm / q_norm before RoPE; full
    bidirectional attention (sliding layers: causal, q - k < window); logits = target lm_head(norm)."""

    def __init__(self, folder: Path, target) -> None:
        self.config = read_config(folder)
        self.w = {k: v.float() for k, v in load_file(str(folder / "model.safetensors")).items()}
        self.embedding = target.model.embed_tokens.weight
        self.head = target.lm_head.weight
        c = self.config
        self.heads, self.kv_heads, self.d = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        self.eps = c["rms_norm_eps"]
        self.mask_id = c["dflash_config"]["mask_token_id"]
        self.window = c.get("sliding_window")
        self.inv_freq = 1.0 / 5000.0 ** (torch.arange(0, self.d, 2).float() / self.d)

    def logits(self, features: torch.Tensor, anchor: int, k: int) -> torch.Tensor:
        # features: [c, n * H] for positions 0..c-1 -> logits [k, V] for positions c+1..c+k
        w, c = self.w, features.shape[0]
        ctx = rms_norm(features @ w["fc.weight"].T, w["hidden_norm.weight"], self.eps)
        x = self.embedding[torch.tensor([anchor] + [self.mask_id] * k)]
        qpos = c + torch.arange(k + 1)
        kpos = torch.cat((torch.arange(c), qpos))
        for i, kind in enumerate(self.config["layer_types"]):
            p = f"layers.{i}."
            xn = rms_norm(x, w[p + "input_layernorm.weight"], self.eps)
            src = torch.cat((ctx, xn))
            q = rms_norm((xn @ w[p + "self_attn.q_proj.weight"].T).view(k + 1, self.heads, self.d),
                         w[p + "self_attn.q_norm.weight"], self.eps)
            keys = rms_norm((src @ w[p + "self_attn.k_proj.weight"].T).view(-1, self.kv_heads, self.d),
                            w[p + "self_attn.k_norm.weight"], self.eps)
            values = (src @ w[p + "self_attn.v_proj.weight"].T).view(-1, self.kv_heads, self.d)
            q, keys = rotate(q, qpos, self.inv_freq), rotate(keys, kpos, self.inv_freq)
            group = self.heads // self.kv_heads
            keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
            scores = torch.einsum("qhd,khd->hqk", q, keys) / self.d ** 0.5
            allowed = torch.ones(k + 1, c + k + 1, dtype=torch.bool)
            if kind == "sliding_attention":
                diff = qpos.unsqueeze(1) - kpos.unsqueeze(0)
                allowed = (diff >= 0) & (diff < self.window)
            attn = torch.einsum("hqk,khd->qhd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), values)
            x = x + attn.reshape(k + 1, -1) @ w[p + "self_attn.o_proj.weight"].T
            n = rms_norm(x, w[p + "post_attention_layernorm.weight"], self.eps)
            gate, up = n @ w[p + "mlp.gate_proj.weight"].T, n @ w[p + "mlp.up_proj.weight"].T
            x = x + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
        return rms_norm(x[1:], w["norm.weight"], self.eps) @ self.head.T


class Recorder:
    """A `pick` that takes the argmax and records the logits and positions it was given."""

    def __init__(self) -> None:
        self.logits: list[torch.Tensor] = []
        self.positions: list[torch.Tensor] = []

    def __call__(self, logits, position):
        self.logits.append(logits.clone())
        self.positions.append(position.clone())
        return logits.argmax(-1), None

    def stacked(self) -> torch.Tensor:
        return torch.stack(self.logits, 1)


@pytest.fixture(scope="module", params=["full", "sliding"])
def reference_pair(request, tmp_path_factory, target):
    window = 4 if request.param == "sliding" else None
    config = tiny_dflash_config(TARGET, layers=2, sliding_window=window, target_layer_ids=[0, 2, 4])
    folder = write_dflash_checkpoint(tmp_path_factory.mktemp("dflash") / request.param, config, seed=3)
    return load_draft(folder, target, k=4), ReferenceDFlash(folder, target)


K, WIDTH, SLOTS, MAX_LEN = 4, 3 * H, 3, 48


def check(recorder, tokens, expected_logits, positions):
    got = recorder.stacked()
    torch.testing.assert_close(got, expected_logits, atol=1e-4, rtol=1e-4)
    assert torch.equal(tokens, expected_logits.argmax(-1))
    assert torch.equal(torch.stack(recorder.positions, 1), positions)


def test_reference_matches_prefill_into_one_slot(reference_pair):
    draft, ref = reference_pair
    g = torch.Generator().manual_seed(11)
    cache = draft.new_cache(SLOTS, MAX_LEN, torch.float32, "cpu")
    for t in cache.k + cache.v:
        t.normal_(generator=g)                                   # other slots hold live data
    before = [t.clone() for t in cache.k + cache.v]
    length = 9
    aux = torch.randn(1, length, WIDTH, generator=g)
    next_tokens = torch.randint(0, V, (1, length), generator=g)
    rec = Recorder()
    tokens, probs = propose(draft, aux, next_tokens, torch.arange(length).unsqueeze(0),
                                  torch.tensor([length - 1]), cache, 32, rec, rows=torch.tensor([1]))
    assert probs is None and tokens.shape == (1, K)
    expected = ref.logits(aux[0], int(next_tokens[0, -1]), K).unsqueeze(0)
    check(rec, tokens, expected, (length + 1 + torch.arange(K)).unsqueeze(0))
    for old, new in zip(before, cache.k + cache.v):
        assert torch.equal(old[[0, 2]], new[[0, 2]])             # only slot 1 was written
        assert torch.equal(old[1, :, length:], new[1, :, length:])


def test_reference_matches_batched_steps_with_junk_past_last_index(reference_pair):
    """Rows of different committed lengths, last_index 0 / middle / K, junk features and tokens after
    last_index; two consecutive steps so the second overwrites the first one's scratch."""
    draft, ref = reference_pair
    g = torch.Generator().manual_seed(5)
    cache = draft.new_cache(SLOTS, MAX_LEN, torch.float32, "cpu")
    lengths = [5, 11, 2]
    history = []
    for b, n in enumerate(lengths):                             # prefill every slot
        aux = torch.randn(1, n, WIDTH, generator=g)
        tokens = torch.randint(0, V, (1, n), generator=g)
        propose(draft, aux, tokens, torch.arange(n).unsqueeze(0), torch.tensor([n - 1]), cache, 32,
                      Recorder(), rows=torch.tensor([b]))
        history.append(aux[0])
    committed = torch.tensor(lengths)
    for last in ([0, 2, K], [K, 0, 1]):
        last_index = torch.tensor(last)
        positions = committed.unsqueeze(1) + torch.arange(K + 1)
        aux = torch.randn(SLOTS, K + 1, WIDTH, generator=g)
        next_tokens = torch.randint(0, V, (SLOTS, K + 1), generator=g)
        rec = Recorder()
        tokens, _ = propose(draft, aux, next_tokens, positions, last_index, cache, 32, rec)
        expected = []
        for b in range(SLOTS):
            history[b] = torch.cat((history[b], aux[b, : last[b] + 1]))
            expected.append(ref.logits(history[b], int(next_tokens[b, last[b]]), K))
        anchor = committed + last_index + 1
        check(rec, tokens, torch.stack(expected), anchor.unsqueeze(1) + 1 + torch.arange(K))
        committed = anchor


@pytest.mark.parametrize("layers", ["bidirectional", "causal", "with-sliding"])
def test_kernel_path_equals_the_reference_path_and_reads_only_live_entries(tmp_path, layers):
    """On the kernel path (CUDA's: the key bound is the whole allocation) the block's K/V go into the
    cache's scratch and the Triton kernel (interpreted on CPU) reads each row up to what its queries
    see (GPU_NOTES 5): the same block logits as the reference path over the same steps, with every
    cache entry past the block NaN."""
    from kernel_device import KERNEL_DEVICE
    from model_calls import attn

    changes = {"is_causal": True} if layers == "causal" else {}
    window = 4 if layers == "with-sliding" else None
    config = tiny_dflash_config(TARGET, layers=2, sliding_window=window, target_layer_ids=[0, 2, 4], **changes)
    folder = write_dflash_checkpoint(tmp_path / layers, config, seed=3)
    target = load_fp32_target(write_llama_checkpoint(tmp_path / "target", TARGET), KERNEL_DEVICE)
    draft = load_method_draft("dflash", read_config(folder), folder, target, num_speculative_tokens=K,
                              dtype=torch.float32, device=KERNEL_DEVICE, dummy=False)
    kernel_layers = [i for i, w in enumerate(draft.config.sliding_windows) if w is None]
    g = torch.Generator().manual_seed(5)
    lengths = [5, 11, 2]
    steps = []
    for last in ([0, 2, K], [K, 0, 1]):
        steps.append((torch.randn(SLOTS, K + 1, WIDTH, generator=g),
                      torch.randint(0, V, (SLOTS, K + 1), generator=g), torch.tensor(last)))
    prefills = [(torch.randn(1, n, WIDTH, generator=g), torch.randint(0, V, (1, n), generator=g)) for n in lengths]

    def run(use_kernel: bool) -> torch.Tensor:
        on = lambda t: t.to(KERNEL_DEVICE)       # noqa: E731
        cache = draft.new_cache(SLOTS, MAX_LEN, torch.float32, KERNEL_DEVICE)
        kv_len = MAX_LEN if use_kernel else 32
        for b, (aux, tokens) in enumerate(prefills):
            n = tokens.shape[1]
            positions = on(torch.arange(n).unsqueeze(0))
            draft.propose(on(aux), on(tokens), positions, on(torch.tensor([n - 1])), cache,
                          attn(positions, kv_len, on(torch.tensor([b])), use_kernel), Recorder())
        committed = torch.tensor(lengths)
        recorded = []
        for aux, tokens, last_index in steps:
            positions = committed.unsqueeze(1) + torch.arange(K + 1)
            block_end = committed + last_index + 1 + K
            if use_kernel:   # (a sliding layer keeps the reference path: its cache stays clean)
                for b in range(SLOTS):
                    for i in kernel_layers:
                        cache.k[i][b, :, block_end[b] + 1:] = float("nan")
                        cache.v[i][b, :, block_end[b] + 1:] = float("nan")
            rec = Recorder()
            draft.propose(on(aux), on(tokens), on(positions), on(last_index), cache,
                          attn(on(positions), kv_len, None, use_kernel), rec)
            recorded.append(rec.stacked().cpu())
            committed = committed + last_index + 1
        return torch.stack(recorded)

    kernel, reference = run(True), run(False)
    assert torch.isfinite(kernel).all()
    torch.testing.assert_close(kernel, reference, atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------------ through the real runner


@pytest.fixture(scope="module")
def models(tmp_path_factory, target_dir):
    folder = tmp_path_factory.mktemp("spec") / "dflash"
    return target_dir, write_dflash_checkpoint(folder, tiny_dflash_config(TARGET, layers=2, block_size=8))


def dflash_runner(recipe, folder: Path, k: int, stochastic: bool = False) -> Runner:
    """A plain recipe's runner with UnifiedStep(target, DFlash draft) swapped in (the recipe schema does
    not know "dflash" yet)."""
    r = resolve(recipe)
    plain, _, _ = build_runner(recipe, r, recipe.sampling.seed)
    target = plain.unified.target
    draft = load_method_draft("dflash", read_config(folder), folder, target, num_speculative_tokens=k,
                              dtype=torch.float32, device="cpu", dummy=False)
    step = UnifiedStep(target, draft, stochastic_drafts=stochastic)
    return Runner(step, batch_size=plain.batch_size, max_seq_len=plain.max_seq_len, rules=plain.rules,
                  sampling=plain.sampling, seed=plain.seed, device=plain.device, dtype=torch.float32,
                  compile=recipe.runtime.compile)


@pytest.mark.parametrize("k", [1, 3, 7])
def test_greedy_dflash_equals_greedy_plain(models, k):
    target, draft = models
    ids = prompts()
    plain, _ = run(runner_plain(make_recipe(target)), ids)
    spec, totals = run(dflash_runner(make_recipe(target), draft, k), ids)
    assert spec == plain
    assert totals.spec.num_drafts > 0


def runner_plain(recipe) -> Runner:
    r = resolve(recipe)
    return build_runner(recipe, r, recipe.sampling.seed)[0]


def test_seeded_sampled_dflash_equals_seeded_plain(models):
    target, draft = models
    ids = prompts()
    sampling = {"temperature": 0.8, "top_p": 0.9}
    plain, _ = run(runner_plain(make_recipe(target, **sampling)), ids)
    greedy, _ = run(runner_plain(make_recipe(target)), ids)
    assert plain != greedy
    spec, _ = run(dflash_runner(make_recipe(target, **sampling), draft, 3), ids)
    assert spec == plain


def test_stochastic_dflash_output_has_the_target_distribution(small_vocab_models, tmp_path):  # noqa: F811
    target, _ = small_vocab_models
    config = tiny_llama_config(vocab_size=24)
    draft = write_dflash_checkpoint(tmp_path / "dflash", tiny_dflash_config(config, layers=1), seed=4,
                                    scale=0.3)
    prompt, n = [5, 9, 2, 17, 11], 2000
    recipe = make_recipe(target, batch=64, temperature=1.0)
    runner = dflash_runner(recipe, draft, 2, stochastic=True)
    results, totals = run(runner, [prompt] * n, max_tokens=3, ids=[f"r{i}" for i in range(n)])
    assert totals.spec.num_accepted_tokens > 0.1 * totals.spec.num_draft_tokens
    marginals = exact_marginals(runner, prompt, 3)
    for position, probs in enumerate(marginals):
        samples = [results[f"r{i}"][position] for i in range(n)]
        assert chi_square_p(samples, probs) > 1e-3, f"output token {position + 1} is off-distribution"


def test_config_json_roundtrip_keeps_layer_types(tmp_path, target):
    config = tiny_dflash_config(TARGET, sliding_window=3)
    folder = write_dflash_checkpoint(tmp_path / "d", config)
    assert json.loads((folder / "config.json").read_text())["layer_types"][-1] == "sliding_attention"
    draft = load_draft(folder, target)
    assert draft.config.sliding_windows == (None, 3) and draft.config.causal == (False, True)


def recording_drafts(runner: Runner, drafts: list) -> Runner:
    """`runner`, with the drafts each of its speculative steps verified appended to `drafts` (not the
    warm-up's, whose slots are all inactive)."""
    functions = runner.functions
    step = functions.step

    def recorded(kv_len: int, window: int, k: int, between=None):
        active = functions.state.active.clone()
        out = step(kv_len, window, k, between)
        if active.any():
            drafts.append(functions.state.pending[active, 1:k + 1].tolist())
        return out

    functions.step = recorded
    return runner


def test_a_compiled_frozen_step_proposes_the_eager_drafts(models):
    """The compiled CPU step (weights frozen, GEMMs on the C++ template) proposes, step by step, the
    drafts the eager step does. Its context keys and values multiply by a slice of the fused q|k|v
    weight; folded in as a constant that slice kept its offset into the weight's storage, which
    the template dropped, so it multiplied by the query rows (the shipped SmolLM2 DFlash accepted
    its first draft 8.6% of the time compiled against 22.4% eager)."""
    target, draft = models
    ids = prompts(lengths=(5, 12, 3))
    drafts: dict[bool, list] = {False: [], True: []}
    tokens = {}
    for compile in (False, True):
        runner = dflash_runner(make_recipe(target, batch=1, compile=compile), draft, 3)
        assert runner.compiled == compile
        tokens[compile], _ = run(recording_drafts(runner, drafts[compile]), ids, max_tokens=12)
    assert tokens[True] == tokens[False]
    assert len(drafts[False]) > 10
    assert drafts[True] == drafts[False]
