"""What every decoder-only target shares: the `Target` protocol over `model.embed_tokens`,
`model.layers`, `model.norm`, `lm_head` and a RoPE `inv_freq` buffer.

Contract: a subclass (models/llama.py, models/deepseek_v3.py) sets `config` (with `num_layers`,
`hidden_size`, `vocab_size`, `cache_bytes_per_token(dtype)`), `shape`, `model`, `lm_head`, registers
`inv_freq` from its `_inv_freq()`, defines `rope(positions, dtype) -> cos, sin` and `new_cache`; its
layers are called `layer(h, cos, sin, cache, i, attn)`. Layer ids name layer OUTPUTS (id i = the
residual stream leaving layer i, HF `hidden_states[i + 1]`), the convention of every draft checkpoint.
"""

from __future__ import annotations

import torch
from torch import nn

from specgen.models.attention import AttentionBatch
from specgen.models.layers import float32_logits
from specgen.models.quantized import QuantizedLinear


class DecoderTarget(nn.Module):
    # -- the Target protocol (models/protocol.py) -------------------------------------------------

    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def input_embedding(self) -> torch.Tensor:
        return self.model.embed_tokens.weight

    @property
    def embedding_dtype(self) -> torch.dtype:
        """The dtype `embed` returns, without building a dense table (a QuantizedEmbedding holds codes)."""
        embedding = self.model.embed_tokens
        return getattr(embedding, "dtype", None) or embedding.weight.dtype

    @property
    def output_embedding(self) -> torch.Tensor:
        return self.lm_head.weight

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(tokens)

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.norm(hidden)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        if isinstance(self.lm_head, QuantizedLinear):
            # float32 logits of a bf16 product (models/quantized.py: bf16 activations)
            return self.lm_head.quantized.matmul(hidden).to(torch.float32)
        return float32_logits(hidden, self.lm_head.weight)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(self.final_norm(hidden))

    def cache_bytes_per_token(self, dtype: torch.dtype) -> int:
        return self.config.cache_bytes_per_token(dtype)

    def static_tensors(self) -> list[torch.Tensor]:
        return [self.inv_freq]

    def init_buffers(self, device) -> None:
        self.inv_freq = self._inv_freq().to(device)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache, attn: AttentionBatch,
                capture: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        # tokens, positions: [B, T] -> last layer output [B, T, H], captured [B, T, len(capture) * H] | None
        h = self.embed(tokens)
        cos, sin = self.rope(positions, h.dtype)
        captured: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.model.layers):
            h = layer(h, cos, sin, cache, i, attn)
            if i in capture:
                captured[i] = h
        # The config's order, not layer order, defines the concatenation (fc weights depend on it).
        aux = torch.cat([captured[i] for i in capture], -1) if capture else None
        return h, aux


def beyond_last_layer(key: str, num_layers: int) -> bool:
    """`model.layers.{i}.*` with i >= num_layers: an MTP layer (drafts/mtp.py), not the target's."""
    parts = key.split(".", 3)
    return (len(parts) > 3 and parts[0] == "model" and parts[1] == "layers" and parts[2].isdigit()
            and int(parts[2]) >= num_layers)
