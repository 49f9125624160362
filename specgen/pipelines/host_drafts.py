"""Drafts made on the host (suffix drafting, a grammar's forced tokens), placed into the step's state.

Contract: `HostDrafts(proposer, state, batch_size, k_max, hybrid)`; `plan(live, k, policy, functions,
width, compiled)` asks the proposer for the live slots' proposals and returns (k, each slot's own
count of drafted tokens, whether the step is the host's alone):
- without a draft model: the policy's k for the proposals (`choose_host`; 0: a plain step), written
  into `pending[:, 1:k+1]` (a shorter proposal padded: its extra rows are verified like any draft,
  and a pad the target happens to choose is kept, losslessly);
- beside a draft model (a hybrid, pipelines/hybrid_policy.py): the policy's plan may do the same
  (host_only), or run the model's step of k drafts with some slots' rows replaced by their proposals
  (`host_drafts` / `host_use`, merged inside the compiled step).
The proposer's own bookkeeping (admit, extend, finish, move) is the runner's to call.
"""

from __future__ import annotations

import torch


class HostDrafts:
    def __init__(self, proposer, state, batch_size: int, k_max: int, hybrid: bool) -> None:
        self.proposer = proposer
        self.state = state
        self.batch_size = batch_size
        self.k_max = k_max
        self.hybrid = hybrid

    def plan(self, live: list[int], k: int, policy, functions, width: int,
             compiled: bool) -> tuple[int, dict[int, int], bool]:
        state = self.state
        if not self.hybrid:
            if k == 0:
                return 0, {}, False
            proposals = {b: self.proposer.propose(b, k) for b in live}
            k = policy.choose_host(proposals, width, functions.compiled_ks, compiled)
            if k == 0:
                return 0, {}, False
            state.pending[:, 1:k + 1].copy_(self.block(proposals, k, k))
            return k, {b: min(k, len(p)) for b, p in proposals.items()}, True
        proposals = {b: self.proposer.propose(b, self.k_max) for b in live}
        ready = {j for j in range(1, self.k_max + 1) if functions.verify_ready(j + 1)}
        plan = policy.decide(k, proposals, width, ready, compiled, functions.compiled_ks)
        k = plan.k
        if k == 0:
            return 0, {}, False
        used = {b: p for b, p in proposals.items() if b in plan.use}
        if plan.host_only:
            state.pending[:, 1:k + 1].copy_(self.block(used, k, k))
        else:
            state.host_drafts.copy_(self.block(used, k, self.k_max))
            state.host_use.copy_(torch.tensor([b in plan.use for b in range(self.batch_size)]))
        return k, {b: min(k, len(used[b])) if b in used else 0 if plan.host_only else k for b in live}, plan.host_only

    def block(self, proposals: dict, k: int, width: int) -> torch.Tensor:
        """[B, width] int64: each slot's first k proposed tokens, padded with 0."""
        block = [[0] * width for _ in range(self.batch_size)]
        for b, proposal in proposals.items():
            block[b][: min(k, len(proposal))] = proposal.tokens[:k]
        return torch.tensor(block)
