"""Structured output through every real draft method, with oracle proposals (issue 68).

test_structured.py holds the constraint's losslessness for EAGLE-3 beside Llama with a stand-in
draft; here each real draft runs every pass as in a job (test_oracle_drafts.py's `OracleProposals`:
its cache, the ring of target features, the catch-ups), but proposes the CONSTRAINED answer plain
decoding gives, spoiled at positions 0, 2, 3 mod 13. A spoiled draft is mostly one the grammar
refuses (a byte beside the right one), and it reaches the verify as it is (jump_forward off), so
every step mixes drafts the target accepts under the masks with drafts the grammar refuses at their
own rows. Covered: MTP beside DeepSeek-V3, DFlash beside Kimi K2.5, the MLA EAGLE-3 beside Kimi K2.5
(MLA targets all three), and a hybrid (EAGLE-3 + suffix proposals beside Llama); greedy and seeded
sampled, the output must be plain constrained decoding's.

And a reasoning span's close marker drafted in the middle of a step's K drafts: the grammar starts at
the row after it, within the same step (vLLM #36138 left those rows free), through the runner.
"""

from __future__ import annotations

import pytest
import torch
from test_deepseek_pairings import write_pairings
from test_oracle_drafts import OracleProposals
from test_speculative import OracleDraft, make_recipe, never_wrong
from test_structured import FORMATS, V, follows, generate, prompt_ids, structured_runner
from test_structured import models  # noqa: F401 (a fixture: Llama + EAGLE-3 at vocabulary 300)

import specgen.job.build as job_build
from specgen.pipelines.reasoning import ReasoningMarkers
from specgen.pipelines.runner import Runner
from specgen.pipelines.unified import UnifiedStep
from specgen.recipe import recipe_from_dict
from specgen.structured.grammar import SlotGrammar

# the JSON schema for most prompts, a choice for one: several grammars in one batch
KINDS = ("json_schema", "choice", "json_schema", "json_schema")


@pytest.fixture(scope="module")
def pairings(tmp_path_factory, models):  # noqa: F811
    pairs = write_pairings(tmp_path_factory.mktemp("structured-drafts"), V)   # byte ids 3..258 exist
    target, draft = models
    pairs["llama-eagle3+suffix"] = (target, "eagle3+suffix", draft, 3)
    return pairs


def recipe(target, method="none", draft=None, k=3, batch=4, **sampling):
    d = {"method": method}
    if method != "none":
        d["num_speculative_tokens"] = k
        if draft is not None:
            d["model"] = str(draft)
    return recipe_from_dict({
        "target": {"model": str(target), "dtype": "float32"}, "draft": d,
        "sampling": {"max_tokens": 96, "ignore_eos": False, "seed": 7, **sampling},
        "runtime": {"device": "cpu", "batch_size": batch, "max_seq_len": 128, "compile": False},
        "chat_template": False,
    })


def oracle_runner(recipe_, references, monkeypatch, jump_forward: bool = False):
    """`build_runner`'s structured runner (its policy, its host proposer for a hybrid), with the real
    draft it loads wrapped so that its picks are `references`' tokens, spoiled."""
    load = job_build.load_draft
    monkeypatch.setattr(job_build, "load_draft", lambda *a, **kw: OracleProposals(load(*a, **kw), references, V))
    try:
        return structured_runner(recipe_, jump_forward=jump_forward)
    finally:
        monkeypatch.setattr(job_build, "load_draft", load)


NAMES = ("deepseek-mtp", "kimi-dflash", "kimi-eagle3-mla", "llama-eagle3+suffix")
CASES = [(name, sampled) for name in NAMES for sampled in (False, True)]


@pytest.mark.parametrize(("name", "sampled"), CASES,
                         ids=[f"{n}-{'sampled' if s else 'greedy'}" for n, s in CASES])
def test_a_real_draft_proposing_the_constrained_answer_keeps_plain_constrained_output(
        pairings, name, sampled, monkeypatch):
    target, method, draft, k = pairings[name]
    sampling = {"temperature": 0.8, "top_p": 0.9} if sampled else {}
    ids = prompt_ids(4)
    formats = [FORMATS[kind] for kind in KINDS]
    plain = generate(structured_runner(recipe(target, **sampling), jump_forward=False), ids, formats)
    for i, kind in enumerate(KINDS):
        assert not isinstance(plain[f"p{i}"], str), plain[f"p{i}"]
        tokens, text, reason = plain[f"p{i}"]
        assert reason == "stop" and follows(kind, text), (kind, text, reason)
    references = {tuple(p[1:]): p + plain[f"p{i}"][0] for i, p in enumerate(ids)}
    runner = oracle_runner(recipe(target, method, draft, k, **sampling), references, monkeypatch)
    assert generate(runner, ids, formats) == plain
    totals = runner.totals
    histogram = totals.spec.acceptance_histogram
    # acceptances happen, whole blocks too, and so do drafts the grammar refuses (the spoiled ones)
    assert totals.spec.num_accepted_tokens > 0 and histogram[k] > 0, histogram
    assert totals.refused_drafts > 0 and totals.grammar_drafts == 0
    if "+" in method:     # a hybrid: both the model's blocks and the host's were verified
        blocks = runner.policy.blocks
        assert blocks["host"] > 0 and blocks["model"] > 0, runner.policy.summary()


# ------------------------------------------------------------------ a close marker drafted mid-window

EOS = (2, 3)        # the tiny Llama config's


def reasoning_runner(base: Runner, markers: ReasoningMarkers, draft=None) -> Runner:
    """`base`'s target, rules, sampling and grammar engine, with reasoning markers chosen by the test
    (a real run finds them by string in the tokenizer) and `draft` (None: plain decoding)."""
    step = UnifiedStep(base.unified.target, draft, structured=True)
    return Runner(step, batch_size=base.batch_size, max_seq_len=base.max_seq_len, rules=base.rules,
                  sampling=base.sampling, seed=base.seed, device=base.device, dtype=torch.float32,
                  reasoning=markers, grammar=base.grammar)


def mid_window_close(outputs: dict, k: int, exclude: set[int]) -> int:
    """A token to play the close marker: one whose first appearance in a plain output falls where a
    step of k drafts, all accepted, drafts it neither first nor last (output index i holds draft
    i mod (k + 1), 0 being the step's committed token). The one that does so in most outputs."""
    votes: dict[int, int] = {}
    for tokens, _, _ in outputs.values():
        first: dict[int, int] = {}
        for i, t in enumerate(tokens[:40]):
            first.setdefault(t, i)
        for t, i in first.items():
            if 1 < i % (k + 1) < k and t not in exclude:
                votes[t] = votes.get(t, 0) + 1
    assert votes, "no output gives a token for the close marker"
    return max(votes, key=lambda t: (votes[t], t))


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_a_close_marker_drafted_mid_window_starts_the_grammar_at_the_next_row(models, sampled, monkeypatch):
    """Prompts that open a reasoning span, then a choice after it. The oracle proposes plain constrained
    decoding's output, all right, so each step commits K + 1 tokens and the close marker is drafted
    in the middle of a block, with the first tokens of the answer after it in the same block: their
    rows must carry the grammar's masks, which `fill` starts at the drafted marker (the slot's
    committed state is still inside the span). The output is plain decoding's; and with the drafted
    marker unseen (the rows after it left free: the bug), it is not."""
    target, _ = models
    k = 3
    sampling = {"temperature": 0.8, "top_p": 0.9} if sampled else {}
    base = structured_runner(make_recipe(target, batch=4, ignore_eos=False, **sampling), jump_forward=False)
    ids = prompt_ids(6)
    before = generate(base, ids, None)
    used = {t for tokens, _, _ in before.values() for t in tokens}
    think = next(t for t in range(V - 1, 258, -1) if t not in used)      # an opening marker never emitted
    opened = [p + [think] for p in ids]
    free = generate(base, opened, None)           # the reasoning, as plain decoding writes it
    close = mid_window_close(free, k, {think, *EOS})
    markers = ReasoningMarkers(think, close)
    fmt = FORMATS["choice"]
    plain = generate(reasoning_runner(base, markers), opened, fmt)
    closed = 0
    for i, p in enumerate(opened):
        tokens, text, reason = plain[f"p{i}"]
        if close in tokens:          # the answer, after the span, follows the format
            closed += 1
            assert tokens[: tokens.index(close) + 1] == free[f"p{i}"][0][: tokens.index(close) + 1]
            assert reason == "stop" and follows("choice", text), (text, reason)
    assert closed >= 1
    references = {tuple(p[1:]): p + plain[f"p{i}"][0] for i, p in enumerate(opened)}

    def speculative():
        runner = reasoning_runner(base, markers, OracleDraft(references, k, V, never_wrong))
        mid = []                        # (slot, index among the drafts) of a drafted close, mid-window
        write = runner._write_masks

        def spy(kk: int) -> None:       # after the draft, before the masks and the verify
            drafts = runner.state.pending[:, 1:kk + 1].tolist()
            for b, grammar in runner.grammars.states.items():
                if grammar.thinking and close in drafts[b][1:kk - 1]:
                    mid.append((b, drafts[b].index(close)))
            write(kk)

        runner._write_masks = spy
        return generate(runner, opened, fmt), runner, mid

    got, runner, mid = speculative()
    assert got == plain
    assert mid and runner.totals.spec.acceptance_histogram[k] > 0, (mid, runner.totals.spec.acceptance_histogram)
    # negative control: `fill` blind to a drafted close leaves the rows after it free
    fill = SlotGrammar.fill

    def blind(self, masks, drafts, jump_forward=False):
        closes, self.closes = self.closes, frozenset()
        try:
            return fill(self, masks, drafts, jump_forward)
        finally:
            self.closes = closes

    monkeypatch.setattr(SlotGrammar, "fill", blind)
    wrong, _, mid = speculative()
    assert mid and wrong != plain
