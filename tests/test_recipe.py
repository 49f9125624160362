"""Recipe schema: defaults, overrides, and the exact text of every validation error."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from specgen.recipe import (
    DRAFT_METHODS,
    DraftSpec,
    Recipe,
    RecipeError,
    RuntimeSpec,
    SamplingSpec,
    TargetSpec,
    apply_overrides,
    load_recipe,
    recipe_from_dict,
)

MINIMAL = {"target": {"model": "smollm2-135m-instruct"}}


def error_text(data: dict) -> str:
    with pytest.raises(RecipeError) as info:
        recipe_from_dict(data)
    return str(info.value)


def with_section(section: str, **fields) -> dict:
    return {**MINIMAL, section: fields}


def write(tmp_path: Path, text: str, name: str = "demo.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_defaults():
    recipe = recipe_from_dict(MINIMAL)
    assert recipe.target == TargetSpec(model="smollm2-135m-instruct", dtype="auto", load_format="auto")
    assert recipe.draft == DraftSpec(method="none", model=None, num_speculative_tokens=None)
    assert not recipe.draft.enabled
    assert recipe.sampling == SamplingSpec(
        temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=None, max_tokens=256, stop=[], ignore_eos=False
    )
    assert recipe.runtime == RuntimeSpec(device="auto", batch_size=8, max_seq_len=2048, compile=None,
                                         threads=None)
    assert recipe.prompts == "default"
    assert recipe.output == "outputs/recipe.jsonl"
    assert recipe.chat_template is True
    assert recipe.source is None


def test_draft_defaults_k_when_enabled():
    recipe = recipe_from_dict(with_section("draft", method="eagle3", model="some/eagle3"))
    assert recipe.draft.enabled
    assert recipe.draft.num_speculative_tokens == 3
    dummy = recipe_from_dict(with_section("draft", method="eagle3", load_format="dummy"))
    assert dummy.draft.model is None


def test_draft_methods_table():
    assert DRAFT_METHODS[0] == "none" and "eagle3" in DRAFT_METHODS


def test_load_recipe_output_from_stem(tmp_path):
    path = write(tmp_path, "target:\n  model: m\n", name="smol-eagle.yaml")
    recipe = load_recipe(path)
    assert recipe.output == "outputs/smol-eagle.jsonl"
    assert recipe.source == path
    explicit = load_recipe(path, ["output=res/x.jsonl"])
    assert explicit.output == "res/x.jsonl"  # taken as written: relative to the cwd


def test_stop_string_becomes_list():
    assert recipe_from_dict(with_section("sampling", stop="###")).sampling.stop == ["###"]
    assert recipe_from_dict(with_section("sampling", stop=["a", "b"])).sampling.stop == ["a", "b"]


def test_top_k_minus_one_is_off():
    assert recipe_from_dict(with_section("sampling", top_k=-1)).sampling.top_k == 0


def test_int_accepted_as_float():
    sampling = recipe_from_dict(with_section("sampling", temperature=1, top_p=1)).sampling
    assert sampling.temperature == 1.0 and isinstance(sampling.temperature, float)


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (
            with_section("draft", modle="x"),
            "recipe.draft.modle: unknown key (known: method, model, load_format, num_speculative_tokens, stochastic, max_speculative_tokens, dtype, suffix_history, jump_forward)",
        ),
        (
            {**MINIMAL, "sampler": {}},
            "recipe.sampler: unknown key (known: target, draft, sampling, runtime, prompts, output, chat_template, "
            "chat_template_kwargs, reasoning, train)",
        ),
        ({}, "recipe.target.model: required"),
        ({"target": {"model": ""}}, "recipe.target.model: must not be empty"),
        ({"target": "m"}, "recipe.target: expected a mapping, got 'm'"),
        (with_section("sampling", temperature="hot"), "recipe.sampling.temperature: expected a number, got 'hot'"),
        (with_section("sampling", temperature=True), "recipe.sampling.temperature: expected a number, got true"),
        (with_section("runtime", batch_size=True), "recipe.runtime.batch_size: expected an integer, got true"),
        (with_section("runtime", batch_size=2.5), "recipe.runtime.batch_size: expected an integer, got 2.5"),
        (with_section("runtime", batch_size=0), "recipe.runtime.batch_size: must be >= 1"),
        (with_section("runtime", max_seq_len=8), "recipe.runtime.max_seq_len: must be >= 16"),
        (with_section("runtime", device="tpu"), "recipe.runtime.device: must be one of auto, cpu, cuda"),
        (with_section("runtime", compile="yes"), "recipe.runtime.compile: expected true, false or auto, got 'yes'"),
        (with_section("runtime", threads=0), "recipe.runtime.threads: must be >= 1"),
        (with_section("runtime", threads="many"), "recipe.runtime.threads: expected an integer, got 'many'"),
        (with_section("draft", method="medusa"), "recipe.draft.method: must be one of none, eagle3, dflash, mtp, suffix, eagle3+suffix, dflash+suffix, mtp+suffix"),
        (
            with_section("draft", method="eagle3", model="d", num_speculative_tokens=0),
            "recipe.draft.num_speculative_tokens: must be >= 1",
        ),
        (
            with_section("draft", method="eagle3", model="d", num_speculative_tokens=33),
            "recipe.draft.num_speculative_tokens: must be <= 32",
        ),
        (
            with_section("draft", method="eagle3"),
            "recipe.draft.model: required when method is eagle3 (or set load_format: dummy)",
        ),
        (
            with_section("draft", method="eagle3", model="d", num_speculative_tokens="fast"),
            "recipe.draft.num_speculative_tokens: expected an integer or auto, got 'fast'",
        ),
        (
            with_section("draft", method="eagle3", model="d", num_speculative_tokens=2, max_speculative_tokens=4),
            "recipe.draft.max_speculative_tokens: only applies to num_speculative_tokens: auto (null when K is pinned)",
        ),
        (
            with_section("draft", method="eagle3", model="d", num_speculative_tokens="auto", max_speculative_tokens=0),
            "recipe.draft.max_speculative_tokens: must be >= 1",
        ),
        (
            {"target": {"model": "m", "dtype": "fp8"}},
            "recipe.target.dtype: must be one of auto, float32, bfloat16, float16",
        ),
        ({"target": {"model": "m", "load_format": "x"}}, "recipe.target.load_format: must be one of auto, dummy"),
        (with_section("sampling", temperature=-0.1), "recipe.sampling.temperature: must be >= 0"),
        (with_section("sampling", top_k=-2), "recipe.sampling.top_k: must be >= -1"),
        (with_section("sampling", top_p=0), "recipe.sampling.top_p: must be > 0 and <= 1"),
        (with_section("sampling", min_p=1.5), "recipe.sampling.min_p: must be >= 0 and <= 1"),
        (with_section("sampling", seed=-1), "recipe.sampling.seed: must be >= 0"),
        (with_section("sampling", max_tokens=0), "recipe.sampling.max_tokens: must be >= 1"),
        (with_section("sampling", stop=["a", ""]), "recipe.sampling.stop[1]: must not be empty"),
        (with_section("sampling", stop=[3]), "recipe.sampling.stop[0]: expected a string, got 3"),
        (with_section("sampling", stop=""), "recipe.sampling.stop[0]: must not be empty"),
        ({**MINIMAL, "chat_template": None}, "recipe.chat_template: expected true or false, got null"),
        ({**MINIMAL, "prompts": 3}, "recipe.prompts: expected a string, got 3"),
    ],
)
def test_validation_errors(data, expected):
    assert error_text(data) == expected


def test_all_problems_reported_one_per_line():
    with pytest.raises(RecipeError) as info:
        recipe_from_dict({"target": {"model": "m"}, "runtime": {"batch_size": 0, "device": "tpu"}})
    err = info.value
    assert str(err).splitlines() == [
        "recipe.runtime.device: must be one of auto, cpu, cuda",
        "recipe.runtime.batch_size: must be >= 1",
    ]
    assert (err.path, err.problem) == ("runtime.device", "must be one of auto, cpu, cuda")
    assert isinstance(err, ValueError)


def test_overrides_parsed_as_yaml():
    data = apply_overrides(
        {"target": {"model": "m"}, "sampling": {"temperature": 0.0}},
        [
            "sampling.temperature=0.7",
            'sampling.stop=["\\n\\n", "END"]',
            "runtime.compile=true",
            "draft.method=eagle3",  # a section the recipe does not have yet
            "draft.model=some/eagle3",
            "sampling.seed=null",
        ],
    )
    recipe = recipe_from_dict(data)
    assert recipe.sampling.temperature == 0.7
    assert recipe.sampling.stop == ["\n\n", "END"]
    assert recipe.runtime.compile is True
    assert recipe.draft.method == "eagle3" and recipe.draft.model == "some/eagle3"
    assert recipe.sampling.seed is None


def test_overrides_do_not_mutate_input():
    data = {"target": {"model": "m"}}
    apply_overrides(data, ["target.model=other"])
    assert data == {"target": {"model": "m"}}


def test_override_disables_draft(tmp_path):
    path = write(tmp_path, "target: {model: m}\ndraft: {method: eagle3, model: d}\n")
    recipe = load_recipe(path, ["draft.method=none"])
    assert not recipe.draft.enabled


@pytest.mark.parametrize("bad", ["sampling.temperature", "=3", "a..b=1"])
def test_bad_override_syntax(bad):
    with pytest.raises(RecipeError) as info:
        apply_overrides(MINIMAL, [bad])
    assert str(info.value) == (
        f"recipe: bad override {bad!r}: expected key=value, e.g. sampling.temperature=0.7"
    )


def test_override_through_a_scalar():
    with pytest.raises(RecipeError) as info:
        apply_overrides({**MINIMAL, "prompts": "default"}, ["prompts.x=1"])
    assert str(info.value) == "recipe.prompts: cannot set prompts.x: prompts is not a mapping"


def test_override_value_that_is_not_yaml():
    with pytest.raises(RecipeError) as info:
        apply_overrides(MINIMAL, ["sampling.stop=[unclosed"])
    assert str(info.value).startswith("recipe.sampling.stop: cannot parse override value '[unclosed'")


def test_load_errors(tmp_path):
    with pytest.raises(RecipeError) as info:
        load_recipe(tmp_path / "missing.yaml")
    assert str(info.value).startswith("recipe: cannot read ")
    assert "missing.yaml" in str(info.value) and info.value.path == ""

    with pytest.raises(RecipeError) as info:
        load_recipe(write(tmp_path, "target: [unclosed\n", name="broken.yaml"))
    assert str(info.value).startswith("recipe: cannot read ") and "not valid YAML" in str(info.value)

    with pytest.raises(RecipeError) as info:
        load_recipe(write(tmp_path, "- a\n- b\n", name="list.yaml"))
    assert str(info.value).endswith("expected a mapping at the top, got ['a', 'b']")


def test_empty_file_filled_by_overrides(tmp_path):
    recipe = load_recipe(write(tmp_path, ""), ["target.model=m"])
    assert recipe.target.model == "m"


def test_to_dict_round_trip(tmp_path):
    path = write(
        tmp_path,
        """
target: {model: m, dtype: bfloat16}
draft: {method: eagle3, model: d, num_speculative_tokens: 5, stochastic: true}
sampling: {temperature: 0.8, top_k: 50, top_p: 0.9, min_p: 0.05, seed: 7, max_tokens: 64, stop: "###"}
runtime: {device: cpu, batch_size: 4, max_seq_len: 512, compile: true}
prompts: my.jsonl
chat_template: false
""",
    )
    recipe = load_recipe(path)
    data = recipe.to_dict()
    assert "source" not in data
    assert data["output"] == "outputs/demo.jsonl"
    assert data["sampling"]["stop"] == ["###"]
    assert json.loads(json.dumps(data)) == data
    assert recipe_from_dict(data, source=path) == recipe
    assert recipe_from_dict(data) == Recipe(**{**_fields(recipe), "source": None})


def _fields(recipe: Recipe) -> dict:
    return {name: getattr(recipe, name) for name in Recipe.__dataclass_fields__}


def test_no_torch_import():
    # The CLI validates recipes before any model loads; importing the schema must stay cheap.
    code = "import sys, specgen.recipe; sys.exit(1 if 'torch' in sys.modules else 0)"
    root = Path(__file__).resolve().parents[1]
    assert subprocess.run([sys.executable, "-c", code], cwd=root).returncode == 0


def test_compile_and_threads_take_auto():
    base = {"target": {"model": "m"}}
    recipe = recipe_from_dict(apply_overrides(base, ["runtime.compile=auto", "runtime.threads=auto"]))
    assert recipe.runtime.compile is None and recipe.runtime.threads is None
    recipe = recipe_from_dict(apply_overrides(base, ["runtime.compile=false", "runtime.threads=3"]))
    assert recipe.runtime.compile is False and recipe.runtime.threads == 3
    assert recipe_from_dict(recipe.to_dict()) == recipe


@pytest.mark.parametrize("path", sorted((Path(__file__).parent.parent / "recipes").glob("*.yaml")),
                         ids=lambda p: p.name)
def test_shipped_recipes_load_and_run_without_their_draft(path):
    # Every recipe in recipes/ is valid as shipped, and `--set draft.method=none` (the README's plain
    # baseline) still loads: a train section has nothing to train then and is set aside.
    recipe = load_recipe(path)
    plain = load_recipe(path, ["draft.method=none"])
    assert plain.draft.method == "none" and plain.train is None
    assert recipe.train is None or recipe.draft.model is not None


def test_reasoning_fields_default_validate_and_round_trip():
    recipe = recipe_from_dict(MINIMAL)
    assert recipe.sampling.relaxed_acceptance is None and recipe.reasoning is None
    assert recipe.chat_template_kwargs == {}
    data = apply_overrides(MINIMAL, ["sampling.relaxed_acceptance={top_k: 5}", "reasoning=auto",
                                     "chat_template_kwargs={thinking: false}"])
    recipe = recipe_from_dict(data)
    assert (recipe.sampling.relaxed_acceptance.top_k, recipe.sampling.relaxed_acceptance.delta) == (5, 0.6)
    assert recipe.reasoning is None and recipe.chat_template_kwargs == {"thinking": False}
    assert recipe_from_dict(recipe.to_dict()) == recipe
    assert recipe_from_dict({**MINIMAL, "sampling": {"relaxed_acceptance": {}}}).sampling.relaxed_acceptance.top_k == 10


@pytest.mark.parametrize(("data", "expected"), [
    ({**MINIMAL, "sampling": {"relaxed_acceptance": {"top_k": 0}}}, "recipe.sampling.relaxed_acceptance.top_k: must be >= 1"),
    ({**MINIMAL, "sampling": {"relaxed_acceptance": {"delta": 1.5}}},
     "recipe.sampling.relaxed_acceptance.delta: must be >= 0 and <= 1"),
    ({**MINIMAL, "sampling": {"relaxed_acceptance": {"topk": 3}}},
     "recipe.sampling.relaxed_acceptance.topk: unknown key (known: top_k, delta)"),
    ({**MINIMAL, "sampling": {"relaxed_acceptance": True}},
     "recipe.sampling.relaxed_acceptance: expected a mapping {top_k, delta} or null, got true"),
    ({**MINIMAL, "reasoning": False, "sampling": {"relaxed_acceptance": {}}},
     "recipe.sampling.relaxed_acceptance: applies inside reasoning spans only, and reasoning is false"),
    ({**MINIMAL, "reasoning": "yes"}, "recipe.reasoning: expected true, false or auto, got 'yes'"),
    ({**MINIMAL, "chat_template_kwargs": ["thinking"]},
     "recipe.chat_template_kwargs: expected a mapping of template variables, e.g. {thinking: false}, got ['thinking']"),
])
def test_reasoning_field_errors(data, expected):
    with pytest.raises(RecipeError) as err:
        recipe_from_dict(data)
    assert str(err.value) == expected


def test_auto_k_and_its_maximum():
    auto = recipe_from_dict({"target": {"model": "m"}, "draft": {"method": "eagle3", "model": "d",
                                                                "num_speculative_tokens": "auto"}})
    assert auto.draft.adaptive and auto.draft.k_max == 4            # chained drafts: 4 by default
    capped = recipe_from_dict({"target": {"model": "m"}, "draft": {
        "method": "mtp", "num_speculative_tokens": "auto", "max_speculative_tokens": 2}})
    assert capped.draft.k_max == 2 and recipe_from_dict(capped.to_dict()) == capped
    dflash = recipe_from_dict({"target": {"model": "m"}, "draft": {"method": "dflash", "model": "d",
                                                                  "num_speculative_tokens": "auto"}})
    assert dflash.draft.adaptive and dflash.draft.k_max is None     # the draft's block_size - 1
    pinned = recipe_from_dict({"target": {"model": "m"}, "draft": {"method": "eagle3", "model": "d",
                                                                  "num_speculative_tokens": 2}})
    assert not pinned.draft.adaptive and pinned.draft.k_max == 2
