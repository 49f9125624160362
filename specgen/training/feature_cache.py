"""Target features on disk (`train.feature_cache`): one target forward per training sequence, read by
every epoch and every draft method after it.

Why: with a reduced draft vocabulary the draft's own forward and backward are cheap, and the frozen
target's forward became most of a training step on a CPU (SmolLM2 on 2 shared cores, 4 x 440
tokens: features 4-5 s against 0.6-3.6 s for the draft). Training reruns that forward every epoch and for
every method; this store runs it once per sequence and layer.

Contract: `FeatureStore(folder)` holds one append-only store per target layer under `folder`
(`layer-<id>/`): `data.bin`, the hidden states leaving that layer, bfloat16 rows of width H in the
order they were written, and `index.jsonl`, one line per sequence (`{"key", "offset", "length"}`,
offset and length in rows), written after its rows are on disk, so a kill at any moment loses at
most the sequence being written (a partial last line and unindexed rows are ignored). A sequence
is keyed by its token ids (`sequence_key`), so the store serves any selection of sequences.
- `missing(sequences, layers)`: the sequences that some layer lacks;
- `fill(target, sequences, layers, batch_size, on_progress)`: the target's forward over those,
  writing every layer they lack (resumable: it skips what is there);
- `read(sequences, layers, length, dtype) -> [B, length, n * H]`: the features of a padded batch
  (zeros past each sequence's end: padding sits after every real token, so nothing attends to it).
bfloat16 storage halves the disk; the draft then trains on features rounded to bfloat16 (what a
CPU with native bf16, or a GPU, computes them in anyway).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from specgen.training.features import padded_batch, target_features


def sequence_key(ids: list[int]) -> str:
    return hashlib.blake2b(np.asarray(ids, dtype=np.int64).tobytes(), digest_size=12).hexdigest()


class _LayerStore:
    def __init__(self, folder: Path, hidden: int) -> None:
        self.folder, self.hidden = folder, hidden
        self.data, self.index_path = folder / "data.bin", folder / "index.jsonl"
        self.index: dict[str, tuple[int, int]] = {}
        self._cut_line = False            # the index ends mid-line (a kill): the next entry starts anew
        if self.index_path.is_file():
            text = self.index_path.read_text()
            self._cut_line = bool(text) and not text.endswith("\n")
            for line in text.splitlines():
                try:
                    entry = json.loads(line)
                except json.JSONDecodeError:
                    continue                # a line cut by a kill: its sequence is written again
                self.index[entry["key"]] = (entry["offset"], entry["length"])
        self._map: np.memmap | None = None

    def append(self, key: str, rows: torch.Tensor) -> None:
        # rows: [length, H] -> appended as bfloat16 bits, then indexed
        self.folder.mkdir(parents=True, exist_ok=True)
        bits = rows.detach().to("cpu", torch.bfloat16).contiguous().view(torch.int16).numpy()
        row_bytes = 2 * self.hidden
        with open(self.data, "ab") as f:
            end = f.seek(0, os.SEEK_END)
            if end % row_bytes:                 # a row cut by a kill (unindexed): rows stay aligned
                f.truncate(end - end % row_bytes)
            offset = f.seek(0, os.SEEK_END) // row_bytes
            f.write(bits.tobytes())
            f.flush()
            os.fsync(f.fileno())
        with open(self.index_path, "a") as f:
            entry = json.dumps({"key": key, "offset": offset, "length": int(rows.shape[0])})
            f.write("\n" * self._cut_line + entry + "\n")
        self._cut_line = False
        self.index[key] = (offset, int(rows.shape[0]))
        self._map = None

    def rows(self, key: str) -> torch.Tensor:
        # -> [length, H] bfloat16
        if self._map is None:
            self._map = np.memmap(self.data, dtype=np.int16, mode="r").reshape(-1, self.hidden)
        offset, length = self.index[key]
        return torch.from_numpy(np.array(self._map[offset:offset + length])).view(torch.bfloat16)


class FeatureStore:
    def __init__(self, folder: Path, hidden: int) -> None:
        self.folder, self.hidden = folder, hidden
        self._layers: dict[int, _LayerStore] = {}

    def layer(self, layer: int) -> _LayerStore:
        if layer not in self._layers:
            self._layers[layer] = _LayerStore(self.folder / f"layer-{layer}", self.hidden)
        return self._layers[layer]

    def missing(self, sequences: list[tuple[list[int], int]], layers: tuple[int, ...]) -> list[int]:
        """Indices of the sequences that one of `layers` lacks."""
        keys = [sequence_key(ids) for ids, _ in sequences]
        return [i for i, key in enumerate(keys) if any(key not in self.layer(n).index for n in layers)]

    def fill(self, target, sequences: list[tuple[list[int], int]], layers: tuple[int, ...], batch_size: int,
             on_progress: Callable[[int, int], None] | None = None) -> int:
        """Run the target over the sequences some layer lacks and store those layers; returns how
        many sequences it ran (0 when the store had them all)."""
        todo = self.missing(sequences, layers)
        todo.sort(key=lambda i: len(sequences[i][0]))          # similar lengths together: less padding
        device = target.input_embedding.device
        for start in range(0, len(todo), batch_size):
            batch = [sequences[i] for i in todo[start:start + batch_size]]
            tokens, _ = padded_batch(batch)
            aux = target_features(target, tokens.to(device), layers)          # [B, T, n * H]
            for row, (ids, _) in enumerate(batch):
                key = sequence_key(ids)
                for j, n in enumerate(layers):
                    store = self.layer(n)
                    if key not in store.index:
                        store.append(key, aux[row, :len(ids), j * self.hidden:(j + 1) * self.hidden])
            if on_progress is not None:
                on_progress(min(start + batch_size, len(todo)), len(todo))
        return len(todo)

    def read(self, sequences: list[tuple[list[int], int]], layers: tuple[int, ...], length: int,
             dtype: torch.dtype) -> torch.Tensor:
        """The features of a padded batch: [B, length, len(layers) * H] in `dtype`."""
        out = torch.zeros(len(sequences), length, len(layers) * self.hidden, dtype=dtype)
        for row, (ids, _) in enumerate(sequences):
            key = sequence_key(ids)
            for j, n in enumerate(layers):
                rows = self.layer(n).rows(key)
                out[row, :rows.shape[0], j * self.hidden:(j + 1) * self.hidden] = rows.to(dtype)
        return out
