"""Reasoning spans and relaxed acceptance (Kimi K2.5 / DeepSeek-style `<think> ... </think>`).

- the span rule: markers found by string, the start state from the prompt, `split` for records, and
  the device version (`states_after`) agreeing with it;
- the relaxed rule (top-k, delta, markers never relaxed, a `</think>` inside a block makes the rest
  strict) and `verify` with a relaxed mask, kernel == reference;
- end to end on the tiny Kimi K2.5 target with its MLA EAGLE-3 draft: relaxed acceptance changes
  nothing outside reasoning (greedy and seeded sampled output == plain), accepts more inside, is
  strict again after `</think>`, and runs inside one fullgraph step;
- `specgen run`: `reasoning_text` split from `text`, the template's thinking switch, the statistics,
  and clear errors where relaxed acceptance cannot apply.
"""

from __future__ import annotations

import json
import os
import random

import pytest
import torch
from checkpoints import tiny_llama_config, write_llama_checkpoint
from checkpoints_deepseek import KIMI_LIKE_TEMPLATE, write_tiktoken_tokenizer
from test_deepseek_pairings import recipe, write_pairings
from test_speculative import prompts, run, runner_for

from specgen.pipelines.reasoning import ReasoningMarkers, split, start_state, states_after
from specgen.pipelines.relaxed import RelaxedAcceptance
from specgen.pipelines.requests import Request
from specgen.pipelines.runner import Runner
from specgen.pipelines.unified import UnifiedStep
from specgen.pipelines.verify import verify

OPEN, CLOSE, TOOL = 70, 71, 72          # marker ids of the unit tests (found by string in real runs)
MARKERS = ReasoningMarkers(OPEN, CLOSE, (TOOL,))


# ------------------------------------------------------------------------------------- the span rule

def test_markers_are_found_by_string_never_by_id():
    kimi = {"<think>": 9001, "</think>": 17, "<|tool_calls_section_begin|>": 5}
    assert ReasoningMarkers.from_vocab(kimi) == ReasoningMarkers(9001, 17, (5,))
    deepseek = {"<think>": 128821, "</think>": 128822, "<｜tool▁calls▁begin｜>": 128806}   # V4 numbering
    assert ReasoningMarkers.from_vocab(deepseek) == ReasoningMarkers(128821, 128822, (128806,))
    assert ReasoningMarkers.from_vocab({"<think>": 3}) is None          # no closing marker: no parser
    assert ReasoningMarkers.from_vocab({"<|im_start|>": 1}) is None


@pytest.mark.parametrize("prompt,state", [
    ([5, 6, OPEN], True),                        # thinking template: the prompt opens the span
    ([5, OPEN, CLOSE], False),                   # instant mode: <think></think>
    ([OPEN, 5, CLOSE, 6, OPEN], True),           # an earlier turn's closed span, then a new one
    ([OPEN, 5, TOOL, 6], False),                 # a tool call closed it
    ([5, 6, 7], None),                           # no marker: unknown
])
def test_start_state_is_the_prompts_last_marker(prompt, state):
    assert start_state(prompt, MARKERS) is state


a, b, c, d = 10, 11, 12, 13


@pytest.mark.parametrize("start,tokens,reasoning,content", [
    (True, [a, b, CLOSE, c], [a, b], [c]),                    # opened by the prompt
    (True, [a, b], [a, b], []),                               # still thinking when it stopped
    (None, [OPEN, a, CLOSE, b], [a], [b]),                    # explicit span in the output
    (None, [a, b, CLOSE, c], [a, b], [c]),                    # implicit start: </think> says so
    (None, [a, b], [], [a, b]),                               # no marker at all: content
    (None, [a, OPEN, b, CLOSE, c], [b], [a, c]),              # text before an explicit <think>
    (True, [a, TOOL, b, c], [a], [TOOL, b, c]),               # a tool call ends it, and stays
    (None, [a, TOOL, b], [], [a, TOOL, b]),                   # a tool call alone implies no span
    (False, [a, OPEN, b, CLOSE, c, OPEN, d], [b, d], [a, c]),  # two spans
])
def test_split_places_reasoning_and_markers(start, tokens, reasoning, content):
    parts = split(tokens, MARKERS, start)
    assert (parts.reasoning, parts.content) == (reasoning, content)
    assert parts.ends_in_reasoning == (tokens[-1] in reasoning)


def test_device_states_follow_the_same_rule_as_split():
    """`states_after` (the step's per-row flag) and `split` (the records) are one rule: a non-marker
    token is reasoning iff the state before it says so."""
    rng = random.Random(0)
    alphabet = [a, b, c, OPEN, CLOSE, TOOL]
    for _ in range(200):
        tokens = [rng.choice(alphabet) for _ in range(rng.randint(1, 9))]
        before = rng.random() < 0.5
        after = states_after(torch.tensor([tokens]), torch.tensor([before]), MARKERS)[0].tolist()
        state_before = [before, *after[:-1]]
        expected = [t for t, s in zip(tokens, state_before) if s and t not in MARKERS.all]
        assert split(tokens, MARKERS, before)[0] == expected, (tokens, before)
        # and the state after the block is the prompt-style state of everything seen
        assert after[-1] == (start_state(tokens, MARKERS) if start_state(tokens, MARKERS) is not None
                             else before)


# ------------------------------------------------------------------------------------ the relaxed rule

def _logprobs_with(probs: list[float], rows: int, V: int = 80) -> torch.Tensor:
    """[1, rows + 1, V] log-probabilities whose tokens 0.. have `probs` (the rest share what is left)."""
    p = torch.full((V,), (1 - sum(probs)) / (V - len(probs)))
    p[: len(probs)] = torch.tensor(probs)
    return p.log().expand(1, rows + 1, V).contiguous()


def test_relaxed_candidates_are_top_k_and_within_delta():
    lp = _logprobs_with([0.5, 0.3, 0.1], rows=4)
    inside = torch.ones(1, 4, dtype=torch.bool)
    drafts = torch.tensor([[0, 1, 2, 5]])                     # ranks 0, 1, 2 and a tail token
    assert RelaxedAcceptance(2, 0.25, MARKERS).mask(lp, drafts, inside).tolist() == [[True, True, False, False]]
    assert RelaxedAcceptance(3, 0.25, MARKERS).mask(lp, drafts, inside).tolist() == [[True, True, False, False]]
    assert RelaxedAcceptance(3, 0.45, MARKERS).mask(lp, drafts, inside).tolist() == [[True, True, True, False]]
    outside = torch.zeros(1, 4, dtype=torch.bool)
    assert not RelaxedAcceptance(3, 0.45, MARKERS).mask(lp, drafts, outside).any()
    # structural tokens: an EOS draft is never relaxed, nor any draft where the target's top-1 is
    # a marker or EOS (relaxation must not hold off the end of a span or of the output)
    eos = RelaxedAcceptance(3, 0.45, MARKERS, eos_ids=(1,))
    assert eos.mask(lp, drafts, inside).tolist() == [[True, False, True, False]]   # token 1 is EOS
    plain = _logprobs_with([0.3, 0.25], rows=4)
    close_first = plain.clone()
    close_first[..., [0, CLOSE]] = plain[..., [CLOSE, 0]]            # `</think>` is the top-1
    drafts = torch.tensor([[1, 1, 1, 1]])
    assert RelaxedAcceptance(3, 0.45, MARKERS).mask(plain, drafts, inside).all()
    assert not RelaxedAcceptance(3, 0.45, MARKERS).mask(close_first, drafts, inside).any()
    # greedy rows carry raw logits: the rule reads softmax at temperature 1 (logits shifted alike)
    assert torch.equal(RelaxedAcceptance(3, 0.45, MARKERS).mask(lp + 7.0, drafts, inside),
                       RelaxedAcceptance(3, 0.45, MARKERS).mask(lp, drafts, inside))


def test_markers_are_never_relaxed_and_end_the_span_inside_a_block():
    relaxed = RelaxedAcceptance(80, 1.0, MARKERS)            # everything else qualifies
    lp = _logprobs_with([], rows=3)

    def mask(pending, before):
        pending = torch.tensor([pending])
        inside = states_after(pending, torch.tensor([before]), MARKERS)[:, :3]
        return relaxed.mask(lp, pending[:, 1:], inside)[0].tolist()

    assert mask([a, b, c, d], True) == [True, True, True]
    assert mask([a, CLOSE, c, d], True) == [False, False, False]     # the marker, then strict
    assert mask([a, b, CLOSE, d], True) == [True, False, False]
    assert mask([a, b, TOOL, d], True) == [True, False, False]
    assert mask([a, b, OPEN, d], False) == [False, False, True]      # opens inside the block


def test_verify_accepts_relaxed_drafts_and_counts_only_those():
    torch.manual_seed(0)
    B, K, V = 2, 3, 50
    logits = torch.randn(B, K + 1, V)
    y = logits.argmax(-1)
    drafts = torch.stack([torch.stack([(y[0, 0] + 1) % V, y[0, 1], (y[0, 2] + 1) % V]),
                          y[1, :K]])                               # row 0: wrong, right, wrong
    greedy = torch.ones(B, dtype=torch.bool)
    key, positions = torch.zeros(B, dtype=torch.long), torch.arange(K + 1).expand(B, K + 1) + 4
    strict = verify(logits, drafts, None, greedy, key, positions)
    assert strict[0].tolist() == [0, K] and strict[2].tolist() == [0, 0]
    relaxed = torch.tensor([[True, False, False], [True, True, False]])
    accepted, emitted, only_relaxed = verify(logits, drafts, None, greedy, key, positions, relaxed=relaxed)
    # row 0: draft 0 only by relaxation, draft 1 strictly, draft 2 rejected -> corrected to argmax
    assert accepted.tolist() == [2, K] and only_relaxed.tolist() == [1, 0]
    assert emitted[0].tolist() == [drafts[0, 0].item(), y[0, 1].item(), y[0, 2].item(), -1]
    assert torch.equal(emitted[1], strict[1][1])                     # relaxed where strict accepts anyway
    none = verify(logits, drafts, None, greedy, key, positions, relaxed=torch.zeros(B, K, dtype=torch.bool))
    assert all(torch.equal(x, s) for x, s in zip(none, strict))
    fast = verify(logits, drafts, None, greedy, key, positions, relaxed=relaxed, all_greedy=True)
    assert all(torch.equal(x, s) for x, s in zip(fast, (accepted, emitted, only_relaxed)))


@pytest.mark.parametrize("mode,stochastic", [("mixed", False), ("sampled", True), ("greedy", False)])
def test_kernel_matches_reference_with_relaxed_acceptance(mode, stochastic):
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from test_rejection_kernel import _case, vocabulary_blocks

    from specgen.kernels import keyed_noise, rejection

    if not keyed_noise.triton_available():
        pytest.skip("triton is not installed")
    args = _case(12, 3, 37, mode, stochastic, seed=11)
    g = torch.Generator().manual_seed(12)
    relaxed = (torch.rand(12, 3, generator=g) < 0.4).to(args[0].device)
    ref = rejection.verify_reference(*args, relaxed)
    with vocabulary_blocks(16):
        kernel = rejection.verify_triton(*args, relaxed)
    assert all(torch.equal(k, r) for k, r in zip(kernel, ref))
    strict = rejection.verify_reference(*args)
    assert ref[2].sum() > 0 and (ref[0] >= strict[0]).all()


# --------------------------------------------------------------------------------------- end to end

@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    """The tiny Kimi K2.5 target with its MLA EAGLE-3 draft (test_deepseek_pairings)."""
    target, _, draft, _ = write_pairings(tmp_path_factory.mktemp("reasoning"), 96)["kimi-eagle3-mla"]
    return target, draft


def relaxed_runner(recipe_, markers: ReasoningMarkers, top_k: int = 96, delta: float = 1.0,
                   relaxed: bool = True) -> Runner:
    """The recipe's runner with reasoning markers chosen by the test (a real run finds them by string
    in the tokenizer) and relaxed acceptance; top_k = V and delta = 1 relax every non-marker draft."""
    base = runner_for(recipe_)
    rule = RelaxedAcceptance(top_k, delta, markers) if relaxed else None
    step = UnifiedStep(base.unified.target, base.unified.draft, relaxed=rule)
    return Runner(step, batch_size=base.batch_size, max_seq_len=base.max_seq_len, rules=base.rules,
                  sampling=base.sampling, seed=base.seed, device=base.device, dtype=torch.float32,
                  reasoning=markers)


def completions(runner: Runner, prompt_ids, max_tokens=24):
    done = {}
    runner.run([Request(f"p{i}", p, max_tokens, request_key=1000 + i) for i, p in enumerate(prompt_ids)],
               lambda c: done.setdefault(c.id, c))
    return done


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "top_p": 0.9}], ids=["greedy", "sampled"])
def test_relaxed_acceptance_changes_nothing_outside_reasoning(kimi, sampling):
    """Prompts that close their span (instant mode), and an opening marker the target never emits:
    every block is verified strictly, so the output is the plain output token for token."""
    target, draft = kimi
    for think in range(95, 80, -1):     # an opening marker these prompts' plain outputs never hold
        closed = [p + [think, 3] for p in prompts()]
        plain, _ = run(runner_for(recipe(target, **sampling)), closed)
        if think not in {t for tokens in plain.values() for t in tokens}:
            break
    markers = ReasoningMarkers(think, 3)
    spec, totals = run(relaxed_runner(recipe(target, "eagle3", draft, 3, **sampling), markers), closed)
    assert spec == plain
    assert totals.spec.num_drafts > 0 and totals.spec.num_relaxed_accepted_tokens == 0


def test_relaxed_acceptance_inside_reasoning_accepts_more_then_is_strict_after_the_span(kimi):
    """Prompts that open a span. Inside it drafts among the target's top 8 within 0.8 of its top-1
    are accepted, so the reasoning is no longer the target's greedy output (lossy, and counted). The
    target's favourite token plays `</think>`: once it is emitted, what follows is exactly plain
    greedy decoding of the prompt plus everything before it."""
    target, draft = kimi
    think, end = 94, 3                  # 3: the tiny target's attractor (it emits it often)
    markers = ReasoningMarkers(think, end)
    opened = [p + [think] for p in prompts(lengths=(3, 11, 6, 17, 1, 8, 5, 9))]
    strict, strict_totals = run(relaxed_runner(recipe(target, "eagle3", draft, 3, batch=8), markers,
                                               relaxed=False), opened, max_tokens=32)
    runner = relaxed_runner(recipe(target, "eagle3", draft, 3, batch=8), markers, top_k=8, delta=0.8)
    done = completions(runner, opened, max_tokens=32)
    totals = runner.totals.spec
    assert totals.num_relaxed_accepted_tokens > 0
    assert totals.mean_acceptance_length > strict_totals.spec.mean_acceptance_length
    assert {c.id: c.token_ids for c in done.values()} != strict        # lossy inside the span
    continuations = {}
    for i, prompt in enumerate(opened):
        tokens = done[f"p{i}"].token_ids
        assert done[f"p{i}"].num_reasoning_tokens == len(split(tokens, markers, True)[0])
        if end not in tokens[:-1]:
            continue
        # strict from the first `</think>` through the next `<think>` (itself verified strictly)
        j = tokens.index(end)
        k = tokens.index(think, j) if think in tokens[j:] else len(tokens) - 1
        continuations[i] = (prompt + tokens[: j + 1], tokens[j + 1: k + 1])
    assert len(continuations) >= 2, "too few outputs closed their span to test what follows"
    base = runner_for(recipe(target, batch=8))
    for i, (prefix, tail) in continuations.items():
        plain, _ = run(base, [prefix], max_tokens=len(tail))
        assert plain["p0"] == tail, f"prompt {i}: not strict after </think>"


def test_relaxed_step_is_one_fullgraph_function(kimi):
    """The reasoning flag and the relaxed mask live inside the step: it traces as one graph (a host
    synchronisation would break it) and gives the eager step's tokens."""
    target, draft = kimi
    markers = ReasoningMarkers(94, 3)
    opened = [p + [94] for p in prompts(lengths=(3, 6))]
    eager = completions(relaxed_runner(recipe(target, "eagle3", draft, 3, batch=2), markers), opened, 10)
    runner = relaxed_runner(recipe(target, "eagle3", draft, 3, batch=2), markers)
    torch._dynamo.reset()        # earlier tests compiled this code object with other draft shapes
    # as pipelines/compiled.py compiles it (static shapes), with Dynamo's tracing only
    runner.functions._step = torch.compile(runner.unified.step, backend="eager", fullgraph=True, dynamic=False)
    traced = completions(runner, opened, 10)
    torch._dynamo.reset()
    assert {i: c.token_ids for i, c in traced.items()} == {i: c.token_ids for i, c in eager.items()}
    assert sum(c.spec.num_relaxed_accepted_tokens for c in traced.values()) > 0


# ------------------------------------------------------------------------------------- specgen run

SPECIALS = {259: "[BOS]", 260: "<|im_user|>", 261: "<|im_assistant|>", 262: "<|im_end|>",
            263: "<|tool_calls_section_begin|>", 264: "<think>", 265: "</think>", 266: "[EOS]"}


@pytest.fixture(scope="module")
def kimi_cli(tmp_path_factory):
    """The Kimi pairing at vocabulary 300 with a Kimi-style tokenizer: markers at ids of its own,
    a chat template whose `thinking` switch opens or closes the span in the prompt."""
    root = tmp_path_factory.mktemp("reasoning-cli")
    target, _, draft, _ = write_pairings(root, 300)["kimi-eagle3-mla"]
    write_tiktoken_tokenizer(target, SPECIALS, KIMI_LIKE_TEMPLATE)
    prompts_file = root / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps({"id": f"q{i}", "prompt": p}) + "\n"
                                    for i, p in enumerate(["hello", "why is the sky blue?", "hi"])))
    return root, target, draft, prompts_file


def _run(args: list[str]):
    from typer.testing import CliRunner

    from specgen.cli import app

    return CliRunner().invoke(app, args, terminal_width=100)


def _common(target, draft, prompts_file) -> list[str]:
    from pathlib import Path

    recipe_file = Path(__file__).parent.parent / "recipes" / "kimi-k25-eagle3.yaml"
    return [str(recipe_file), "--prompts", str(prompts_file), "--set", f"target.model={target}",
            "--set", f"draft.model={draft}", "--set", "runtime.device=cpu", "--set", "runtime.batch_size=2",
            "--set", "runtime.max_seq_len=64", "--set", "sampling.max_tokens=10", "--set", "sampling.ignore_eos=true",
            "--set", "runtime.compile=false"]


def test_records_split_reasoning_from_text(kimi_cli):
    root, target, draft, prompts_file = kimi_cli
    thinking, instant = root / "thinking.jsonl", root / "instant.jsonl"
    result = _run(["run", *_common(target, draft, prompts_file), "--output", str(thinking)])
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in thinking.read_text().splitlines()]
    for r in records:      # the template opened the span; these outputs never close it
        assert 265 not in r["token_ids"]
        assert r["reasoning_text"] and r["text"] == "" and r["num_reasoning_tokens"] == r["num_output_tokens"]
    result = _run(["run", *_common(target, draft, prompts_file), "--output", str(instant),
                   "--set", "chat_template_kwargs={thinking: false}"])
    assert result.exit_code == 0, result.output
    for r in map(json.loads, instant.read_text().splitlines()):
        assert r["reasoning_text"] is None and r["num_reasoning_tokens"] == 0 and r["text"]
    off = root / "off.jsonl"
    result = _run(["run", *_common(target, draft, prompts_file), "--output", str(off), "--set", "reasoning=false"])
    assert result.exit_code == 0, result.output
    plain = {r["id"]: r for r in map(json.loads, off.read_text().splitlines())}
    for r in records:      # the same tokens, all of them in `text` without the parser
        assert plain[r["id"]]["token_ids"] == r["token_ids"] and plain[r["id"]]["text"] == r["reasoning_text"]
        assert plain[r["id"]]["reasoning_text"] is None


def test_relaxed_acceptance_through_specgen_run_is_counted_and_called_lossy(kimi_cli):
    root, target, draft, prompts_file = kimi_cli
    out = root / "relaxed.jsonl"
    # K pinned: under `auto` a loaded machine's timings could rule drafting out, and nothing be relaxed
    result = _run(["run", *_common(target, draft, prompts_file), "--output", str(out),
                   "--set", "sampling.relaxed_acceptance={top_k: 300, delta: 1.0}",
                   "--set", "draft.num_speculative_tokens=3"])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "relaxed acceptance in reasoning (lossy)" in text and "LOSSY inside reasoning spans" in text
    assert "accepted only by relaxed acceptance: lossy" in text
    records = [json.loads(line) for line in out.read_text().splitlines()]
    stats = json.loads((root / "relaxed.jsonl.stats.json").read_text())
    relaxed = sum(r["spec"]["num_relaxed_accepted_tokens"] for r in records)
    assert relaxed > 0 and stats["spec"]["num_relaxed_accepted_tokens"] == relaxed
    assert stats["recipe"]["sampling"]["relaxed_acceptance"] == {"top_k": 300, "delta": 1.0}


def test_relaxed_acceptance_without_reasoning_markers_is_a_clear_error(tmp_path):
    """A tokenizer with no <think> / </think> (here: the byte stand-in of a Llama checkpoint) cannot
    have reasoning spans: the run stops before any weight loads, naming the field (exit 2: a recipe
    its checkpoint cannot serve is bad input)."""
    target = write_llama_checkpoint(tmp_path / "llama", tiny_llama_config(vocab_size=300))
    prompts_file = tmp_path / "p.jsonl"
    prompts_file.write_text('{"prompt": "hi"}\n')
    args = ["run", "--prompts", str(prompts_file), "--output", str(tmp_path / "o.jsonl"),
            "--set", f"target.model={target}", "--set", "runtime.device=cpu", "--set", "chat_template=false"]
    recipe_file = tmp_path / "r.yaml"
    recipe_file.write_text("target: {model: x}\nsampling: {relaxed_acceptance: {top_k: 10, delta: 0.6}}\n")
    result = _run([args[0], str(recipe_file), *args[1:]])
    assert result.exit_code == 2
    assert "recipe.sampling.relaxed_acceptance: applies inside reasoning spans only" in " ".join(result.output.split())
    recipe_file.write_text("target: {model: x}\nreasoning: true\n")
    result = _run([args[0], str(recipe_file), *args[1:]])
    assert result.exit_code == 2 and "recipe.reasoning: the tokenizer has no <think>" in " ".join(result.output.split())


# --------------------------------------------------------------------------- records: text and stops

NAMES = {OPEN: "<think>", CLOSE: "</think>", TOOL: "<tool>"}   # markers a tokenizer does not skip


def _completion(tokens: list[int], start: bool | None, stops: tuple[str, ...] = ()):
    """The runner's record of an output, fed token by token as the step loop does."""
    from specgen.pipelines.requests import Slot, completion_of
    from specgen.pipelines.stats import SpecCounters
    from specgen.pipelines.stops import OutputTracker, StopRules

    decode = lambda ids: "".join(NAMES.get(i, chr(ord("a") + i - a)) for i in ids)  # noqa: E731
    rules = StopRules(frozenset(), stops, True, decode)
    tracker = OutputTracker(rules, max_tokens=len(tokens))
    assert [tracker.add(t) for t in tokens][-1]
    request = Request("r", [1], len(tokens), 0)
    return completion_of(Slot(request, tracker, SpecCounters(0), 0, reasoning_start=start), MARKERS, rules)


def test_a_stop_string_cuts_only_the_part_it_ends():
    # in the reasoning: content written before the span stays whole
    out = _completion([a, b, OPEN, c, d], None, stops=("d",))
    assert (out.text, out.reasoning_text, out.finish_reason) == ("ab", "c", "stop")
    # in the content, after the span: the reasoning stays whole
    out = _completion([a, CLOSE, b, c], True, stops=("c",))
    assert (out.text, out.reasoning_text) == ("b", "a")


def test_markers_never_leak_into_text():
    out = _completion([CLOSE, a, b], True)                  # an empty span, closed at once
    assert (out.text, out.reasoning_text, out.num_reasoning_tokens) == ("ab", None, 0)
    out = _completion([a, TOOL, b], True)                   # the tool-calls start is content
    assert (out.text, out.reasoning_text) == ("<tool>b", "a")
    out = _completion([a, b], None)                         # no marker, no span: decoded as is
    assert (out.text, out.reasoning_text) == ("ab", None)


def test_only_the_generation_prompt_sets_the_start_state(tmp_path):
    """A `<think>` a user typed is text of the conversation; the state comes from what the template
    adds for the answer."""
    from checkpoints_deepseek import tiny_kimi_config

    from specgen.checkpoints.tokenizer import load_tokenizer
    from specgen.data import PromptRecord, tokenize_with_generation_start

    no_think = KIMI_LIKE_TEMPLATE.split("{%- if thinking")[0] + "{%- endif -%}"
    for template, expected in [(no_think, None), (KIMI_LIKE_TEMPLATE, True)]:
        folder = tmp_path / f"tok-{expected}"
        write_tiktoken_tokenizer(folder, SPECIALS, template)
        (folder / "config.json").write_text(json.dumps(tiny_kimi_config(vocab_size=300)))
        tokenizer = load_tokenizer(folder, 300)
        markers = ReasoningMarkers.from_vocab(tokenizer.get_vocab())
        record = PromptRecord(id="q", line=1, prompt="what does <think> mean?")
        ids, start = tokenize_with_generation_start(record, tokenizer, True)
        assert markers.think_start in ids[:start]                     # the user's literal <think>
        assert start_state(ids[start:], markers) is expected
