"""The draft's state in a job is what teacher forcing over the committed tokens gives.

A broken accept path, a catch-up that skips positions, or a ring entry of the wrong position leaves
the output lossless (verification decides every token) and only lowers acceptance: no equality test
sees it. Here each real draft (EAGLE-3 beside Llama, the MLA EAGLE-3 beside Kimi K2.5, DFlash beside
Kimi K2.5, MTP beside DeepSeek-V3, and EAGLE-3 beside DeepSeek-V3) runs a job whose drafts are
plain decoding's tokens, spoiled at chosen positions (test_oracle_drafts.py), so blocks of every
acceptance length happen; a scripted policy puts plain steps (k = 0) between drafted ones, short runs
(the draft catches up from the ring) and one longer than the draft's window (`max_window`); a hybrid
adds host proposals that are the reference continuation, in host-only steps (the draft does not run)
and mixed steps, again for longer than the window (the runner has the draft absorb alone before a
step without it would leave a slot further behind: runner._issue). Before every step, for every
live slot:

- the draft cache's entries for positions < `draft_len` equal those of ONE absorption pass from an
  empty cache over the committed tokens, with the target features of a teacher-forced target pass
  (the prefill's call: `draft.propose(features, next_tokens, positions, last, cache, attn, pick, 0)`);
- the ring holds the features and tokens of the positions the next catch-up may read (the last
  `max_window`: the newer ring entries may hold a verify's scratch rows);
- the draft is at most `max_window` positions behind (a catch-up reads no further back).

Tolerance: float32, rtol = atol = 1e-4. The job computes each feature in a verify of k + 1 rows and
each draft entry in a pass of W rows beside other slots; the recomputation does both in one pass of
the whole sequence. A GEMM's sums depend on its row count (blocking), so the two agree to a few 1e-6
(measured: 3.4e-6 at most over these pairings), not bit for bit. Each entry depends on its own position's feature and next token only (the first layer's
keys and values, DFlash's context), so a stale or skipped entry is off by O(1) (or is a previous
request's), far outside the tolerance.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from model_calls import attn
from test_deepseek_pairings import recipe, write_pairings
from test_oracle_drafts import VOCAB, OracleProposals
from test_speculative import make_recipe, models, prompts, references_of, run, runner_for  # noqa: F401

from specgen.drafts.suffix import NO_PROPOSAL, Proposal
from specgen.pipelines.host_policy import HostDraftPolicy
from specgen.pipelines.hybrid_policy import HybridPolicy, Plan
from specgen.pipelines.policy import AdaptivePolicy, FixedPolicy
from specgen.pipelines.runner import Runner
from specgen.pipelines.unified import UnifiedStep

MAX_SEQ_LEN = 200
TOLERANCE = {"rtol": 1e-4, "atol": 1e-4}
NAMES = ("llama-eagle3", "deepseek-eagle3", "kimi-eagle3-mla", "kimi-dflash", "deepseek-mtp")


@pytest.fixture(scope="module")
def pairings(tmp_path_factory, models):  # noqa: F811
    pairs = write_pairings(tmp_path_factory.mktemp("draft-state"), VOCAB)
    target, draft = models
    pairs["llama-eagle3"] = (target, "eagle3", draft, 3)
    return pairs


def real_runner(pairings, name, with_draft=True) -> Runner:
    target, method, draft, k = pairings[name]
    if name == "llama-eagle3":
        chosen = make_recipe(target, draft if with_draft else None, k=k, batch=2)
    else:
        chosen = recipe(target, method, draft, k, batch=2) if with_draft else recipe(target, batch=2)
    # the draft in float32 too (its `auto` takes bf16 on CPUs that multiply it)
    return runner_for(replace(chosen, draft=replace(chosen.draft, dtype="float32")))


def rebuilt(real: Runner, step: UnifiedStep, **settings) -> Runner:
    """`real`'s settings with a longer max_seq_len (plain runs of more than the draft's window)."""
    return Runner(step, batch_size=real.batch_size, max_seq_len=MAX_SEQ_LEN, rules=real.rules,
                  sampling=real.sampling, seed=real.seed, device=real.device, dtype=torch.float32, **settings)


class Script(FixedPolicy):
    """k on every step but the step numbers in `plain` (k = 0); `check(views)` before each step."""

    def __init__(self, k: int, plain=(), check=None) -> None:
        super().__init__(k)
        self.plain, self.check, self.step = set(plain), check, -1

    def choose(self, slots, available=None, width=None) -> int:
        self.step += 1
        if self.check is not None:
            self.check(slots)
        return 0 if self.step in self.plain else self.k


class ScriptedHybrid(HybridPolicy):
    """A pinned-K hybrid whose plans are scripted by step number: the host's proposals alone on
    `host_only` steps, the model's step with the host's block for every slot that has one on `mixed`
    steps, else the model's step (or a plain step where the model's script says so)."""

    def __init__(self, model: Script, host_only=(), mixed=()) -> None:
        k = model.k
        super().__init__(model, HostDraftPolicy(k), AdaptivePolicy(k, [0.5] * k))
        self.host_only, self.mixed = set(host_only), set(mixed)

    def decide(self, k, proposals, width, ready, compiled, model_ready=frozenset()) -> Plan:
        step, offered = self.model.step, {b for b, p in proposals.items() if len(p)}
        plan = (Plan(0) if k == 0 else Plan(k, host_only=True, use=offered) if step in self.host_only
                else Plan(k, use=offered) if step in self.mixed else Plan(k))
        self.steps["host" if plan.host_only else "plain" if plan.k == 0 else "mixed" if plan.use else "model"] += 1
        self.plan = plan
        return plan


class OracleProposer:
    """Host proposals that are the reference continuation (never wrong): a host-only step accepts
    all it verifies. The runner's proposer interface (drafts/suffix.py SuffixProposer)."""

    def __init__(self, slots: int, references: dict[tuple, list[int]]) -> None:
        self.references, self.context = references, [None] * slots

    def reset(self, job=None) -> None:
        self.context = [None] * len(self.context)

    def admit(self, slot, prompt_ids) -> None:
        self.context[slot] = (self.references[tuple(prompt_ids[1:])], len(prompt_ids), list(prompt_ids))

    def extend(self, slot, tokens) -> None:
        if self.context[slot] is not None:
            self.context[slot][2].extend(tokens)

    def finish(self, slot) -> None:
        self.context[slot] = None

    def move(self, src, dst) -> None:
        self.context[dst], self.context[src] = self.context[src], None

    def propose(self, slot, k) -> Proposal:
        if self.context[slot] is None:
            return NO_PROPOSAL
        sequence, prompt_len, seen = self.context[slot]
        if len(seen) == prompt_len:       # the first token is on the device only (as for suffix drafting)
            return NO_PROPOSAL
        tokens = tuple(sequence[len(seen): len(seen) + k])
        return Proposal(tokens, (0.9,) * len(tokens))


class DraftStateCheck:
    """Before each step (called by the policy with the live slots' views): every live slot's draft
    cache and ring against a teacher-forced recomputation."""

    def __init__(self, references: dict[tuple, list[int]]) -> None:
        self.prompt_len = {tuple(seq): len(key) + 1 for key, seq in references.items()}
        self.runner: Runner | None = None
        self.checks = 0
        self.resumed_after_catch_up = False     # a check compared entries the runner's catch-up wrote
        self._last: dict[int, tuple[int, int]] = {}   # slot -> (draft_len, catch-ups) at its last check

    def __call__(self, views) -> None:
        for view in views:
            self.slot(view.slot)

    @torch.inference_mode()
    def slot(self, b: int) -> None:
        runner = self.runner
        unified, state = runner.unified, runner.state
        oracle_cache = runner.caches.draft
        draft = unified.draft.draft                      # the real draft inside the oracle
        lens, absorbed = int(state.cache_lens[b]), int(state.draft_len[b])
        row = oracle_cache.table[b].tolist()
        prompt_len = next(n for seq, n in self.prompt_len.items() if row[: len(seq)] == list(seq))
        sequence = row[: lens + 1]                       # committed tokens: positions 0..lens
        # the target's features of positions 0..lens-1, teacher-forced in one pass
        target = unified.target
        positions = torch.arange(lens).unsqueeze(0)
        one = torch.tensor([0])
        cache = target.new_cache(1, lens + 8, torch.float32, "cpu")
        _, aux = target(torch.tensor([sequence[:lens]]), positions, cache, attn(positions, lens, one),
                        capture=unified.capture)
        # the draft absorbs positions 0..absorbed-1 in one pass from an empty cache (the prefill's call)
        fresh = draft.new_cache(1, lens + 8, torch.float32, "cpu")
        where = positions[:, :absorbed]
        draft.propose(aux[:, :absorbed], torch.tensor([sequence[1: absorbed + 1]]), where,
                      torch.tensor([absorbed - 1]), fresh, attn(where, lens, one),
                      lambda logits, position: (logits.argmax(-1), None), 0)
        for got, want in zip(oracle_cache.inner.tensors(), fresh.tensors(), strict=True):
            torch.testing.assert_close(got[b, :, :absorbed], want[0, :, :absorbed], **TOLERANCE,
                                       msg=lambda m: f"slot {b}: draft cache (positions < {absorbed}, "
                                                     f"committed {lens}) differs from teacher forcing\n{m}")
        # the ring: what the next catch-up may read (features of positions p, tokens at p + 1)
        ring, window = unified.ring_len, unified.max_window
        features = torch.arange(max(prompt_len - 1, lens - window), lens)
        torch.testing.assert_close(state.features[b, features % ring], aux[0, features], **TOLERANCE,
                                   msg=lambda m: f"slot {b}: ring features differ\n{m}")
        tokens = torch.arange(max(prompt_len, lens - window), lens + 1)
        want = [sequence[q] for q in tokens.tolist()]
        assert state.tokens[b, tokens % ring].tolist() == want, f"slot {b}: ring tokens"
        # and what the draft has not read is within its catch-up's reach
        assert lens - absorbed <= window, (f"slot {b}: the draft is {lens - absorbed} positions behind, "
                                           f"its catch-up reads {window}")
        self.checks += 1
        catch_ups = runner.totals.catch_ups
        before = self._last.get(b)
        if before is not None and catch_ups > before[1] and absorbed > before[0]:
            self.resumed_after_catch_up = True
        self._last[b] = (absorbed, catch_ups)


def oracle_job(pairings, name, policy_of, max_tokens, hybrid=False):
    """Plain decoding's output of three prompts (batch 2: one refill), then the job with oracle drafts
    under the policy `policy_of(k, check)` (and, for a hybrid, oracle host proposals): its check's
    counters and the runner."""
    ids = prompts(lengths=(5, 9, 3))
    plain_real = real_runner(pairings, name, with_draft=False)
    plain, _ = run(rebuilt(plain_real, plain_real.unified), ids, max_tokens=max_tokens)
    references = references_of(ids, plain)
    real = real_runner(pairings, name)
    step = UnifiedStep(real.unified.target, OracleProposals(real.unified.draft, references), host_drafts=hybrid)
    check = DraftStateCheck(references)
    k = real.unified.k
    runner = rebuilt(real, step, policy=policy_of(k, check),
                     proposer=OracleProposer(real.batch_size, references) if hybrid else None)
    check.runner = runner
    got, totals = run(runner, ids, max_tokens=max_tokens)
    assert got == plain
    return check, runner, totals


@pytest.mark.parametrize("name", NAMES)
def test_draft_state_is_teacher_forced_after_blocks_and_plain_runs(pairings, name):
    """Drafted steps of every acceptance length, two short plain runs (the draft catches up from the
    ring) and one of 70 plain steps, longer than the draft's window."""
    long_run = range(22, 92)
    plain = {5, 6, 7, 14, *long_run}
    check, runner, totals = oracle_job(pairings, name, lambda k, check: Script(k, plain, check), max_tokens=150)
    k = runner.unified.k
    histogram = totals.spec.acceptance_histogram
    assert histogram[0] > 0 and histogram[k] > 0, histogram
    assert totals.k_steps[0] >= len(long_run) and totals.k_steps[k] > 10, totals.k_steps
    # the long run went past the window, and slots drafted after it (checked: the catch-up's work)
    assert totals.catch_ups > 0 and check.resumed_after_catch_up, (totals.catch_ups, check.resumed_after_catch_up)


@pytest.mark.parametrize("name", ("llama-eagle3", "kimi-eagle3-mla", "kimi-dflash", "deepseek-mtp"))
def test_draft_state_is_teacher_forced_after_hybrid_host_only_blocks(pairings, name):
    """A hybrid at pinned K: model steps, host-only steps (the draft does not run), mixed steps, and a
    run of 30 host-only steps that accept every proposal: K + 1 positions each, far more than the
    draft's window. The draft's state stays current through all of them (DESIGN.md section 7)."""
    host_only = {3, 4, *range(12, 36)}
    mixed = {6, 7, 9}

    def policy_of(k, check):
        return ScriptedHybrid(Script(k, {10}, check), host_only, mixed)

    check, runner, totals = oracle_job(pairings, name, policy_of, max_tokens=160, hybrid=True)
    k = runner.unified.k
    steps = runner.policy.steps
    assert steps["host"] >= 24 and steps["mixed"] > 0 and steps["model"] > 5, steps
    # the host-only run accepted whole blocks: more positions than the draft's window in a row, and
    # slots drafted after it
    assert totals.spec.acceptance_histogram[k] >= 24, totals.spec.acceptance_histogram
    assert totals.catch_ups > 0 and check.resumed_after_catch_up, (totals.catch_ups, check.resumed_after_catch_up)
