"""Structured output: outputs follow their response_format, speculation keeps them the target's.

Tiny random checkpoints with the byte stand-in tokenizer (ids 3..258 are UTF-8 bytes), so a format's
text maps onto tokens one byte at a time. The losslessness claims are the unconstrained ones under
the constraint: greedy speculative == greedy plain, seeded sampled speculative == seeded plain, for
a real (random) EAGLE-3 draft and for oracle drafts that make every acceptance length happen. The
oracle also proposes the UNCONSTRAINED continuation, which the grammar refuses: the failures other
engines shipped (a bonus row or rows 1..K-1 left unmasked) would then leak those tokens.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest
import torch
from checkpoints import tiny_eagle3_config, tiny_llama_config, write_eagle3_checkpoint, write_llama_checkpoint
from step_costs import pin_host_step_costs
from test_speculative import OracleDraft, make_recipe, never_wrong, wrong_positions

from specgen.checkpoints.tokenizer import ByteTokenizer
from specgen.job import build_runner, resolve
from specgen.pipelines.requests import Request
from specgen.pipelines.runner import Runner
from specgen.pipelines.unified import UnifiedStep
from specgen.structured.formats import FormatError, parse_response_format
from specgen.structured.grammar import GrammarEngine, GrammarError
from specgen.structured.masks import allowed_tokens, apply_token_masks, mask_words

V = 300
BYTES = ByteTokenizer(V)
SCHEMA = {"type": "object",
          "properties": {"role": {"enum": ["engineer", "doctor"]},
                         "ok": {"type": "boolean"},
                         "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
          "required": ["role", "ok", "tags"], "additionalProperties": False}
FORMATS = {
    "choice": {"type": "choice", "choices": ["yes", "no", "maybe not"]},
    "regex": {"type": "regex", "pattern": "[a-c]{2}-[0-9]"},
    "json_schema": {"type": "json_schema", "schema": SCHEMA},
    "lark": {"type": "grammar", "lark": 'start: w w w w\nw: "ab" | "cd"'},
}


def follows(kind: str, text: str) -> bool:
    # the tiny config's second EOS id (3) is the stand-in's byte 0, which its decode keeps
    text = text.removesuffix("\x00")
    if kind == "choice":
        return text in FORMATS["choice"]["choices"]
    if kind == "regex":
        return re.fullmatch(FORMATS["regex"]["pattern"], text) is not None
    if kind == "lark":
        return re.fullmatch("(ab|cd){4}", text) is not None
    value = json.loads(text)
    return (set(value) == {"role", "ok", "tags"} and value["role"] in ("engineer", "doctor")
            and isinstance(value["ok"], bool) and all(t in "abc" for t in value["tags"]))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("structured")
    config = tiny_llama_config(vocab_size=V)
    target = write_llama_checkpoint(root / "target", config)
    draft = write_eagle3_checkpoint(root / "eagle3", tiny_eagle3_config(config, draft_vocab_size=200), config)
    return target, draft


def prompt_ids(n: int = 5) -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(3, V, (int(length),), generator=gen).tolist()
            for length in torch.randint(2, 14, (n,), generator=gen)]


def structured_runner(recipe, draft_override=None, jump_forward: bool = True) -> Runner:
    recipe = replace(recipe, draft=replace(recipe.draft, jump_forward=jump_forward))
    r = resolve(recipe)
    runner, _, _ = build_runner(recipe, r, recipe.sampling.seed, structured=True)
    if draft_override is None:
        return runner
    step = UnifiedStep(runner.unified.target, draft_override, structured=True)
    return Runner(step, batch_size=runner.batch_size, max_seq_len=runner.max_seq_len, rules=runner.rules,
                  sampling=runner.sampling, seed=runner.seed, device=runner.device, dtype=torch.float32,
                  grammar=runner.grammar, jump_forward=jump_forward)


def generate(runner: Runner, ids, fmt, max_tokens: int = 96) -> dict[str, tuple[list[int], str, str]]:
    """id -> (tokens, text, finish_reason); `fmt`: one response_format for every prompt, or a list."""
    formats = fmt if isinstance(fmt, list) else [fmt] * len(ids)
    out = {}

    def done(c):
        out[c.id] = (c.token_ids, c.text, c.finish_reason) if c.finish_reason != "error" else c.error

    requests = [Request(f"p{i}", p, max_tokens, 1000 + i,
                        response_format=parse_response_format(f, "response_format") if f else None)
                for i, (p, f) in enumerate(zip(ids, formats))]
    runner.run(requests, done)
    return out


def oracle(ids, outputs, k, wrong=wrong_positions) -> OracleDraft:
    references = {tuple(p[1:]): p + outputs[f"p{i}"][0] for i, p in enumerate(ids)}
    return OracleDraft(references, k, V, wrong)


@pytest.mark.parametrize("kind", list(FORMATS))
def test_greedy_structured_output_follows_the_format_and_speculation_changes_nothing(models, kind, monkeypatch):
    target, draft = models
    pin_host_step_costs(monkeypatch)        # jump-forward's choices, not this machine's timings
    ids = prompt_ids()
    recipe = make_recipe(target, batch=2, ignore_eos=False)
    plain = generate(structured_runner(recipe, jump_forward=False), ids, FORMATS[kind])
    for tokens, text, reason in plain.values():
        assert reason == "stop" and follows(kind, text), (text, reason)
    free = generate(structured_runner(recipe), ids, None)
    assert free != plain           # the constraint changed the outputs (the test is not vacuous)
    # plain decoding with jump-forward: the grammar's forced tokens verified as drafts, accepted
    runner = structured_runner(recipe)
    assert generate(runner, ids, FORMATS[kind]) == plain
    assert runner.totals.spec.num_accepted_tokens > 0 and runner.totals.grammar_drafts == 0
    spec_recipe = make_recipe(target, draft, k=3, batch=2, ignore_eos=False)
    assert generate(structured_runner(spec_recipe), ids, FORMATS[kind]) == plain
    # oracle drafts: the constrained answer itself (every acceptance length, bonus rows included: no
    # forced tokens in place of its wrong drafts), and the unconstrained answer (drafts the grammar
    # refuses, at every row; with forced tokens in their place where the grammar has some)
    for references, wrong, jump in ((plain, wrong_positions, False), (free, never_wrong, True)):
        runner = structured_runner(spec_recipe, oracle(ids, references, 3, wrong), jump_forward=jump)
        assert generate(runner, ids, FORMATS[kind]) == plain
        if jump:
            assert runner.totals.grammar_drafts > 0 or runner.totals.refused_drafts > 0
        else:
            histogram = runner.totals.spec.acceptance_histogram
            assert histogram[0] > 0 and histogram[3] > 0


def test_seeded_sampled_structured_output_equals_plain_with_a_draft(models):
    target, draft = models
    ids = prompt_ids()
    sampling = {"temperature": 0.9, "top_p": 0.95, "ignore_eos": False}
    fmt = FORMATS["json_schema"]
    plain = generate(structured_runner(make_recipe(target, batch=2, **sampling), jump_forward=False), ids, fmt)
    greedy = generate(structured_runner(make_recipe(target, batch=2, ignore_eos=False), jump_forward=False), ids, fmt)
    assert plain != greedy
    # jump-forward (plain decoding verifying the forced tokens) samples the same tokens
    assert generate(structured_runner(make_recipe(target, batch=2, **sampling)), ids, fmt) == plain
    for tokens, text, reason in plain.values():
        assert reason == "stop" and follows("json_schema", text), text
    spec = make_recipe(target, draft, k=3, batch=2, **sampling)
    assert generate(structured_runner(spec), ids, fmt) == plain
    assert generate(structured_runner(spec, oracle(ids, plain, 3)), ids, fmt) == plain


def test_sampled_output_with_stochastic_drafts_has_the_constrained_distribution(tmp_path):
    """Stochastic drafts (full rejection sampling against the draft's q, which puts mass on tokens
    the grammar refuses) under a grammar: each output position is distributed as the target's
    processed distribution restricted to the grammar's tokens (chi-square against the exact
    marginals). The grammar allows a different set at each position, the same after any prefix."""
    from test_speculative import STAT_VOCAB, chi_square_p, exact_marginals

    config = tiny_llama_config(vocab_size=STAT_VOCAB)
    target = write_llama_checkpoint(tmp_path / "target", config, seed=5)
    draft = write_eagle3_checkpoint(tmp_path / "eagle3", tiny_eagle3_config(config, draft_vocab_size=16),
                                    config, seed=9)
    # the stand-in's token t is byte t - 3; byte 0 (token 3) is an EOS id of the tiny config
    spans = [(1, 9), (5, 12), (2, 16)]
    fmt = {"type": "regex", "pattern": "".join(f"[\\x{lo:02x}-\\x{hi:02x}]" for lo, hi in spans)}
    allowed = [torch.zeros(STAT_VOCAB, dtype=torch.bool) for _ in spans]
    for mask, (lo, hi) in zip(allowed, spans):
        mask[lo + 3:hi + 4] = True
    prompt, n = [5, 9, 2, 17, 11], 2400
    recipe = make_recipe(target, draft, k=2, batch=64, stochastic=True, temperature=1.0, ignore_eos=False)
    runner = structured_runner(recipe)
    out = generate(runner, [prompt] * n, fmt, max_tokens=3)
    assert runner.totals.spec.num_accepted_tokens > 0.1 * runner.totals.spec.num_draft_tokens
    marginals = exact_marginals(runner, prompt, 3, allowed)
    for position, probs in enumerate(marginals):
        samples = [out[f"p{i}"][0][position] for i in range(n)]
        assert all(allowed[position][s] for s in samples)
        assert chi_square_p(samples, probs) > 1e-3, f"output token {position + 1} is off-distribution"


def test_mixed_batch_unconstrained_rows_are_untouched(models):
    """A request without a format beside constrained ones gets what an unconstrained run gives."""
    target, draft = models
    ids = prompt_ids(4)
    recipe = make_recipe(target, draft, k=2, batch=4, ignore_eos=False)
    free = generate(structured_runner(make_recipe(target, batch=4, ignore_eos=False)), ids, None)
    mixed = generate(structured_runner(recipe), ids, [None, FORMATS["regex"], None, FORMATS["choice"]])
    assert mixed["p0"] == free["p0"] and mixed["p2"] == free["p2"]
    assert follows("regex", mixed["p1"][1]) and follows("choice", mixed["p3"][1])


@pytest.mark.parametrize("with_draft", [False, True], ids=["plain", "eagle3"])
def test_narrowing_moves_a_free_request_into_a_finished_structured_slot(models, with_draft):
    """Issue 68 (eager, batch 4): two choices in slots 0 and 1 end first, while a JSON schema (slot 2)
    is still being written; the run's tail then narrows to two slots, moving the JSON request to slot
    0 and the free one (slot 3) to slot 1, the finished choice's slot. The test above never has a
    structured slot alive when the tail narrows, so no mask is written after the move. Here one is:
    the mask rows the choice left behind (one token allowed: here its "e", which the free request
    then wrote to its end) must not reach the free request."""
    target, draft = models
    ids = prompt_ids(10)[:4]        # the last one runs to max_tokens alone (prompt_ids(4)'s stops at once)
    formats = [{"type": "choice", "choices": ["yes", "no"]}] * 2 + [FORMATS["json_schema"], None]
    recipe = (make_recipe(target, draft, k=2, batch=4, ignore_eos=False) if with_draft
              else make_recipe(target, batch=4, ignore_eos=False))
    alone = generate(structured_runner(recipe), ids[3:], [None])["p0"]
    runner = structured_runner(recipe)
    mixed = generate(runner, ids, formats)
    assert all(mixed[f"p{i}"][2] == "stop" for i in range(3))
    assert follows("choice", mixed["p0"][1]) and follows("choice", mixed["p1"][1])
    assert follows("json_schema", mixed["p2"][1])
    # the scenario: the JSON request outlived both choices (it was live, masked, after the narrowing)
    assert len(mixed["p2"][0]) > 2 * max(len(mixed["p0"][0]), len(mixed["p1"][0]))
    assert len(alone[0]) > len(mixed["p2"][0])                 # ... and the free one outlived it
    assert runner.width < runner.batch_size                     # the tail did narrow
    assert mixed["p3"] == alone
    # every slot holds no grammar now: its mask rows allow everything, on the host and the device
    assert (runner.grammars.host_masks == -1).all() and (runner.state.token_masks == -1).all()


def test_a_malformed_format_fails_its_own_request_only(models):
    target, _ = models
    ids = prompt_ids(3)
    bad = {"type": "regex", "pattern": "(ab"}
    out = generate(structured_runner(make_recipe(target, batch=2, ignore_eos=False)), ids,
                   [FORMATS["choice"], bad, FORMATS["choice"]])
    assert isinstance(out["p1"], str) and "does not compile" in out["p1"] and "parenthesis" in out["p1"]
    assert follows("choice", out["p0"][1]) and follows("choice", out["p2"][1])


def test_the_constraint_starts_after_the_reasoning_span():
    """Inside a reasoning span every row is free; from the token after the close marker the grammar
    holds, also when the close marker is a draft in the middle of a step's rows (vLLM #36138)."""
    engine = GrammarEngine(BYTES, V, {2})
    close = 299
    fmt = parse_response_format(FORMATS["choice"], "r")
    grammar = engine.matcher(fmt, closes=(close,), thinking=True)
    masks = torch.zeros(4, engine.words, dtype=torch.int32)
    grammar.fill(masks, [50, close, ord("y") + 3])
    allowed = allowed_tokens(masks, V)
    assert allowed[0].all() and allowed[1].all()          # rows before and at the close: free
    assert not allowed[2].all() and allowed[2, ord("y") + 3] and not allowed[2, ord("x") + 3]
    assert allowed[3, ord("e") + 3] and not allowed[3, ord("o") + 3]     # after "y": "yes" only
    assert grammar.thinking                                # drafts never move the real state
    assert grammar.advance(50) and grammar.advance(close) and not grammar.thinking


def test_a_finished_grammar_is_never_asked_for_a_mask():
    """After the grammar's end (its stop token accepted) rows stay free and nothing is asked of the
    matcher (openvino.genai #4081, SGLang #15050); the request ends there."""
    engine = GrammarEngine(BYTES, V, {2})
    grammar = engine.matcher(parse_response_format({"type": "choice", "choices": ["a"]}, "r"))
    assert grammar.advance(ord("a") + 3) and not grammar.finished
    masks = torch.zeros(3, engine.words, dtype=torch.int32)
    grammar.fill(masks, [2, 77])
    allowed = allowed_tokens(masks, V)
    assert allowed[0].nonzero().flatten().tolist() == [2] and allowed[1].all() and allowed[2].all()
    assert grammar.advance(2) and grammar.finished
    assert not grammar.advance(77)


def test_refused_drafts_give_way_to_the_tokens_the_grammar_forces():
    """With jump_forward, a draft the grammar refuses is replaced by the forced tokens from there (and
    the drafts after it); the rows are the masks after those; the real state never moves."""
    engine = GrammarEngine(BYTES, V, {2})
    byte = {ch: ord(ch) + 3 for ch in "abcdxyz-"}
    fmt = parse_response_format({"type": "regex", "pattern": "ab(cd-x|cd-y)z"}, "r")
    grammar = engine.matcher(fmt)
    masks = torch.zeros(6, engine.words, dtype=torch.int32)
    # "a" is right, then 77 is refused: "bcd-" is forced from there, one byte token each
    walk = grammar.fill(masks, [byte["a"], 77, 78, 79, 80], jump_forward=True)
    assert walk.drafts == [byte[c] for c in "abcd-"] and walk.written == 4 and walk.refused == 0
    allowed = allowed_tokens(masks, V)
    for row, ch in enumerate("abcd-"):
        assert allowed[row].nonzero().flatten().tolist() == [byte[ch]]
    assert allowed[5, byte["x"]] and allowed[5, byte["y"]] and not allowed[5, byte["z"]]
    # a refused draft where the grammar forces nothing (x or y) stops the walk: later rows stay free
    assert [grammar.advance(byte[c]) for c in "abcd-"] == [True] * 5
    walk = grammar.fill(masks[:3], [77, byte["z"]], jump_forward=True)
    assert walk.drafts == [77, byte["z"]] and walk.written == 0 and walk.refused == 1
    assert allowed_tokens(masks[:3], V)[1:].all()
    # without jump_forward the drafts stand
    assert grammar.fill(masks[:3], [77, 78]).drafts == [77, 78]
    assert grammar.advance(byte["y"]) and grammar.advance(byte["z"])


def test_forced_drafts_keep_the_output_and_are_accepted(models):
    """A random draft under a format that is mostly literal text: its drafts are refused, the grammar's
    forced tokens take their place and the target accepts them, and the output is plain decoding's."""
    target, draft = models
    ids = prompt_ids()
    fmt = {"type": "regex", "pattern": "(alpha-beta-gamma|delta-epsilon)-[0-9]{2}-(zeta|eta)-theta"}
    plain = generate(structured_runner(make_recipe(target, batch=2, ignore_eos=False), jump_forward=False), ids, fmt)
    spec_recipe = make_recipe(target, draft, k=3, batch=2, ignore_eos=False)
    accepted = {}
    for jump in (True, False):
        runner = structured_runner(spec_recipe, jump_forward=jump)
        assert generate(runner, ids, fmt) == plain
        accepted[jump] = runner.totals.spec.num_accepted_tokens
        assert (runner.totals.grammar_drafts > 0) == jump
    assert accepted[True] > 2 * accepted[False] + 20, accepted


def test_bitmask_unpacking_matches_the_engine():
    engine = GrammarEngine(BYTES, V, {2})
    grammar = engine.matcher(parse_response_format(FORMATS["regex"], "r"))
    masks = torch.zeros(1, mask_words(V), dtype=torch.int32)
    grammar.fill(masks, [])
    allowed = allowed_tokens(masks, V)[0]
    assert allowed.nonzero().flatten().tolist() == [ord(c) + 3 for c in "abc"]
    logits = torch.randn(1, V)
    masked = apply_token_masks(logits, masks)
    assert torch.equal(masked[0, allowed], logits[0, allowed]) and torch.isinf(masked[0, ~allowed]).all()
    # the sign bit (token 32 w + 31) and a full row
    word = torch.tensor([[-2**31, -1]], dtype=torch.int32)
    bits = allowed_tokens(word, 64)[0]
    assert bits[:32].nonzero().flatten().tolist() == [31] and bits[32:].all()


@pytest.mark.parametrize("value,place", [
    ("json", "r"), ({"type": "xml"}, "r.type"), ({"type": "regex"}, "r.pattern"),
    ({"type": "choice", "choices": []}, "r.choices"), ({"type": "grammar"}, "r"),
    ({"type": "json_schema", "schema": "{oops"}, "r.schema"),
    ({"type": "json_schema", "json_schema": {"schema": 3}}, "r.json_schema.schema"),
])
def test_format_errors_name_the_field(value, place):
    with pytest.raises(FormatError) as err:
        parse_response_format(value, "r")
    assert err.value.place == place


def test_openai_spellings_and_text_parse():
    nested = parse_response_format({"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}, "r")
    assert nested == parse_response_format({"type": "json_schema", "schema": SCHEMA}, "r")
    assert not parse_response_format({"type": "text"}, "r").constrains
    with pytest.raises(GrammarError, match="Unsupported type"):
        GrammarEngine(BYTES, V, {2}).matcher(parse_response_format(
            {"type": "json_schema", "schema": {"type": "foo"}}, "r"))


def suffix_recipe(target, k=3, batch=2, compile=False, **sampling):
    from specgen.recipe import recipe_from_dict

    return recipe_from_dict({
        "target": {"model": str(target), "dtype": "float32"},
        "draft": {"method": "suffix", "num_speculative_tokens": k},
        "sampling": {"max_tokens": 24, "seed": 7, **sampling},
        "runtime": {"device": "cpu", "batch_size": batch, "max_seq_len": 160, "compile": compile},
        "chat_template": False,
    })


def test_suffix_drafting_under_a_schema_equals_plain(models):
    """Host drafts (SuffixDecoding): the masks are filled from the proposals in `pending` before the
    verify. Repeated prompts give the suffix index matches, so proposals are made and accepted."""
    target, _ = models
    ids = prompt_ids(3) * 3
    fmt = FORMATS["json_schema"]
    plain = generate(structured_runner(make_recipe(target, batch=2, ignore_eos=False), jump_forward=False), ids, fmt)
    runner = structured_runner(suffix_recipe(target))
    assert generate(runner, ids, fmt) == plain
    assert runner.totals.spec.num_accepted_tokens > 0


def test_the_compiled_structured_step_equals_eager(models, monkeypatch):
    """Compiled, a structured step is two graphs: the draft, then the host's masks, then the verify;
    its outputs are the eager ones. Unfrozen (as on CUDA): what is tested is the split and the masks
    between its calls; frozen CPU GEMMs have tests of their own (test_compile_and_kernel.py)."""
    import specgen.pipelines.compiled as compiled

    monkeypatch.setattr(compiled, "freezes", lambda device, slots: False)
    target, draft = models
    ids = prompt_ids(3)
    fmt = FORMATS["json_schema"]
    eager = generate(structured_runner(make_recipe(target, draft, k=2, batch=2, ignore_eos=False)), ids, fmt)
    runner = structured_runner(make_recipe(target, draft, k=2, batch=2, ignore_eos=False, compile=True))
    assert runner.compiled and not runner.functions.frozen
    assert generate(runner, ids, fmt) == eager
    for tokens, text, reason in eager.values():
        assert reason == "stop" and follows("json_schema", text), text


def test_run_takes_the_recipes_format_and_each_lines_own(models, tmp_path):
    """`specgen run`: the recipe's response_format for lines without one, a line's own wins (`text`
    turns it off), and a line whose format is malformed (shape or pattern) is that line's error
    record: exit 3, the other records written."""
    import yaml
    from typer.testing import CliRunner

    from specgen.cli import app

    target, draft = models
    lines = [{"id": "recipe's", "prompt": "who?"},
             {"id": "choice", "prompt": "ok?", "response_format": FORMATS["choice"]},
             {"id": "free", "prompt": "hi", "response_format": {"type": "text"}, "max_tokens": 5},
             {"id": "bad-pattern", "prompt": "x", "response_format": {"type": "regex", "pattern": "(ab"}},
             {"id": "bad-shape", "prompt": "x", "response_format": {"type": "regex"}},
             {"id": "openai", "prompt": "who?",
              "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}}]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({
        "target": {"model": str(target), "dtype": "float32"},
        "draft": {"method": "eagle3", "model": str(draft), "num_speculative_tokens": 2},
        "sampling": {"max_tokens": 96, "seed": 1, "response_format": FORMATS["regex"]},
        "runtime": {"device": "cpu", "batch_size": 2, "max_seq_len": 128, "compile": False},
        "chat_template": False}))
    out = tmp_path / "out.jsonl"
    result = CliRunner().invoke(app, ["run", str(recipe), "--prompts", str(prompts), "--output", str(out)],
                                terminal_width=120)
    assert result.exit_code == 3, result.output
    records = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert follows("regex", records["recipe's"]["text"]) and follows("choice", records["choice"]["text"])
    assert follows("json_schema", records["openai"]["text"])
    assert records["free"]["finish_reason"] == "length" and records["free"]["error"] is None
    assert "does not compile" in records["bad-pattern"]["error"]
    assert "line 5: response_format.pattern:" in records["bad-shape"]["error"]
    # the stats say what the host's masks cost a step
    stats = json.loads((tmp_path / "out.jsonl.stats.json").read_text())
    assert set(stats["structured"]) == {"mask_ms_per_step", "step_ms", "grammar_draft_tokens", "refused_draft_steps"}
    assert 0 < stats["structured"]["mask_ms_per_step"] < stats["structured"]["step_ms"]
    # a recipe whose format has the wrong shape is refused before anything loads, naming the field
    bad = yaml.safe_load(recipe.read_text())
    bad["sampling"]["response_format"] = {"type": "choice", "choices": "yes"}
    recipe.write_text(yaml.safe_dump(bad))
    result = CliRunner().invoke(app, ["run", str(recipe), "--prompts", str(prompts), "--output", str(out)],
                                terminal_width=120)
    assert result.exit_code == 2 and "sampling.response_format.choices" in result.output, result.output
