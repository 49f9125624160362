"""DeepSeek-V3 mixture of experts: the router, the routed experts, the shared experts.

Contract: `MoE(config)` maps `[B, T, H] -> [B, T, H]` with static shapes and no host
synchronisation, so it runs inside the compiled step:
- routing (`Router`): sigmoid (or softmax) scores; the choice adds `e_score_correction_bias`
  (`noaux_tc`), keeps the `topk_group` best of `n_group` groups (a group's score = its two best
  experts), picks `num_experts_per_tok` experts; the weights are the UNbiased scores of those,
  renormalised when `norm_topk_prob`, times `routed_scaling_factor`. The router runs in float32
  (as transformers does) and its bias stays float32 whatever the model dtype (materialise.py).
- routed experts (`RoutedExperts`): all experts' weights stacked, `gate_up_proj [E, 2I, H]` and
  `down_proj [E, H, I]`. Every (token, expert) pair is computed at once, never a Python loop over
  tokens or experts: pairs are sorted by expert and run as one grouped GEMM (`grouped_mm`, which
  reads each chosen expert's weights once) when the dtype is bfloat16; otherwise (float32 tests,
  whose compiled grouped GEMM torch does not provide) each pair multiplies its gathered expert
  weights in one batched matmul. The shapes depend on tokens x top-k only, never on the routing.
  Kept block-FP8 stacks (`keep_fp8`) and packed INT4 ones as Kimi K2.5 publishes them (`keep_int4`:
  kernels/int4_experts.py, one opaque op over the pairs) multiply as stored.
- shared experts: a plain gated MLP over every token, added to the routed output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specgen.kernels import int4_experts     # also registers specgen::int4_pairs
from specgen.models.layers import GatedMLP, fuse_rows, fuse_scale_rows
from specgen.models.products import project


@dataclass(frozen=True, slots=True)
class MoeConfig:
    hidden_size: int
    moe_intermediate_size: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    # one tensor-parallel rank's slice (models/tensor_parallel.py): `shards` ranks split each routed
    # expert's rows and the shared experts' rows, or with `expert_parallel` hold whole routed experts,
    # E / shards of them from `first_expert` on. The router always scores all E.
    shards: int = 1
    expert_parallel: bool = False
    first_expert: int = 0

    @classmethod
    def from_hf(cls, config: dict) -> MoeConfig:
        cfg = cls(
            hidden_size=int(config["hidden_size"]),
            moe_intermediate_size=int(config["moe_intermediate_size"]),
            n_routed_experts=int(config["n_routed_experts"]),
            n_shared_experts=int(config.get("n_shared_experts") or 0),
            num_experts_per_tok=int(config["num_experts_per_tok"]),
            n_group=int(config.get("n_group") or 1),
            topk_group=int(config.get("topk_group") or 1),
            norm_topk_prob=bool(config.get("norm_topk_prob", True)),
            routed_scaling_factor=float(config.get("routed_scaling_factor", 1.0)),
            scoring_func=str(config.get("scoring_func", "sigmoid")),
            topk_method=str(config.get("topk_method", "noaux_tc")),
        )
        if cfg.scoring_func not in ("sigmoid", "softmax"):
            raise ValueError(f"scoring_func {cfg.scoring_func!r} is not supported (sigmoid, softmax)")
        if cfg.topk_method not in ("noaux_tc", "greedy", "group_limited_greedy"):
            raise ValueError(f"topk_method {cfg.topk_method!r} is not supported "
                             "(noaux_tc, greedy, group_limited_greedy)")
        if cfg.n_routed_experts % cfg.n_group:
            raise ValueError(f"n_routed_experts {cfg.n_routed_experts} is not a multiple of n_group {cfg.n_group}")
        if not 1 <= cfg.topk_group <= cfg.n_group:
            raise ValueError(f"topk_group {cfg.topk_group} must be in 1..n_group ({cfg.n_group})")
        if cfg.num_experts_per_tok > cfg.n_routed_experts:
            raise ValueError(f"num_experts_per_tok {cfg.num_experts_per_tok} exceeds n_routed_experts")
        return cfg

    @property
    def local_experts(self) -> int:
        """Routed experts this rank holds."""
        return self.n_routed_experts // self.shards if self.expert_parallel else self.n_routed_experts

    @property
    def local_intermediate(self) -> int:
        """Rows of each routed expert this rank holds."""
        return self.moe_intermediate_size if self.expert_parallel else self.moe_intermediate_size // self.shards

    @property
    def shared_intermediate(self) -> int:
        """Rows of the shared experts (one gated MLP) this rank holds."""
        return self.moe_intermediate_size * self.n_shared_experts // self.shards

    def parameters(self) -> int:
        """All parameters of one MoE block on one rank (every expert it holds; the estimate of
        memory, not of work)."""
        h = self.hidden_size
        return (self.n_routed_experts * (h + 1) + 3 * h * self.local_intermediate * self.local_experts
                + 3 * h * self.shared_intermediate)


class Router(nn.Module):
    def __init__(self, cfg: MoeConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.zeros(cfg.n_routed_experts, cfg.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.n_routed_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # x: [N, H] -> weights [N, k] float32, experts [N, k] int64
        c = self.cfg
        logits = project(x.float(), self.weight.float())
        scores = logits.sigmoid() if c.scoring_func == "sigmoid" else logits.softmax(dim=-1)
        choice = scores + self.e_score_correction_bias.float() if c.topk_method == "noaux_tc" else scores
        if c.n_group > 1 and c.topk_group < c.n_group:
            n = x.shape[0]
            grouped = choice.view(n, c.n_group, -1)
            # a group's score: its two best experts (noaux_tc) or its best one (group_limited_greedy)
            best = 2 if c.topk_method == "noaux_tc" else 1
            group_scores = grouped.topk(best, dim=-1).values.sum(dim=-1)                # [N, G]
            keep = torch.topk(group_scores, c.topk_group, dim=-1).indices
            group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, keep, True)
            choice = grouped.masked_fill(~group_mask.unsqueeze(-1), float("-inf")).view(n, -1)
        experts = torch.topk(choice, c.num_experts_per_tok, dim=-1).indices
        weights = scores.gather(1, experts)
        if c.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * c.routed_scaling_factor, experts


class RoutedExperts(nn.Module):
    def __init__(self, cfg: MoeConfig) -> None:
        super().__init__()
        e, h, i = cfg.local_experts, cfg.hidden_size, cfg.local_intermediate
        self.gate_up_proj = nn.Parameter(torch.zeros(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.zeros(e, h, i))
        self.first_expert = cfg.first_expert if cfg.expert_parallel else None
        self.fp8_block: int | None = None
        self.int4_group: int | None = None

    def keep_fp8(self, block: int) -> None:
        """Hold the stacks as block-FP8 weights with their float32 scales (models/fp8_layers.py):
        built on the meta device, before the state loads."""
        e, two_i, h = self.gate_up_proj.shape
        i = self.down_proj.shape[2]
        fp8, blocks = torch.float8_e4m3fn, lambda n: -(-n // block)
        self.gate_up_proj = nn.Parameter(torch.empty(e, two_i, h, dtype=fp8), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(e, h, i, dtype=fp8), requires_grad=False)
        self.gate_up_proj_scale_inv = nn.Parameter(torch.empty(e, blocks(two_i), blocks(h)), requires_grad=False)
        self.down_proj_scale_inv = nn.Parameter(torch.empty(e, blocks(h), blocks(i)), requires_grad=False)
        self.fp8_block = block

    def keep_int4(self, group: int) -> None:
        """Hold the stacks as packed INT4 words with their scales, as the checkpoint publishes them
        (kernels/int4_experts.py): `gate_up_proj_packed [E, 2I, H / 8]` int32, `gate_up_proj_scale
        [E, 2I, H / g]`, `down_proj_packed [E, H, I / 8]`, `down_proj_scale [E, H, I / g]`. Built on the
        meta device, before the state loads."""
        e, two_i, h = self.gate_up_proj.shape
        i = self.down_proj.shape[2]
        del self.gate_up_proj, self.down_proj
        def held(*shape, dtype=torch.bfloat16) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)

        self.gate_up_proj_packed = held(e, two_i, h // 8, dtype=torch.int32)
        self.gate_up_proj_scale = held(e, two_i, h // group)
        self.down_proj_packed = held(e, h, i // 8, dtype=torch.int32)
        self.down_proj_scale = held(e, h, i // group)
        self.int4_group = group

    def quantize_int4(self, group: int) -> None:
        """Dense stacks (loaded) -> the published INT4 layout, quantized symmetric in groups of `group`
        (kernels/int4_experts.quantize_symmetric; `target.quantization: int4` on a dense checkpoint);
        on a CPU then repacked for torch's kernel."""
        for name in ("gate_up_proj", "down_proj"):
            dense = getattr(self, name)
            packed, scale = int4_experts.quantize_symmetric(dense.detach(), group)
            delattr(self, name)
            setattr(self, name + "_packed", nn.Parameter(packed, requires_grad=False))
            setattr(self, name + "_scale", nn.Parameter(scale, requires_grad=False))
        self.int4_group = group
        if self.gate_up_proj_packed.device.type == "cpu":
            self.int4_for_cpu()

    def int4_for_cpu(self) -> None:
        """Repack the loaded INT4 stacks for torch's CPU kernel (kernels/int4_experts.cpu_layout)."""
        for name in ("gate_up_proj", "down_proj"):
            codes, pairs = int4_experts.cpu_layout(getattr(self, name + "_packed"), getattr(self, name + "_scale"))
            setattr(self, name + "_packed", nn.Parameter(codes, requires_grad=False))
            setattr(self, name + "_scale", nn.Parameter(pairs, requires_grad=False))

    @property
    def num_local_experts(self) -> int:
        stack = self.gate_up_proj_packed if self.int4_group is not None else self.gate_up_proj
        return stack.shape[0]

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        # x: [N, H]; weights, experts: [N, k] -> [N, H]
        if self.first_expert is not None:
            # expert parallel: pairs routed to another rank's experts weigh 0 here (computed through
            # an expert of this rank, so the shapes stay those of the routing, never of its data)
            local = experts - self.first_expert
            mine = (local >= 0) & (local < self.num_local_experts)
            experts = local.clamp(0, self.num_local_experts - 1)
            weights = weights * mine
        if self.int4_group is not None:
            return self._int4_pairs(x, weights, experts)
        if self.fp8_block is not None:
            return self._fp8_pairs(x, weights, experts)
        if x.dtype == torch.bfloat16:
            return self._grouped(x, weights, experts)
        return self._gathered(x, weights, experts)

    def _grouped(self, x, weights, experts):
        n, k = experts.shape
        flat = experts.reshape(-1)
        order = flat.argsort(stable=True)                      # pairs grouped by expert
        token = order // k
        # group ends; scatter_add instead of bincount, whose output length depends on the data
        counts = torch.zeros(self.gate_up_proj.shape[0], dtype=torch.int32, device=x.device)
        counts = counts.scatter_add(0, flat, torch.ones_like(flat, dtype=torch.int32))
        ends = counts.cumsum(0, dtype=torch.int32)
        rows = x[token]                                                           # [N k, H]
        gate, up = F.grouped_mm(rows, self.gate_up_proj.transpose(1, 2), offs=ends).chunk(2, dim=-1)
        out = F.grouped_mm(F.silu(gate) * up, self.down_proj.transpose(1, 2), offs=ends)
        out = out * weights.reshape(-1)[order].unsqueeze(-1).to(out.dtype)
        # back to (token, choice) order, then each token's k rows summed in that order: `index_add`
        # would add them with atomics on CUDA, in bf16, in whatever order the threads land (GPU_NOTES 2)
        back = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
        return out[back].view(n, k, -1).sum(dim=1)

    def _fp8_pairs(self, x, weights, experts):
        # every (token, expert) pair through its expert's FP8 weights (kernels/block_fp8.py)
        n, k = experts.shape
        flat = experts.reshape(-1)
        rows = x.repeat_interleave(k, dim=0)                                          # [N k, H]
        pairs = torch.ops.specgen.block_fp8_pairs
        gate, up = pairs(rows, flat, self.gate_up_proj, self.gate_up_proj_scale_inv, self.fp8_block).chunk(2, dim=-1)
        out = pairs(F.silu(gate) * up, flat, self.down_proj, self.down_proj_scale_inv, self.fp8_block)
        return (out.view(n, k, -1) * weights.unsqueeze(-1).to(out.dtype)).sum(dim=1)

    def _int4_pairs(self, x, weights, experts):
        # every (token, expert) pair through its expert's packed INT4 weights (kernels/int4_experts.py)
        n, k = experts.shape
        flat = experts.reshape(-1)
        rows = x.repeat_interleave(k, dim=0)                                          # [N k, H]
        pairs, group = torch.ops.specgen.int4_pairs, self.int4_group
        gate, up = pairs(rows, flat, self.gate_up_proj_packed, self.gate_up_proj_scale, group).chunk(2, dim=-1)
        out = pairs(F.silu(gate) * up, flat, self.down_proj_packed, self.down_proj_scale, group)
        return (out.view(n, k, -1) * weights.unsqueeze(-1).to(out.dtype)).sum(dim=1)

    def _gathered(self, x, weights, experts):
        n, k = experts.shape
        flat = experts.reshape(-1)
        rows = x.repeat_interleave(k, dim=0).unsqueeze(-1)                      # [N k, H, 1]
        gate, up = torch.bmm(self.gate_up_proj[flat], rows).squeeze(-1).chunk(2, dim=-1)
        out = torch.bmm(self.down_proj[flat], (F.silu(gate) * up).unsqueeze(-1)).squeeze(-1)
        out = out.view(n, k, -1) * weights.unsqueeze(-1).to(out.dtype)
        return out.sum(dim=1)


class MoE(nn.Module):
    """`group`: the tensor-parallel group whose ranks hold the other slices (None: the whole block
    here); this rank's routed and shared partial sums are added over it in one all-reduce."""

    def __init__(self, cfg: MoeConfig, group=None) -> None:
        super().__init__()
        self.gate = Router(cfg)
        self.experts = RoutedExperts(cfg)
        self.shared_experts = (GatedMLP(cfg.hidden_size, cfg.shared_intermediate)
                               if cfg.n_shared_experts else None)
        self.group = group

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        # h: [B, T, H] -> [B, T, H]
        flat = h.reshape(-1, h.shape[-1])
        weights, experts = self.gate(flat)
        out = self.experts(flat, weights, experts).view_as(h)
        if self.shared_experts is not None:
            out = out + self.shared_experts(h)
        if self.group is not None:
            from torch.distributed import _functional_collectives as funcol

            out = funcol.all_reduce(out, "sum", self.group)
        return out


def keep_int4_experts(model: nn.Module, state: dict | None, group: int) -> nn.Module:
    """`model` (just built on the meta device) with each MoE whose state holds packed INT4 routed
    experts (`experts.gate_up_proj_packed`, checkpoints/quantized.py with `keep_int4`) holding them so."""
    for key in state or {}:
        if key.endswith("experts.gate_up_proj_packed"):
            model.get_submodule(key.removesuffix(".gate_up_proj_packed")).keep_int4(group)
    return model


def int4_experts_for_cpu(model: nn.Module) -> None:
    """After the load, on a CPU: every kept INT4 expert stack repacked for torch's CPU kernel."""
    for module in model.modules():
        if isinstance(module, RoutedExperts) and module.int4_group is not None:
            module.int4_for_cpu()


def stack_expert_keys(state: dict[str, torch.Tensor], prefix: str, num_experts: int) -> None:
    """Checkpoint experts `{prefix}experts.{e}.{gate,up,down}_proj.weight` -> our stacked
    `{prefix}experts.gate_up_proj [E, 2I, H]` and `{prefix}experts.down_proj [E, H, I]` (packed INT4:
    `..._packed` and `..._scale` stacks, the same rows), in place;
    `shared_experts.{gate,up}_proj` fused like a dense MLP. One layer at a time: at most one layer's
    experts are held twice while they are stacked."""
    first = f"{prefix}experts.0.gate_proj."
    kind = "weight_packed" if first + "weight_packed" in state else "weight"
    names = [f"{prefix}experts.{e}.{p}_proj.{kind}" for e in range(num_experts) for p in ("gate", "up", "down")]
    if not all(n in state for n in names):
        return   # missing keys are reported by the loader, with their names
    # block-FP8 weights kept as FP8 (models/fp8_layers.py) bring their scales, stacked alike (scales
    # first: they check their weights' rows); packed INT4 ones (kernels/int4_experts.py) their words
    # and scales, gate|up fused by rows as a dense weight is
    if first + "weight_packed" in state:
        kinds = {"weight_packed": "_packed", "weight_scale": "_scale"}
    elif first + "weight_scale_inv" in state:
        kinds = {"weight_scale_inv": "_scale_inv", "weight": ""}
    else:
        kinds = {"weight": ""}
    for kind, suffix in kinds.items():
        gate_up, down = [], []
        for e in range(num_experts):
            base = f"{prefix}experts.{e}."
            pair = [f"{base}gate_proj.{kind}", f"{base}up_proj.{kind}"]
            fp8_scales = kind == "weight_scale_inv"
            gate_up.append(fuse_scale_rows(state, pair) if fp8_scales else fuse_rows(*(state.pop(n) for n in pair)))
            down.append(state.pop(f"{base}down_proj.{kind}"))
        state[f"{prefix}experts.gate_up_proj{suffix}"] = torch.stack(gate_up)
        state[f"{prefix}experts.down_proj{suffix}"] = torch.stack(down)
    shared = f"{prefix}shared_experts."
    for kind in ("weight_scale_inv", "weight"):
        pair = [f"{shared}gate_proj.{kind}", f"{shared}up_proj.{kind}"]
        if all(n in state for n in pair):
            fused = fuse_scale_rows(state, pair) if kind != "weight" else fuse_rows(*(state.pop(n) for n in pair))
            state[f"{shared}gate_up_proj.{kind}"] = fused
