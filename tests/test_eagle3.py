"""The EAGLE-3 draft loader and the cached, batched draft against the definition.

Checkpoints are tiny random ones in the real key layouts (tests/checkpoints.py). The reference draft
below (`ReferenceEagle3`) is written from ALGORITHMS.md section 2.1 and DESIGN.md section 5, from the
raw checkpoint tensors (unfused HF names), with plain full causal attention and no KV cache, one
sequence at a time; it never calls the module's forward.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from checkpoints import load_fp32_target, tiny_eagle3_config, tiny_llama_config, write_eagle3_checkpoint, write_llama_checkpoint
from model_calls import propose
from safetensors.torch import load_file, save_file

from specgen.checkpoints import CheckpointError, read_config
from specgen.checkpoints.loading import load_draft as load_method_draft
from specgen.checkpoints.loading import load_target

TARGET = tiny_llama_config()          # 6 layers, hidden 64, vocab 96, llama3 rope scaling
V, H = TARGET["vocab_size"], TARGET["hidden_size"]


# ----------------------------------------------------------------------------------------- helpers


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    return write_llama_checkpoint(tmp_path_factory.mktemp("target") / "llama", TARGET)


def load_tgt(folder: Path):
    return load_fp32_target(folder)


@pytest.fixture(scope="module")
def target(target_dir):
    """Shared, never modified: tests that perturb the target load their own copy."""
    return load_tgt(target_dir)


def dummy_target(layers: int):
    return load_target(tiny_llama_config(num_hidden_layers=layers), None, dtype=torch.float32,
                       device="cpu", dummy=True)


def load_draft(folder: Path, target, k: int = 3):
    return load_method_draft("eagle3", read_config(folder), folder, target, num_speculative_tokens=k,
                             dtype=torch.float32, device="cpu", dummy=False)


def write_draft(folder: Path, **kwargs) -> Path:
    config_changes = kwargs.pop("config", {})
    return write_eagle3_checkpoint(folder, tiny_eagle3_config(TARGET, **config_changes), TARGET, **kwargs)


def edit_weights(folder: Path, edit) -> None:
    path = folder / "model.safetensors"
    state = load_file(str(path))
    edit(state)
    save_file({k: v.contiguous() for k, v in state.items()}, str(path))


def edit_config(folder: Path, edit) -> None:
    config = read_config(folder)
    edit(config)
    (folder / "config.json").write_text(json.dumps(config))


class Recorder:
    """A `pick` that takes the argmax and records what it was given (optionally returning probs)."""

    def __init__(self, with_probs: bool = False) -> None:
        self.with_probs = with_probs
        self.logits: list[torch.Tensor] = []
        self.positions: list[torch.Tensor] = []

    def __call__(self, logits, position):
        self.logits.append(logits.clone())
        self.positions.append(position.clone())
        return logits.argmax(-1), (torch.softmax(logits, -1) if self.with_probs else None)

    def stacked(self) -> torch.Tensor:
        return torch.stack(self.logits, 1)  # [B, K, V]


def argmax_pick(logits, position):
    return logits.argmax(-1), None


def random_inputs(batch: int, length: int, seed: int, aux_width: int = 3 * H):
    g = torch.Generator().manual_seed(seed)
    aux = torch.randn(batch, length, aux_width, generator=g)
    tokens = torch.randint(0, V, (batch, length), generator=g)
    return aux, tokens


def prefill_propose(draft, aux, tokens, pick=argmax_pick, slots=3, slot=1, max_len=32):
    """Drive propose like `UnifiedStep.prefill_slot`: the whole prompt, last_index = P - 1."""
    length = aux.shape[1]
    cache = draft.new_cache(slots, max_len, torch.float32, "cpu")
    positions = torch.arange(length).unsqueeze(0)
    return propose(draft, aux, tokens, positions, torch.tensor([length - 1]), cache, max_len, pick,
                         rows=torch.tensor([slot]))


# ------------------------------------------------------------------------------ the definition


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))


class ReferenceEagle3:
    """EAGLE-3 chain drafting by the definition, from the checkpoint's own (unfused) tensors.

    Entry p: residual h_p, input cat(input_layernorm(embed(t_{p+1})), hidden_norm(h_p)), RoPE
    position p, causal attention over entries 0..p. h_p = fc(f_p) for the given features; a chained
    entry takes the previous entry's pre-norm output as h and the drafted token as t."""

    def __init__(self, folder: Path, target_embedding: torch.Tensor) -> None:
        config = read_config(folder)
        raw = load_file(str(folder / "model.safetensors"))
        prefix = "midlayer." if any(k.startswith("midlayer.") for k in raw) else "layers.0."
        self.w = {k.removeprefix(prefix): v.float() for k, v in raw.items()}
        self.embedding = self.w.get("embed_tokens.weight", target_embedding)
        self.eps = config["rms_norm_eps"]
        self.norm_before_residual = bool(config.get("norm_before_residual", False))
        self.init_attention(config)
        dvocab = config.get("draft_vocab_size") or config["vocab_size"]
        self.vocab = config["vocab_size"]
        d2t = raw.get("d2t", torch.zeros(dvocab, dtype=torch.long))
        self.draft_to_target = torch.arange(dvocab) + d2t.long()     # d2t is an OFFSET

    def init_attention(self, config: dict) -> None:
        self.heads = config["num_attention_heads"]
        self.kv_heads = config["num_key_value_heads"]
        self.head_dim = config["hidden_size"] // self.heads
        assert not config.get("rope_scaling") and not config.get("rope_parameters")
        theta = config.get("rope_theta", 10000.0)            # the draft's own RoPE, not the target's
        self.inv_freq = 1.0 / theta ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim)

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # x: [N, heads, d]; rotate-half
        angles = positions.float()[:, None] * self.inv_freq
        cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), -1)
        return x * cos[:, None] + rotated * sin[:, None]

    def layer(self, h: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        # h: [N, H] entry inputs (the residual); tokens: [N]; entry p sits at position p -> [N, H]
        w = self.w
        normed = rms_norm(h, w["hidden_norm.weight"], self.eps)
        x = torch.cat((rms_norm(self.embedding[tokens], w["input_layernorm.weight"], self.eps), normed), -1)
        residual = normed if self.norm_before_residual else h        # SpecForge's flag; default false
        h1 = residual + self.attention(x)
        m = rms_norm(h1, w["post_attention_layernorm.weight"], self.eps)
        gate, up = m @ w["mlp.gate_proj.weight"].T, m @ w["mlp.up_proj.weight"].T
        mlp = (F.silu(gate) * up) @ w["mlp.down_proj.weight"].T
        return h1 + mlp

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        # x: [N, 2H] entry inputs at positions 0..N-1 -> causal GQA attention after o_proj [N, H]
        w, n, d = self.w, x.shape[0], self.head_dim
        q = (x @ w["self_attn.q_proj.weight"].T).view(n, self.heads, d)
        k = (x @ w["self_attn.k_proj.weight"].T).view(n, self.kv_heads, d)
        v = (x @ w["self_attn.v_proj.weight"].T).view(n, self.kv_heads, d)
        positions = torch.arange(n)
        q, k = self.rope(q, positions), self.rope(k, positions)
        groups = self.heads // self.kv_heads                        # GQA: q head i reads kv head i // g
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        attn = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        out = torch.einsum("hqk,khd->qhd", attn, v).reshape(n, self.heads * d)
        return out @ w["self_attn.o_proj.weight"].T

    def target_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        draft_logits = rms_norm(hidden, self.w["norm.weight"], self.eps) @ self.w["lm_head.weight"].T
        full = torch.full((self.vocab,), float("-inf"))
        full[self.draft_to_target] = draft_logits
        return full

    def draft(self, features: torch.Tensor, tokens: torch.Tensor, k: int):
        """features f_0..f_{n-1} [n, 3H_t], tokens t_1..t_n [n] -> K tokens [K], logits [K, V]."""
        hs = list(features.float() @ self.w["fc.weight"].T)
        toks = tokens.tolist()
        out_tokens, out_logits = [], []
        for _ in range(k):
            o = self.layer(torch.stack(hs), torch.tensor(toks))   # everything recomputed, no cache
            logits = self.target_logits(o[-1])
            token = int(logits.argmax())
            out_tokens.append(token)
            out_logits.append(logits)
            hs.append(o[-1])                                       # pre-norm output fed back
            toks.append(token)
        return torch.tensor(out_tokens), torch.stack(out_logits)


class ReferenceMlaEagle3(ReferenceEagle3):
    """The same chain with nvidia Kimi-K2.5-Thinking-Eagle3's MLA decoder layer, whose attention is
    transformers' own DeepseekV3Attention (expanded per-head keys and values, yarn RoPE with its
    softmax correction, interleaved rotary pairs) on the checkpoint's tensors: q_a / kv_a read the
    2H input, o_proj writes H."""

    def init_attention(self, config: dict) -> None:
        from transformers import DeepseekV3Config
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
            DeepseekV3Attention,
            DeepseekV3RotaryEmbedding,
        )

        h = config["hidden_size"]
        fields = ("num_attention_heads", "num_key_value_heads", "q_lora_rank", "kv_lora_rank",
                  "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "rope_theta", "rope_scaling",
                  "max_position_embeddings", "rms_norm_eps")
        hf = DeepseekV3Config(**{k: config[k] for k in fields}, hidden_size=2 * h, attention_bias=False)
        hf._attn_implementation = "eager"
        self.hf_attention = DeepseekV3Attention(hf, layer_idx=0).eval()
        self.hf_attention.o_proj = torch.nn.Linear(hf.num_attention_heads * hf.v_head_dim, h, bias=False)
        state = {k.removeprefix("self_attn."): v for k, v in self.w.items() if k.startswith("self_attn.")}
        self.hf_attention.load_state_dict(state)
        self.hf_rope = DeepseekV3RotaryEmbedding(hf)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        # x: [N, 2H] -> [N, H]
        n = x.shape[0]
        positions = torch.arange(n)[None]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        with torch.no_grad():
            out, _ = self.hf_attention(x[None], self.hf_rope(x[None], positions), mask)
        return out[0]


# ------------------------------------------------------------------------------------ 1. layouts


def test_both_layouts_load_to_the_same_draft(tmp_path, target):
    """`midlayer.*` (official) and `layers.0.*` (speculators) give the same weights and proposals."""
    drafts = [load_draft(write_draft(tmp_path / layout, layout=layout), target, k=4)
              for layout in ("midlayer", "layers.0")]
    a, b = (d.state_dict() for d in drafts)
    assert a.keys() == b.keys() and "layer.self_attn.qkv_proj.weight" in a
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert torch.equal(drafts[0].draft_to_target, drafts[1].draft_to_target)
    aux, tokens = random_inputs(1, 7, seed=0)
    out = [prefill_propose(d, aux, tokens)[0] for d in drafts]
    assert out[0].shape == (1, 4) and torch.equal(out[0], out[1])


# ------------------------------------------------------------------------------ 2. vocabulary


def test_reduced_vocabulary_maps_by_offsets(tmp_path, target):
    """d2t holds offsets: draft id i is target id i + d2t[i]; the mapped logits are -inf elsewhere."""
    folder = write_draft(tmp_path / "d")
    d2t = load_file(str(folder / "model.safetensors"))["d2t"]
    draft = load_draft(folder, target)
    chosen = torch.arange(64) + d2t
    assert draft.reduced_vocab and torch.equal(draft.draft_to_target, chosen)
    assert not torch.equal(d2t, chosen)  # the offsets are not the ids themselves

    g = torch.Generator().manual_seed(0)
    draft_logits = torch.randn(2, 64, generator=g)
    full = draft.target_logits(draft_logits)
    assert full.shape == (2, V)
    outside = torch.ones(V, dtype=torch.bool)
    outside[chosen] = False
    assert torch.isneginf(full[:, outside]).all()
    assert torch.equal(full[:, chosen], draft_logits)


def test_unsorted_d2t_maps_each_draft_id(tmp_path, target):
    """A d2t whose target ids are not increasing still maps draft id i to i + d2t[i]."""
    folder = write_draft(tmp_path / "d")
    chosen = torch.randperm(V, generator=torch.Generator().manual_seed(5))[:64]
    edit_weights(folder, lambda s: s.update(d2t=chosen - torch.arange(64)))
    draft = load_draft(folder, target)
    assert torch.equal(draft.draft_to_target, chosen)
    draft_logits = torch.randn(3, 64)
    assert torch.equal(draft.target_logits(draft_logits)[:, chosen], draft_logits)


def test_proposed_tokens_are_in_the_draft_vocabulary(tmp_path, target):
    """Argmax and sampled drafts only ever return target ids of draft-vocabulary tokens."""
    draft = load_draft(write_draft(tmp_path / "d"), target, k=4)
    allowed = set(draft.draft_to_target.tolist())
    g = torch.Generator().manual_seed(11)

    def sample(logits, position):
        probs = torch.softmax(logits, -1)
        return torch.multinomial(probs, 1, generator=g)[:, 0], probs

    for pick in (argmax_pick, sample):
        for seed in range(4):
            aux, tokens = random_inputs(1, 5 + seed, seed=seed)
            drafted, probs = prefill_propose(draft, aux, tokens, pick=pick)
            assert set(drafted.flatten().tolist()) <= allowed
            if probs is not None:
                outside = torch.ones(V, dtype=torch.bool)
                outside[draft.draft_to_target] = False
                assert (probs[..., outside] == 0).all()


@pytest.mark.parametrize("how", ["equal", "absent"])
def test_full_vocabulary_uses_the_identity_map(tmp_path, target, how):
    """draft_vocab_size == vocab_size (or absent) needs no d2t and maps ids to themselves."""
    config = tiny_eagle3_config(TARGET, draft_vocab_size=V)
    if how == "absent":
        del config["draft_vocab_size"]
    folder = write_eagle3_checkpoint(tmp_path / how, config, TARGET)
    assert "d2t" not in load_file(str(folder / "model.safetensors"))
    draft = load_draft(folder, target)
    assert not draft.reduced_vocab
    assert torch.equal(draft.draft_to_target, torch.arange(V))
    logits = torch.randn(2, V)
    assert torch.equal(draft.target_logits(logits), logits)


# ------------------------------------------------------------------------------- 3. embedding


def test_own_embedding_is_used_when_the_checkpoint_has_one(tmp_path, target_dir):
    """With `embed_tokens.weight` the draft embeds with it; the target's table is irrelevant."""
    folder = write_draft(tmp_path / "d", own_embedding=True)
    table = load_file(str(folder / "model.safetensors"))["embed_tokens.weight"]
    tgt = load_tgt(target_dir)
    draft = load_draft(folder, tgt)
    assert draft.embed_tokens is not None
    tokens = torch.arange(V).view(2, -1)
    assert torch.equal(draft.embed(tokens), table[tokens])
    aux, prompt = random_inputs(1, 6, seed=1)
    before = Recorder()
    prefill_propose(draft, aux, prompt, pick=before)
    with torch.no_grad():
        tgt.model.embed_tokens.weight.add_(torch.randn(V, H))
    after = Recorder()
    prefill_propose(draft, aux, prompt, pick=after)
    assert torch.equal(before.stacked(), after.stacked())


def test_target_embedding_is_shared_when_the_checkpoint_has_none(tmp_path, target_dir):
    """Without `embed_tokens.weight` the draft reads the target's (live) table, and does not own it."""
    folder = write_draft(tmp_path / "d")
    tgt = load_tgt(target_dir)
    draft = load_draft(folder, tgt)
    assert draft.embed_tokens is None
    assert not any("embed" in key for key in draft.state_dict())
    tokens = torch.arange(V).view(2, -1)
    assert torch.equal(draft.embed(tokens), tgt.model.embed_tokens.weight[tokens])
    aux, prompt = random_inputs(1, 6, seed=1)
    before = Recorder()
    prefill_propose(draft, aux, prompt, pick=before)
    with torch.no_grad():
        tgt.model.embed_tokens.weight.add_(torch.randn(V, H))
    assert torch.equal(draft.embed(tokens), tgt.model.embed_tokens.weight[tokens])
    after = Recorder()
    prefill_propose(draft, aux, prompt, pick=after)
    assert not torch.allclose(before.stacked(), after.stacked())


# ---------------------------------------------------------------------------- 4. aux layer ids


def test_aux_layer_ids_from_eagle_config(tmp_path, target):
    """`eagle_config.eagle_aux_hidden_state_layer_ids` is taken as given, in the config's order."""
    ids = [4, 0, 3]
    folder = write_draft(tmp_path / "d", config={"eagle_config": {
        "eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True}})
    draft = load_draft(folder, target)
    assert tuple(draft.aux_layer_ids) == (4, 0, 3)
    assert draft.fc.in_features == 3 * H


@pytest.mark.parametrize("layers, expected", [(6, (1, 2, 2)), (12, (1, 5, 8)), (32, (1, 15, 28))])
def test_default_aux_layer_ids(tmp_path, layers, expected):
    """No ids in the config: layer OUTPUTS [1, L//2 - 1, L - 4] (inputs of layers 2, L//2, L-3)."""
    assert "eagle_config" not in tiny_eagle3_config(TARGET)
    draft = load_draft(write_draft(tmp_path / "d"), dummy_target(layers))
    assert tuple(draft.aux_layer_ids) == expected


@pytest.mark.parametrize("ids", [[1, 3, 6], [-1, 2, 3]])
def test_aux_layer_ids_outside_the_target_are_rejected(tmp_path, target, ids):
    """An id that is no layer output of the target is a CheckpointError naming the ids and config."""
    folder = write_draft(tmp_path / "d", config={"eagle_config": {"eagle_aux_hidden_state_layer_ids": ids}})
    with pytest.raises(CheckpointError, match=r"aux layer ids") as err:
        load_draft(folder, target)
    assert str(folder) in str(err.value) and "config.json" in str(err.value)


# ------------------------------------------------------------------------------------ 5. errors


def _drop_d2t(state):
    del state["d2t"], state["t2d"]


ERRORS = {
    "no d2t": (_drop_d2t, r"no d2t"),
    "d2t shape": (lambda s: s.update(d2t=s["d2t"][:-1]), r"d2t has shape \[63\], expected \[64\]"),
    "d2t too high": (lambda s: s.update(d2t=s["d2t"] + V), r"d2t maps draft ids to -?\d+\.\.\d+, outside the target vocabulary"),
    "d2t negative": (lambda s: s.update(d2t=s["d2t"] - s["d2t"] - 1), r"d2t maps draft ids to -?\d+\.\.\d+, outside the target vocabulary"),
    "no fc": (lambda s: s.pop("fc.weight"), r"missing fc\.weight"),
    "no layer": (lambda s: [s.update({k.replace("midlayer.", "block."): s.pop(k)})
                            for k in list(s) if k.startswith("midlayer.")],
                 r"no EAGLE-3 decoder layer"),
    "fc shape": (lambda s: s.update({"fc.weight": s["fc.weight"][:, :-1]}), r"fc\.weight has shape"),
}


@pytest.mark.parametrize("name", ERRORS)
def test_broken_checkpoints_raise_checkpoint_errors(tmp_path, target, name):
    """Each broken checkpoint is a CheckpointError that names the folder and what is wrong."""
    edit, message = ERRORS[name]
    folder = write_draft(tmp_path / "d")
    edit_weights(folder, edit)
    with pytest.raises(CheckpointError, match=message) as err:
        load_draft(folder, target)
    assert str(folder) in str(err.value)


def test_target_hidden_size_mismatch_is_rejected(tmp_path, target):
    """A draft built for another target width (`target_hidden_size`) is refused at config time."""
    folder = write_draft(tmp_path / "d")
    edit_config(folder, lambda c: c.update(target_hidden_size=2 * H))
    message = rf"target_hidden_size {2 * H} differs from the target's {H}"
    with pytest.raises(CheckpointError, match=message) as err:
        load_draft(folder, target)
    assert str(folder) in str(err.value)


# ---------------------------------------------------- 6. the cached, batched draft = the definition


@pytest.fixture(scope="module", params=["gqa", "mla"])
def reference_pair(request, tmp_path_factory, target):
    """gqa: a reduced-vocabulary draft with its own RoPE theta (not the target's llama3 scaling);
    mla: Kimi K2.5's MLA draft layer (yarn RoPE), checked against transformers' MLA attention."""
    embedding = target.model.embed_tokens.weight
    if request.param == "mla":
        from checkpoints_deepseek import tiny_mla_eagle3_config, write_mla_eagle3_checkpoint

        folder = write_mla_eagle3_checkpoint(tmp_path_factory.mktemp("ref") / "mla",
                                             tiny_mla_eagle3_config(TARGET), TARGET)
        return load_draft(folder, target, k=4), ReferenceMlaEagle3(folder, embedding)
    folder = write_draft(tmp_path_factory.mktemp("ref") / "d", config={"rope_theta": 1000.0})
    return load_draft(folder, target, k=4), ReferenceEagle3(folder, embedding)


def test_reference_matches_prefill_into_one_slot(reference_pair):
    """Prefill of one prompt into slot 1 of 3: K tokens and every pre-argmax logit as the definition;
    the other slots' cache rows are untouched and stale cache contents do not matter."""
    draft, ref = reference_pair
    k, length = draft.num_speculative_tokens, 9
    aux, tokens = random_inputs(1, length, seed=21)
    cache = draft.new_cache(3, 32, torch.float32, "cpu")
    for t in cache.k + cache.v:
        t.normal_()                                            # stale scratch everywhere
    others = [t[[0, 2]].clone() for t in cache.k + cache.v]
    pick = Recorder()
    drafted, probs = propose(draft, aux, tokens, torch.arange(length).unsqueeze(0),
                                   torch.tensor([length - 1]), cache, 32, pick, rows=torch.tensor([1]))
    expected_tokens, expected_logits = ref.draft(aux[0], tokens[0], k)
    assert probs is None and drafted.shape == (1, k)
    assert torch.equal(drafted[0], expected_tokens)
    torch.testing.assert_close(pick.stacked()[0], expected_logits, atol=1e-4, rtol=1e-4)
    # the drafted token k sits at position P + 1 + k (the pick's noise position)
    assert [int(p) for p in pick.positions] == [length + 1 + i for i in range(k)]
    for before, t in zip(others, cache.k + cache.v):
        assert torch.equal(t[[0, 2]], before)


def test_reference_matches_a_batched_step(reference_pair):
    """A step over rows at different cache lengths with 0, 2 and K accepted: each row's drafts and
    logits equal the definition over its own committed history; junk after last_index (features and
    tokens) and stale cache entries past the committed length change nothing."""
    draft, ref = reference_pair
    k = draft.num_speculative_tokens
    lens, accepted = [5, 11, 2], [0, 2, k]
    batch, max_len = len(lens), 32
    g = torch.Generator().manual_seed(7)
    # Each row's true history: features f_0.. and tokens t_1.. (tokens[i] is the token at i + 1).
    feats = [torch.randn(n + k + 1, 3 * H, generator=g) for n in lens]
    toks = [torch.randint(0, V, (n + k + 1,), generator=g) for n in lens]

    cache = draft.new_cache(batch, max_len, torch.float32, "cpu")
    for b, n in enumerate(lens):  # earlier steps: entries 0..n-1 of slot b hold its committed history
        propose(draft, feats[b][:n][None], toks[b][:n][None], torch.arange(n)[None], torch.tensor([n - 1]),
                      cache, max_len, argmax_pick, rows=torch.tensor([b]))
        for t in cache.k + cache.v:
            t[b, :, n:].normal_(generator=g)                    # stale scratch past the committed length
    saved = [t.clone() for t in cache.k + cache.v]

    def step_inputs(junk_seed):
        junk = torch.Generator().manual_seed(junk_seed)
        aux = torch.randn(batch, k + 1, 3 * H, generator=junk) * 3
        tokens = torch.randint(0, V, (batch, k + 1), generator=junk)
        for b, (n, a) in enumerate(zip(lens, accepted)):
            aux[b, : a + 1] = feats[b][n : n + a + 1]
            tokens[b, : a + 1] = toks[b][n : n + a + 1]
        return aux, tokens

    positions = torch.tensor(lens).unsqueeze(1) + torch.arange(k + 1)
    last_index = torch.tensor(accepted)
    results = []
    for junk_seed in (100, 200):
        for t, s in zip(cache.k + cache.v, saved):
            t.copy_(s)
        aux, tokens = step_inputs(junk_seed)
        pick = Recorder(with_probs=True)
        drafted, probs = propose(draft, aux, tokens, positions, last_index, cache, max_len, pick)
        assert drafted.shape == (batch, k) and probs.shape == (batch, k, V)
        results.append((drafted, pick.stacked(), probs))
        for b, (n, a) in enumerate(zip(lens, accepted)):
            expected_tokens, expected_logits = ref.draft(feats[b][: n + a + 1], toks[b][: n + a + 1], k)
            assert torch.equal(drafted[b], expected_tokens), f"row {b}"
            torch.testing.assert_close(pick.stacked()[b], expected_logits, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(probs[b], torch.softmax(expected_logits, -1), atol=1e-5, rtol=1e-4)
            assert [int(p[b]) for p in pick.positions] == [n + a + 2 + i for i in range(k)]
    (d1, l1, p1), (d2, l2, p2) = results
    assert torch.equal(d1, d2) and torch.equal(l1, l2) and torch.equal(p1, p2)


def test_consecutive_steps_match_the_definition(reference_pair):
    """Prefill, then two steps in which the accepted drafts become history: the draft cache written
    by each call is the one the next call needs (it is aligned with the target's positions)."""
    draft, ref = reference_pair
    k, max_len = draft.num_speculative_tokens, 48
    g = torch.Generator().manual_seed(9)
    prompt_len, total = 6, 6 + 2 * (k + 1)
    feats = torch.randn(total, 3 * H, generator=g)
    toks = torch.randint(0, V, (total,), generator=g)
    cache = draft.new_cache(2, max_len, torch.float32, "cpu")
    pick = Recorder()
    drafted, _ = propose(draft, feats[None, :prompt_len], toks[None, :prompt_len],
                               torch.arange(prompt_len)[None], torch.tensor([prompt_len - 1]),
                               cache, max_len, pick, rows=torch.tensor([0]))
    assert torch.equal(drafted[0], ref.draft(feats[:prompt_len], toks[:prompt_len], k)[0])
    length = prompt_len
    for accepted in (1, 3):
        positions = (length + torch.arange(k + 1))[None].expand(2, -1)
        aux = feats[length : length + k + 1][None].expand(2, -1, -1).clone()
        tokens = toks[length : length + k + 1][None].expand(2, -1).clone()
        pick = Recorder()
        drafted, _ = propose(draft, aux, tokens, positions, torch.tensor([accepted, accepted]),
                                   cache, max_len, pick)
        length += accepted + 1
        expected_tokens, expected_logits = ref.draft(feats[:length], toks[:length], k)
        assert torch.equal(drafted[0], expected_tokens)
        torch.testing.assert_close(pick.stacked()[0], expected_logits, atol=1e-4, rtol=1e-4)


def test_norm_before_residual_matches_the_definition(tmp_path, target):
    """SpecForge's `norm_before_residual: true`: the residual is hidden_norm(h), not h."""
    folder = write_draft(tmp_path / "d", config={"norm_before_residual": True})
    draft, ref = load_draft(folder, target, k=3), ReferenceEagle3(folder, target.model.embed_tokens.weight)
    aux, tokens = random_inputs(1, 7, seed=4)
    pick = Recorder()
    drafted, _ = prefill_propose(draft, aux, tokens, pick=pick)
    expected_tokens, expected_logits = ref.draft(aux[0], tokens[0], 3)
    assert torch.equal(drafted[0], expected_tokens)
    torch.testing.assert_close(pick.stacked()[0], expected_logits, atol=1e-4, rtol=1e-4)


def test_a_shared_embedding_needs_the_targets_width(tmp_path, target):
    """Without its own embed_tokens the draft embeds with the target's table: widths must agree."""
    folder = write_draft(tmp_path / "d", config={"hidden_size": 32, "target_hidden_size": TARGET["hidden_size"],
                                                 "num_attention_heads": 2, "num_key_value_heads": 2})
    with pytest.raises(CheckpointError, match="hidden_size 32 differs"):
        load_draft(folder, target)


@pytest.mark.parametrize("own_embedding", [False, True])
def test_parameter_count_from_the_tensor_names_matches_the_module(tmp_path, target, own_embedding):
    """The memory estimate counts a draft's own embedding from the checkpoint's names alone."""
    folder = write_draft(tmp_path / "d", own_embedding=own_embedding)
    draft = load_draft(folder, target)
    names = frozenset(load_file(str(folder / "model.safetensors")))
    assert draft.config.num_parameters(names) == sum(p.numel() for p in draft.parameters())
