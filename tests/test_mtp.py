"""The MTP draft: checkpoint layouts, the cached batched draft against the definition, losslessness.

Checkpoints are tiny random Llama targets carrying a DeepSeek-style MTP layer at
`model.layers.{num_hidden_layers}.*` (ALGORITHMS.md section 3.2), or the same keys in a separate folder.
The reference (`ReferenceMtp`) is written from the definition (drafts/mtp.py docstring): raw checkpoint
tensors, transformers' own LlamaDecoderLayer as the block, full causal attention, no cache, one
sequence at a time; it never calls the draft module.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from checkpoints import load_fp32_target, tiny_llama_config, write_llama_checkpoint
from model_calls import logits as forward_logits
from model_calls import propose
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_speculative import chi_square_p, exact_marginals, make_recipe, prompts, run, runner_for

from specgen.checkpoints import CheckpointError, read_config
from specgen.checkpoints.loading import has_draft_layers
from specgen.drafts.mtp import MtpConfig, dummy_mtp_config
from specgen.checkpoints.loading import load_draft as load_method_draft
from specgen.pipelines.runner import Runner
from specgen.pipelines.unified import UnifiedStep

TARGET = tiny_llama_config(num_nextn_predict_layers=1)   # 6 layers, hidden 64, vocab 96, llama3 rope
V, H, N = TARGET["vocab_size"], TARGET["hidden_size"], TARGET["num_hidden_layers"]


# ----------------------------------------------------------------------------------------- writers


def mtp_tensors(config: dict, *, own_embedding: bool = False, own_head: bool = True,
                seed: int = 11) -> dict[str, torch.Tensor]:
    """Random MTP-layer weights under the real key names, `model.layers.{N}.*`."""
    gen = torch.Generator().manual_seed(seed)
    h, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    d = h // heads

    def w(*shape):
        return torch.randn(*shape, generator=gen) * 0.08

    state = {
        "enorm.weight": 1 + 0.1 * w(h), "hnorm.weight": 1 + 0.1 * w(h), "eh_proj.weight": w(h, 2 * h),
        "shared_head.norm.weight": 1 + 0.1 * w(h),
        "self_attn.q_proj.weight": w(heads * d, h), "self_attn.k_proj.weight": w(kv * d, h),
        "self_attn.v_proj.weight": w(kv * d, h), "self_attn.o_proj.weight": w(h, heads * d),
        "mlp.gate_proj.weight": w(inter, h), "mlp.up_proj.weight": w(inter, h),
        "mlp.down_proj.weight": w(h, inter),
        "input_layernorm.weight": 1 + 0.1 * w(h), "post_attention_layernorm.weight": 1 + 0.1 * w(h),
    }
    if own_head:
        state["shared_head.head.weight"] = w(vocab, h)
    if own_embedding:
        state["embed_tokens.weight"] = w(vocab, h)
    prefix = f"model.layers.{config['num_hidden_layers']}."
    return {prefix + k: v.contiguous() for k, v in state.items()}


def write_mtp_target(folder: Path, config: dict = TARGET, *, shard_bytes: int | None = None,
                     seed: int = 0, **mtp) -> Path:
    """A Llama target checkpoint that also carries the MTP layer (DeepSeek layout)."""
    write_llama_checkpoint(folder, config, seed=seed, shard_bytes=shard_bytes)
    extra = mtp_tensors(config, **mtp)
    index = folder / "model.safetensors.index.json"
    if index.is_file():  # sharded: the MTP layer in a shard of its own, listed in the index
        save_file(extra, str(folder / "model-mtp.safetensors"))
        data = json.loads(index.read_text())
        data["weight_map"].update(dict.fromkeys(extra, "model-mtp.safetensors"))
        index.write_text(json.dumps(data))
    else:
        path = folder / "model.safetensors"
        save_file({**load_file(str(path)), **extra}, str(path), metadata={"format": "pt"})
    return folder


def write_mtp_folder(folder: Path, config: dict = TARGET, **mtp) -> Path:
    """The same MTP layer, same key names, in a folder of its own (with the target's config)."""
    folder.mkdir(parents=True, exist_ok=True)
    save_file(mtp_tensors(config, **mtp), str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def edit_weights(folder: Path, edit) -> None:
    path = folder / "model.safetensors"
    state = load_file(str(path))
    edit(state)
    save_file(state, str(path))


# ----------------------------------------------------------------------------------------- helpers


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    return write_mtp_target(tmp_path_factory.mktemp("mtp") / "target", own_embedding=True)


def load_tgt(folder: Path):
    return load_fp32_target(folder)


@pytest.fixture(scope="module")
def target(target_dir):
    return load_tgt(target_dir)


def load_draft(folder: Path, target, k: int = 3, config: dict | None = None):
    return load_method_draft("mtp", config or read_config(folder), folder, target, num_speculative_tokens=k,
                          dtype=torch.float32, device="cpu", dummy=False)


def argmax_pick(logits, position):
    return logits.argmax(-1), None


class Recorder:
    """A `pick` that takes the argmax and records the logits and positions it was given."""

    def __init__(self, with_probs: bool = False) -> None:
        self.with_probs, self.logits, self.positions = with_probs, [], []

    def __call__(self, logits, position):
        self.logits.append(logits.clone())
        self.positions.append(position.clone())
        return logits.argmax(-1), (torch.softmax(logits, -1) if self.with_probs else None)

    def stacked(self) -> torch.Tensor:
        return torch.stack(self.logits, 1)


def rms_norm(x, weight, eps):
    x = x.float()
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def read_prefixed(folder: Path, prefix: str) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            out.update({k[len(prefix):]: f.get_tensor(k) for k in f.keys() if k.startswith(prefix)})
    return out


class ReferenceMtp:
    """MTP chain drafting by the definition. Entry p: feature h_p (the target's last hidden state
    AFTER its final norm; a chained entry takes the previous entry's block output), token t_{p+1};
    x = eh_proj(cat(enorm(E t), hnorm(h))); block = HF LlamaDecoderLayer at position p, full causal
    attention over entries 0..p; logits = head(shared_head.norm(block output))."""

    def __init__(self, mtp_folder: Path, target_folder: Path) -> None:
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

        config = read_config(mtp_folder)
        self.eps = config["rms_norm_eps"]
        self.w = {k: v.float() for k, v in read_prefixed(mtp_folder, f"model.layers.{N}.").items()}
        t = read_prefixed(target_folder, "")
        self.embedding = self.w.get("embed_tokens.weight", t["model.embed_tokens.weight"])
        self.head = self.w.get("shared_head.head.weight", t["lm_head.weight"])
        self.final_norm = t["model.norm.weight"]
        hf = LlamaConfig(**{k: v for k, v in config.items() if k != "num_nextn_predict_layers"})
        self.layer = LlamaDecoderLayer(hf, layer_idx=0).eval()
        block = {k: v for k, v in self.w.items() if k.startswith(("self_attn.", "mlp.", "input_", "post_"))}
        self.layer.load_state_dict(block, strict=True)
        self.rope = LlamaRotaryEmbedding(hf)

    @torch.no_grad()
    def block(self, h: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        # h: [n, H] features, tokens: [n] -> block outputs [n, H]
        w, n = self.w, h.shape[0]
        x = torch.cat((rms_norm(self.embedding[tokens], w["enorm.weight"], self.eps),
                       rms_norm(h, w["hnorm.weight"], self.eps)), -1) @ w["eh_proj.weight"].T
        positions = torch.arange(n)[None]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        out = self.layer(x[None], attention_mask=mask, position_ids=positions,
                         position_embeddings=self.rope(x[None], positions))
        return (out[0] if isinstance(out, tuple) else out)[0]

    def draft(self, aux: torch.Tensor, tokens: torch.Tensor, k: int):
        """aux: the target's last-layer outputs (pre final norm) [n, H]; tokens t_1..t_n [n]."""
        hs = list(rms_norm(aux, self.final_norm, self.eps))
        toks = tokens.tolist()
        out_tokens, out_logits = [], []
        for _ in range(k):
            o = self.block(torch.stack(hs), torch.tensor(toks))
            logits = rms_norm(o[-1], self.w["shared_head.norm.weight"], self.eps) @ self.head.T
            out_tokens.append(int(logits.argmax()))
            out_logits.append(logits)
            hs.append(o[-1])
            toks.append(out_tokens[-1])
        return torch.tensor(out_tokens), torch.stack(out_logits)


# ------------------------------------------------------------------------------------ 1. checkpoint


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
def test_target_with_mtp_layer_loads_and_matches_transformers(tmp_path, sharded):
    """The MTP keys are dropped by the target's adapter; logits equal transformers' (which ignores them)."""
    from transformers import LlamaForCausalLM

    folder = write_mtp_target(tmp_path / "t", shard_bytes=40_000 if sharded else None)
    assert (folder / "model.safetensors.index.json").is_file() == sharded
    assert has_draft_layers("mtp", folder, read_config(folder))
    plain = write_llama_checkpoint(tmp_path / "plain", TARGET)
    assert not has_draft_layers("mtp", plain, read_config(plain))
    ours = load_tgt(folder)
    theirs = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokens = torch.randint(0, V, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cache = ours.new_cache(2, 32, torch.float32, "cpu")
        got, _ = forward_logits(ours, tokens, torch.arange(20).expand(2, 20), cache, 32)
        torch.testing.assert_close(got, theirs(tokens).logits, atol=2e-5, rtol=1e-4)


def test_inside_target_and_separate_folder_give_the_same_draft(tmp_path, target_dir, target):
    inside = load_draft(target_dir, target, k=3)
    separate = load_draft(write_mtp_folder(tmp_path / "d", own_embedding=True), target, k=3)
    a, b = inside.state_dict(), separate.state_dict()
    assert a.keys() == b.keys() and "block.self_attn.qkv_proj.weight" in a and "embed_tokens.weight" in a
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert inside.aux_layer_ids == (N - 1,)
    aux = torch.randn(1, 7, H, generator=torch.Generator().manual_seed(1))
    tokens = torch.randint(0, V, (1, 7), generator=torch.Generator().manual_seed(2))
    outs = [propose(d, aux, tokens, torch.arange(7)[None], torch.tensor([6]),
                      d.new_cache(1, 16, torch.float32, "cpu"), 16, argmax_pick)[0] for d in (inside, separate)]
    assert torch.equal(*outs)


def test_missing_and_unusable_checkpoints_are_named(tmp_path, target):
    folder = write_mtp_folder(tmp_path / "d")
    edit_weights(folder, lambda s: s.pop(f"model.layers.{N}.eh_proj.weight"))
    with pytest.raises(CheckpointError, match=rf"{folder}.*missing eh_proj.weight"):
        load_draft(folder, target)
    plain = write_llama_checkpoint(tmp_path / "plain", TARGET)
    with pytest.raises(CheckpointError, match=rf"{plain}: no MTP weights"):
        load_draft(plain, target)
    with pytest.raises(CheckpointError, match="num_nextn_predict_layers is 2"):
        load_draft(folder, target, config={**TARGET, "num_nextn_predict_layers": 2})
    with pytest.raises(CheckpointError, match="model_type 'qwen3'"):
        load_draft(folder, target, config={**TARGET, "model_type": "qwen3"})
    with pytest.raises(CheckpointError, match="kv_lora_rank"):   # a DeepSeek block needs its MLA fields
        load_draft(folder, target, config={**TARGET, "model_type": "deepseek_v3"})


def test_embedding_and_head_are_shared_when_absent_or_duplicated(tmp_path, target, target_dir):
    shared = load_draft(write_mtp_folder(tmp_path / "none", own_head=False), target)
    assert shared.embed_tokens is None and shared.shared_head.head is None
    assert not any(k.startswith(("embed_tokens", "shared_head.head")) for k in shared.state_dict())
    own = load_draft(write_mtp_folder(tmp_path / "own", own_embedding=True), target)
    assert own.embed_tokens is not None and own.shared_head.head is not None
    # DeepSeek stores the shared tensors again inside the MTP layer: equal copies are shared, not loaded.
    dup = write_mtp_folder(tmp_path / "dup", own_embedding=True)
    t = load_file(str(target_dir / "model.safetensors"))

    def duplicate(state):
        state[f"model.layers.{N}.embed_tokens.weight"] = t["model.embed_tokens.weight"]
        state[f"model.layers.{N}.shared_head.head.weight"] = t["lm_head.weight"]
    edit_weights(dup, duplicate)
    deduped = load_draft(dup, target)
    assert deduped.embed_tokens is None and deduped.shared_head.head is None
    # Same seed, head and embedding drawn last: the other weights equal `shared`'s, so must the drafts.
    a, b = shared.state_dict(), deduped.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a)
    aux = torch.randn(2, 5, H, generator=torch.Generator().manual_seed(3))
    tokens = torch.randint(0, V, (2, 5), generator=torch.Generator().manual_seed(4))
    drafted = [propose(d, aux, tokens, torch.arange(5).expand(2, 5), torch.tensor([4, 2]),
                         d.new_cache(2, 16, torch.float32, "cpu"), 16, argmax_pick)[0] for d in (shared, deduped)]
    assert torch.equal(*drafted)


def test_dummy_draft_and_parameter_count(target):
    draft = load_method_draft("mtp", dummy_mtp_config(target.shape), None, target, num_speculative_tokens=2,
                           dtype=torch.float32, device="cpu", dummy=True)
    cfg = MtpConfig.from_hf(dummy_mtp_config(target.shape), target_layers=N, target_hidden=H, target_vocab=V)
    assert cfg.num_parameters() == sum(p.numel() for p in draft.parameters())
    drafted, _ = propose(draft, torch.randn(1, 4, H), torch.zeros(1, 4, dtype=torch.long),
                               torch.arange(4)[None], torch.tensor([3]),
                               draft.new_cache(1, 8, torch.float32, "cpu"), 8, argmax_pick)
    assert drafted.shape == (1, 2)


# --------------------------------------------------------------------------- 2. against the definition


@pytest.fixture(scope="module", params=["own-embed-and-head", "shared-embed-and-head"])
def reference_pair(request, tmp_path_factory, target_dir, target):
    if request.param == "own-embed-and-head":
        folder = target_dir
    else:
        folder = write_mtp_folder(tmp_path_factory.mktemp("ref") / "d", own_head=False, seed=21)
    return load_draft(folder, target, k=4), ReferenceMtp(folder, target_dir)


def test_prefill_into_a_slot_matches_the_definition(reference_pair):
    draft, ref = reference_pair
    g = torch.Generator().manual_seed(5)
    aux, tokens = torch.randn(1, 9, H, generator=g), torch.randint(0, V, (1, 9), generator=g)
    cache = draft.new_cache(3, 32, torch.float32, "cpu")
    for t in cache.k + cache.v:
        t.normal_(generator=g)                                  # other slots' contents stay untouched
    before = [t[[0, 2]].clone() for t in cache.k + cache.v]
    pick = Recorder()
    drafted, probs = propose(draft, aux, tokens, torch.arange(9)[None], torch.tensor([8]), cache, 32, pick,
                                   rows=torch.tensor([1]))
    expected_tokens, expected_logits = ref.draft(aux[0], tokens[0], 4)
    assert probs is None and torch.equal(drafted[0], expected_tokens)
    torch.testing.assert_close(pick.stacked()[0], expected_logits, atol=1e-4, rtol=1e-4)
    assert [int(p[0]) for p in pick.positions] == [10, 11, 12, 13]
    for t, b in zip(cache.k + cache.v, before):
        assert torch.equal(t[[0, 2]], b)


def test_batched_step_matches_the_definition(reference_pair):
    """Rows at different cache lengths with 0, 2 and K accepted; junk after last_index and stale
    cache entries past the committed length change nothing."""
    draft, ref = reference_pair
    k = draft.num_speculative_tokens
    lens, accepted = [5, 11, 2], [0, 2, k]
    batch, max_len = len(lens), 32
    g = torch.Generator().manual_seed(7)
    feats = [torch.randn(n + k + 1, H, generator=g) for n in lens]
    toks = [torch.randint(0, V, (n + k + 1,), generator=g) for n in lens]
    cache = draft.new_cache(batch, max_len, torch.float32, "cpu")
    for b, n in enumerate(lens):
        propose(draft, feats[b][:n][None], toks[b][:n][None], torch.arange(n)[None], torch.tensor([n - 1]),
                      cache, max_len, argmax_pick, rows=torch.tensor([b]))
        for t in cache.k + cache.v:
            t[b, :, n:].normal_(generator=g)
    aux = torch.randn(batch, k + 1, H, generator=g) * 3
    tokens = torch.randint(0, V, (batch, k + 1), generator=g)
    for b, (n, a) in enumerate(zip(lens, accepted)):
        aux[b, : a + 1] = feats[b][n : n + a + 1]
        tokens[b, : a + 1] = toks[b][n : n + a + 1]
    positions = torch.tensor(lens).unsqueeze(1) + torch.arange(k + 1)
    pick = Recorder(with_probs=True)
    drafted, probs = propose(draft, aux, tokens, positions, torch.tensor(accepted), cache, max_len, pick)
    assert drafted.shape == (batch, k) and probs.shape == (batch, k, V)
    for b, (n, a) in enumerate(zip(lens, accepted)):
        expected_tokens, expected_logits = ref.draft(feats[b][: n + a + 1], toks[b][: n + a + 1], k)
        assert torch.equal(drafted[b], expected_tokens), f"row {b}"
        torch.testing.assert_close(pick.stacked()[b], expected_logits, atol=1e-4, rtol=1e-4)
        assert [int(p[b]) for p in pick.positions] == [n + a + 2 + i for i in range(k)]


def test_features_are_the_targets_normed_last_hidden_state(target_dir, target):
    """The draft asks the target for layer output L-1 and applies the target's final norm itself."""
    draft = load_draft(target_dir, target, k=1)
    tokens = torch.randint(0, V, (1, 8), generator=torch.Generator().manual_seed(8))
    cache = target.new_cache(1, 16, torch.float32, "cpu")
    _, aux = forward_logits(target, tokens, torch.arange(8)[None], cache, 16, capture=draft.aux_layer_ids)
    from transformers import LlamaForCausalLM

    theirs = LlamaForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    outputs = []
    hook = theirs.model.layers[-1].register_forward_hook(lambda m, i, o: outputs.append(o))
    with torch.no_grad():
        hidden = theirs(tokens, output_hidden_states=True).hidden_states
    hook.remove()
    last = outputs[0][0] if isinstance(outputs[0], tuple) else outputs[0]
    torch.testing.assert_close(aux, last, atol=2e-5, rtol=1e-4)                 # pre final norm
    # HF's last hidden_states entry is post-norm: what MTP consumes (drafts/mtp.py docstring)
    torch.testing.assert_close(target.model.norm(aux), hidden[N], atol=2e-5, rtol=1e-4)


# ----------------------------------------------------------------------------- 3. losslessness


def mtp_runner(target_dir: Path, k: int, *, stochastic: bool = False, batch: int = 4, compile: bool = False,
               **sampling) -> Runner:
    base = runner_for(make_recipe(target_dir, batch=batch, **sampling))
    target = base.unified.target
    draft = load_draft(target_dir, target, k=k)
    step = UnifiedStep(target, draft, stochastic_drafts=stochastic)
    return Runner(step, batch_size=base.batch_size, max_seq_len=base.max_seq_len, rules=base.rules,
                  sampling=base.sampling, seed=base.seed, device=base.device, dtype=torch.float32,
                  compile=compile)


@pytest.fixture(scope="module")
def plain_greedy(target_dir):
    return run(runner_for(make_recipe(target_dir)), prompts())[0]


@pytest.mark.parametrize("k", [1, 2, 4])
def test_greedy_speculative_equals_greedy_plain(target_dir, plain_greedy, k):
    mtp, totals = run(mtp_runner(target_dir, k), prompts())
    assert mtp == plain_greedy
    assert totals.spec.num_drafts > 0


def test_seeded_sampled_speculative_equals_seeded_plain(target_dir, plain_greedy):
    ids = prompts()
    sampling = {"temperature": 0.8, "top_p": 0.9}
    plain, _ = run(runner_for(make_recipe(target_dir, **sampling)), ids)
    assert plain != plain_greedy  # sampling really happened
    mtp, _ = run(mtp_runner(target_dir, 3, **sampling), ids)
    assert mtp == plain


STAT_VOCAB = 24


def test_stochastic_mtp_draft_keeps_the_target_distribution(tmp_path):
    config = tiny_llama_config(vocab_size=STAT_VOCAB, num_nextn_predict_layers=1)
    folder = write_mtp_target(tmp_path / "t", config, seed=5)
    runner = mtp_runner(folder, 2, stochastic=True, batch=64, temperature=1.0)
    prompt, n = [5, 9, 2, 17, 11], 2000
    results, totals = run(runner, [prompt] * n, max_tokens=3, ids=[f"r{i}" for i in range(n)])
    assert totals.spec.num_accepted_tokens > 0.1 * totals.spec.num_draft_tokens
    for position, probs in enumerate(exact_marginals(runner, prompt, 3)):
        samples = [results[f"r{i}"][position] for i in range(n)]
        assert chi_square_p(samples, probs) > 1e-3, f"output token {position + 1} is off-distribution"


def test_compiled_mtp_step_equals_eager(target_dir):
    ids = prompts(lengths=(3, 6))
    eager, eager_totals = run(mtp_runner(target_dir, 2, batch=2), ids, max_tokens=6)
    runner = mtp_runner(target_dir, 2, batch=2, compile=True)
    assert runner.compiled
    compiled, totals = run(runner, ids, max_tokens=6)
    assert compiled == eager
    assert totals.spec.acceptance_histogram == eager_totals.spec.acceptance_histogram
