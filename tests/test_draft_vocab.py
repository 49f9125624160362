"""Reduced draft vocabularies for DFlash and MTP (drafts/vocab.py).

Their head is the full head's `d2t` rows: the reduced draft must score exactly what the full head
scores on those rows (so a loader without the extension, which ignores `d2t`, runs the same draft
over all V rows), never draft a token outside them, and keep speculative output identical to plain
decoding. Drafts are made the way `train-draft` makes them (training/methods.py) and written in the
exported layout.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from checkpoints import tiny_llama_config
from model_calls import attn
from safetensors.torch import load_file, save_file
from test_speculative import prompts, run, runner_for
from test_training import target, target_dir  # noqa: F401  (fixtures: the same tiny target)

from specgen.checkpoints import CheckpointError, read_config
from specgen.checkpoints.loading import load_draft
from specgen.drafts.mtp import mtp_weight_prefix
from specgen.recipe import TrainSpec, recipe_from_dict
from specgen.training.export import write_checkpoint
from specgen.training.features import target_features
from specgen.training.methods import TRAINERS

TARGET = tiny_llama_config()          # 6 layers, hidden 64, vocab 96
V, VD = TARGET["vocab_size"], 40
SPEC = TrainSpec(ttt_steps=3, draft_vocab_size=VD, block_size=5, layers=2)
METHODS = ["dflash", "mtp"]


def write_reduced_draft(folder: Path, method: str, target, spec: TrainSpec = SPEC) -> torch.Tensor:
    """A random draft with a reduced vocabulary of scattered ids, made and exported as `train-draft`
    makes them; returns the draft ids' target ids."""
    torch.manual_seed(0)
    counts = torch.randperm(target.vocab_size)          # the kept ids are scattered over the vocabulary
    trainer = TRAINERS[method]
    config, extra = trainer.new_config(target.shape, spec, counts)
    draft = trainer.build(config, extra, target, spec.block_size - 1 if method == "dflash" else 3)
    with torch.no_grad():                               # away from the init, so every weight matters
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    write_checkpoint(folder, config, trainer.export(draft, config, extra), "float32")
    return extra["draft_to_target"]


@pytest.fixture(scope="module", params=METHODS)
def exported(request, tmp_path_factory, target):
    """(method, folder, the draft ids' target ids): a reduced-vocabulary draft in its exported layout."""
    folder = tmp_path_factory.mktemp(request.param) / "draft"
    return request.param, folder, write_reduced_draft(folder, request.param, target)


def load(method: str, folder: Path, target, config: dict | None = None):
    return load_draft(method, config or read_config(folder), folder, target, num_speculative_tokens=3,
                      dtype=torch.float32, device="cpu", dummy=False)


def d2t_key(method: str, folder: Path) -> str:
    return (mtp_weight_prefix(read_config(folder)) if method == "mtp" else "") + "d2t"


def without_extension(method: str, folder: Path, out: Path) -> Path:
    """The same checkpoint as a loader that does not know the extension reads it."""
    out.mkdir()
    config = read_config(folder)
    del config["draft_vocab_size"]
    (out / "config.json").write_text(json.dumps(config))
    key = d2t_key(method, folder)
    state = {k: v for k, v in load_file(str(folder / "model.safetensors")).items()
             if k not in (key, key[:-3] + "t2d")}
    save_file(state, str(out / "model.safetensors"))
    return out


def test_the_reduced_head_is_the_full_heads_rows(exported, target, tmp_path):
    method, folder, kept = exported
    reduced = load(method, folder, target)
    full = load(method, without_extension(method, folder, tmp_path / "plain"), target)
    assert reduced.reduced_vocab and not full.reduced_vocab
    assert torch.equal(reduced.draft_to_target, kept) and not torch.equal(kept, torch.arange(VD))
    hidden = torch.randn(5, TARGET["hidden_size"], generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        small, big = reduced.draft_logits(hidden), full.draft_logits(hidden)
    assert small.shape == (5, VD) and big.shape == (5, V)
    torch.testing.assert_close(small, big[:, kept], rtol=1e-6, atol=1e-6)


def test_drafts_come_from_the_draft_vocabulary_only(exported, target):
    method, folder, kept = exported
    draft = load(method, folder, target)
    tokens = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(5))
    aux = target_features(target, tokens[:, :8], draft.aux_layer_ids)
    positions = torch.arange(8).expand(2, 8)
    seen = []

    def pick(logits, where):
        seen.append(logits)
        return logits.argmax(-1), None

    with torch.no_grad():
        drafted, _ = draft.propose(aux, tokens[:, 1:], positions, torch.tensor([7, 5]),
                                   draft.new_cache(2, 24, torch.float32, "cpu"), attn(positions, 24), pick)
    outside = torch.ones(V, dtype=torch.bool)
    outside[kept] = False
    assert set(drafted.flatten().tolist()) <= set(kept.tolist())
    for logits in seen:                                 # [B, V]: -inf exactly outside the kept rows
        assert logits.shape[-1] == V
        assert torch.isinf(logits[..., outside]).all() and torch.isfinite(logits[..., kept]).all()


def recipe(target_dir: Path, method: str, folder: Path | None, k: int = 3, **sampling):
    return recipe_from_dict({
        "target": {"model": str(target_dir), "dtype": "float32"},
        "draft": {"method": method, "model": str(folder), "num_speculative_tokens": k}
        if folder else {"method": "none"},
        "sampling": {"max_tokens": 24, "ignore_eos": True, "seed": 7, **sampling},
        "runtime": {"device": "cpu", "batch_size": 4, "max_seq_len": 96, "compile": False},
        "chat_template": False,
    })


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "top_p": 0.9}], ids=["greedy", "seeded-sampled"])
def test_speculative_output_equals_plain_decoding(exported, target_dir, sampling):
    method, folder, _ = exported
    ids = prompts()
    plain, _ = run(runner_for(recipe(target_dir, "none", None, **sampling)), ids)
    spec, totals = run(runner_for(recipe(target_dir, method, folder, **sampling)), ids)
    assert spec == plain
    assert totals.spec.num_drafts > 0


@pytest.mark.parametrize(("edit", "message"), [
    ("drop", r"draft_vocab_size 40 < vocab_size 96 but the checkpoint has no d2t"),
    ("shape", r"d2t has shape \[39\], expected \[40\]"),
    ("range", r"d2t maps draft ids to \d+\.\.\d+, outside the target vocabulary 0\.\.95")])
def test_a_bad_d2t_is_named(exported, target, tmp_path, edit, message):
    method, folder, _ = exported
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((folder / "config.json").read_text())
    state = load_file(str(folder / "model.safetensors"))
    key = d2t_key(method, folder)
    if edit == "drop":
        del state[key]
    elif edit == "shape":
        state[key] = state[key][:-1]
    else:
        state[key] = state[key] + V
    save_file(state, str(broken / "model.safetensors"))
    with pytest.raises(CheckpointError, match=message) as err:
        load(method, broken, target)
    assert str(err.value).startswith(f"{broken}: ")


def test_inspect_checkpoint_checks_the_d2t_range(exported, target_dir):
    from specgen.inspection.report import inspect_checkpoint

    method, folder, kept = exported
    report = inspect_checkpoint(str(folder), str(target_dir))
    assert (report.role, report.method) == ("draft", method)       # an exported MTP layer is a draft too
    checks = {c.name: c for c in report.compatibility}
    assert all(c.ok for c in checks.values()), checks
    assert checks["d2t range"].detail == f"{VD} draft ids map into target ids {int(kept.min())}..{int(kept.max())}"
