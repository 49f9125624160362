"""The step compiled with torch.compile gives the same tokens as eager, and the Triton verify kernel
(run by the interpreter on CPU) gives the same tokens as the PyTorch reference inside the pipeline."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters
from test_logprobs import assert_close_entries
from test_logprobs import run as logprob_run
from test_speculative import make_recipe, models, prompts, run, runner_for  # noqa: F401  (fixture)

import specgen.pipelines.unified as unified
from specgen.machine import cpu_has_avx512


@pytest.fixture
def lowered_anew():
    """Inductor's graph cache off: a test that counts what Inductor lowers (templates, parses) must
    see the lowering, which a cache hit (the same weights, compiled by an earlier run) skips."""
    import torch._inductor.config as inductor_config

    with inductor_config.patch(fx_graph_cache=False):
        yield


def test_compiled_sampled_step_equals_eager(models, lowered_anew):  # noqa: F811
    """Seeded sampling, compiled and eager, gives the same tokens and the same logprobs (greedy
    compiled steps: the oracle drafts' compiled cases, test_oracle_drafts.py), and the compiled step
    really is frozen with its GEMMs on the C++ template."""
    sampling = {"temperature": 0.8, "top_p": 0.9, "logprobs": 3}
    target, draft = models
    ids = prompts(lengths=(3, 11, 6))
    eager_runner = runner_for(make_recipe(target, draft, k=2, batch=1, **sampling))
    eager = logprob_run(eager_runner, ids, max_tokens=12)
    compiled_runner = runner_for(make_recipe(target, draft, k=2, batch=1, compile=True, **sampling))
    assert compiled_runner.compiled
    torch._dynamo.reset()     # compile here, whatever ran before in this process
    counters.clear()
    compiled = logprob_run(compiled_runner, ids, max_tokens=12)
    eager_totals, compiled_totals = eager_runner.totals, compiled_runner.totals
    for key, (tokens, entries) in eager.items():
        assert compiled[key][0] == tokens
        assert_close_entries(compiled[key][1], entries, 1e-5)
    assert compiled_totals.spec.acceptance_histogram == eager_totals.spec.acceptance_histogram
    # The weights were frozen, i.e. really folded in (freezing set in torch.compile's options alone
    # never reaches Inductor), and the GEMMs went through Inductor's C++ template (prepacked weights)
    assert compiled_runner.functions.frozen
    assert counters["inductor"]["cpp_templated_kernel_counter"] > 0


def test_a_recompile_mid_run_is_compile_time_not_a_steps_cost(models):  # noqa: F811
    """A graph compiled again mid-run (guards that failed: a size it was specialised on changed) is
    counted as compile time, and the step that paid for it is not timed as its variant's cost."""
    from specgen.pipelines.policy import FixedPolicy

    target, draft = models
    runner = runner_for(make_recipe(target, draft, k=2, batch=1, compile=True))
    ids = prompts(lengths=(3, 11))
    run(runner, ids, max_tokens=6)            # compiles the variant
    torch._dynamo.reset()                     # every graph compiles again at its next call
    timed = []

    class Recording(FixedPolicy):
        def observe_step(self, k: int, width: int, seconds: float) -> None:
            timed.append(seconds)

    runner.use_policy(Recording(2))
    _, totals = run(runner, ids, max_tokens=6)
    recompiled = [key for key in runner.functions.compile_seconds if isinstance(key, tuple) and key[0] == "recompile"]
    assert {key[1] for key in recompiled} == {("step", 2)}
    assert totals.compile_seconds == pytest.approx(sum(runner.functions.compile_seconds[key] for key in recompiled))
    assert len(timed) == totals.steps - 1 and max(timed) < totals.compile_seconds


@pytest.mark.parametrize("rows", [1, 16])
def test_every_cpu_gemm_takes_the_template_without_autotuning(rows, lowered_anew):
    """CPU_FROZEN_SETTINGS: each GEMM of a frozen CPU step runs Inductor's C++ template, chosen without
    benchmarking, whatever its row count (autotuning had taken MKL for 16 rows and more: steps of 2
    rows per slot at batch 8 ran as slowly as eager ones)."""
    from specgen.pipelines.compiled import compile_frozen_on_cpu

    class TwoLinears(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up = torch.nn.Linear(64, 96, bias=False)
            self.down = torch.nn.Linear(96, 64, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.down(torch.nn.functional.silu(self.up(x)))

    module = TwoLinears().eval()
    x = torch.randn(rows, 64)
    compiled = compile_frozen_on_cpu(module.forward)
    torch._dynamo.reset()
    counters.clear()
    with torch.inference_mode():
        out = compiled(x)
        expected = module(x)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
    assert counters["inductor"]["cpp_templated_kernel_counter"] == 2
    assert counters["inductor"]["select_algorithm_autotune"] == 0


def test_a_frozen_cpu_compile_parses_each_gemm_template_source_once(monkeypatch, lowered_anew):
    """cpu_gemm._parse_each_template_once: once a GEMM of a shape has been compiled, compiling more
    GEMMs parses no Jinja source again (Inductor parsed every template at every render: 10-11 s of a
    cold SmolLM2 EAGLE-3 compile on 2 cores), and the GEMMs still compute what eager does."""
    import jinja2

    from specgen.pipelines.compiled import compile_frozen_on_cpu

    def chain(layers: int) -> torch.nn.Module:
        return torch.nn.Sequential(*(torch.nn.Linear(64, 64, bias=False) for _ in range(layers))).eval()

    x = torch.randn(2, 64)
    with torch.inference_mode():
        compile_frozen_on_cpu(chain(1).forward)(x)
        parses = []
        parse = jinja2.Environment.from_string
        monkeypatch.setattr(jinja2.Environment, "from_string",
                            lambda self, *a, **k: parses.append(a[0]) or parse(self, *a, **k))
        module = chain(4)
        counters.clear()
        out = compile_frozen_on_cpu(module.forward)(x)
        torch.testing.assert_close(out, module(x), rtol=1e-4, atol=1e-5)
    assert counters["inductor"]["cpp_templated_kernel_counter"] == 4
    assert parses == []


class _ResidualMLP(torch.nn.Module):
    """x + down(silu(up(x))): in bf16 Inductor's freezing passes pack both weights for oneDNN and
    fuse the residual add into the second linear (the graphs Inductor's cache used to turn away)."""

    def __init__(self, seed: int, dtype: torch.dtype) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.up = torch.nn.Linear(64, 96, bias=False, dtype=dtype)
        self.down = torch.nn.Linear(96, 64, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.silu(self.up(x)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_frozen_step_comes_from_the_graph_cache_only_for_the_same_weights(dtype):
    """cpu_gemm: Inductor's graph cache serves a frozen CPU graph, float32 or bf16 (whose weights
    oneDNN packs): a second compile of the same weights is a hit and computes the same bits, and two
    modules of one layout with other weights never share an entry: the entry holds the C++
    template's packed weights by value, while Inductor keys frozen weights by dtype and shape alone
    (a fine-tune would have run with its base model's weights)."""
    from torch._inductor.utils import fresh_cache

    from specgen.pipelines.compiled import compile_frozen_on_cpu

    x = torch.randn(3, 64, dtype=dtype)
    seen, outs = {}, {}
    with fresh_cache(), torch.inference_mode():
        for name, seed in [("first", 0), ("same weights", 0), ("other weights", 1)]:
            module = _ResidualMLP(seed, dtype).eval()
            torch._dynamo.reset()
            counters.clear()
            outs[name] = compile_frozen_on_cpu(module.forward)(x)
            tolerance = {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
            torch.testing.assert_close(outs[name], module(x), **tolerance)
            seen[name] = dict(counters["inductor"])
    assert seen["first"]["fxgraph_cache_miss"] == 1 and seen["first"]["cpp_templated_kernel_counter"] == 2
    assert seen["same weights"]["fxgraph_cache_hit"] == 1 and "fxgraph_cache_miss" not in seen["same weights"]
    assert torch.equal(outs["same weights"], outs["first"])
    assert seen["other weights"]["fxgraph_cache_miss"] == 1
    if dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        # the graph held oneDNN-packed weights: what the cache now lets in
        assert seen["first"]["mkldnn_linear_weight_pack_matcher_count"] == 2


def test_the_graph_cache_keeps_its_newest_entries_within_its_cap(tmp_path):
    """compiled.prune_graph_cache: the oldest entries go first, until the rest fits; an entry is
    judged by its newest file and counted whole (its folder with every file in it)."""
    import os

    from specgen.pipelines.compiled import prune_graph_cache

    def entry(name: str, sizes: list[int], age: int) -> Path:
        folder = tmp_path / "fxgraph" / name[:2] / name
        folder.mkdir(parents=True)
        for i, size in enumerate(sizes):
            f = folder / f"part{i}"
            f.write_bytes(b"x" * size)
            os.utime(f, (1_000_000 - age, 1_000_000 - age))
        return folder

    oldest, old, new, newest = (entry("aa1", [300, 300], 40), entry("bb2", [500], 30),
                                entry("aa3", [200, 100], 20), entry("cc4", [400], 10))
    assert prune_graph_cache(tmp_path / "fxgraph", max_bytes=1_000) == [oldest, old]
    assert [p.exists() for p in (oldest, old, new, newest)] == [False, False, True, True]
    assert prune_graph_cache(tmp_path / "fxgraph", max_bytes=1_000) == []
    assert prune_graph_cache(tmp_path / "missing", max_bytes=0) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_cpu_gemm_row_gets_the_bits_of_a_one_row_gemm_with_four_row_tiles(dtype, lowered_anew):
    """cpu_gemm: a GEMM of 13 rows (3 full 4-row register tiles and a tail) gives every row the bits
    the same GEMM of 1 row gives it (what keeps verified tokens equal to plain decoding's), and on
    AVX-512 it runs register tiles of 4 rows (Inductor's own choice, 8 rows, took 1.5-2.4x as long
    for 8 and 16 rows on AMD EPYC Zen 4)."""
    from torch._inductor.cpu_vec_isa import VecAMX, VecAVX512, pick_vec_isa
    from torch._inductor.utils import run_and_get_code

    from specgen.pipelines.compiled import compile_frozen_on_cpu
    from specgen.pipelines.cpu_gemm import MAX_TILE_ROWS

    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 192, bias=False).to(dtype).eval()
    torch._dynamo.reset()

    def compiled():
        return compile_frozen_on_cpu(lambda x: linear(x))

    x = torch.randn(13, 96, dtype=dtype)
    with torch.inference_mode():
        many, (code,) = run_and_get_code(compiled(), x)
        one_row = compiled()
        rows = torch.cat([one_row(x[i:i + 1]) for i in range(13)])
    assert torch.equal(many, rows)
    torch.testing.assert_close(many.float(), linear(x).float(), rtol=2e-2, atol=2e-2)
    assert "constexpr int64_t Mr = " in code       # the C++ template ran
    isa = pick_vec_isa()
    if isinstance(isa, VecAVX512) and not (isinstance(isa, VecAMX) and dtype == torch.bfloat16):
        assert f"constexpr int64_t Mr = {MAX_TILE_ROWS};" in code


def test_the_bf16_dot_kernel_sums_as_its_reference_and_gives_each_row_the_bits_of_a_one_row_gemm():
    """kernels/cpu_bf16_dot.py, where the CPU has AVX-512 and no AMX: the compiled bf16 GEMM runs
    `vdpbf16ps` (AVX512-BF16) or the converting kernel (AVX-512 alone), and every output is the
    reference's sum, bit for bit, in the reference's order (odd product of a pair first: an input
    built so that plain sequential fp32 sums to 0 and this order to 1); 13 rows give each row the
    bits of its 1-row GEMM."""
    from torch._inductor.utils import run_and_get_code

    from specgen.kernels.cpu_bf16_dot import dot_pairs_reference, supported, supported_native
    from specgen.pipelines.compiled import compile_frozen_on_cpu

    if not supported():
        pytest.skip("no AVX-512 (or AMX present): Inductor's own kernels run")
    torch.manual_seed(0)
    # order: per pair (k, k+1) the products are 1 and 2**25, then 1 and -2**25
    order = torch.nn.Linear(4, 16, bias=False).to(torch.bfloat16).eval()
    with torch.no_grad():
        order.weight.copy_(torch.tensor([1.0, 2.0**12, 1.0, 2.0**12]).expand(16, 4))
    x_order = torch.tensor([[1.0, 2.0**13, 1.0, -2.0**13]], dtype=torch.bfloat16)
    linear = torch.nn.Linear(2048, 96, bias=False).to(torch.bfloat16).eval()
    x = torch.randn(13, 2048, dtype=torch.bfloat16)
    with torch.inference_mode():
        torch._dynamo.reset()
        summed = compile_frozen_on_cpu(lambda v: order(v))(x_order)
        sequential = torch.zeros((), dtype=torch.float32)
        for a, b in zip(x_order[0].float(), order.weight[0].float()):   # k = 0, 1, 2, 3 in order
            sequential = sequential + a * b
        assert sequential == 0
        assert torch.equal(summed.float(), dot_pairs_reference(x_order, order.weight))
        torch._dynamo.reset()
        many, (code,) = run_and_get_code(compile_frozen_on_cpu(lambda v: linear(v)), x)
        one_row = compile_frozen_on_cpu(lambda v: linear(v))
        rows = torch.cat([one_row(x[i:i + 1]) for i in range(13)])
    assert ("_mm512_dpbf16_ps" in code) == supported_native()
    assert "_mm512_slli_epi32(pairs, 16)" in code or supported_native()
    assert torch.equal(many, dot_pairs_reference(x, linear.weight).to(torch.bfloat16))
    assert torch.equal(many, rows)


def test_triton_kernel_inside_the_pipeline_equals_reference(models, monkeypatch):  # noqa: F811
    # on the device the kernel runs on (interpreted on CPU); the reference forced where CUDA would
    # otherwise take the kernel for both runs
    from kernel_device import KERNEL_DEVICE

    target, draft = models
    ids = prompts(lengths=(4, 9))
    recipe = make_recipe(target, draft, k=2, batch=2, stochastic=True, temperature=0.9, top_k=20,
                         device=KERNEL_DEVICE.type)
    verify = unified.verify
    monkeypatch.setattr(unified, "verify", functools.partial(verify, force_kernel=False))
    reference, _ = run(runner_for(recipe), ids, max_tokens=6)
    monkeypatch.setattr(unified, "verify", functools.partial(verify, force_kernel=True))
    kernel, totals = run(runner_for(recipe), ids, max_tokens=6)
    assert kernel == reference and totals.spec.num_drafts > 0


def test_the_disk_cache_never_serves_another_models_weights(tmp_path):
    """Compiled code with frozen weights is cached on disk; a second model of the same shape (new
    process, same cache) must still decode with ITS weights."""
    import json
    import os
    import shutil
    import subprocess
    import sys

    script = tmp_path / "run.py"
    script.write_text(f"""
import sys, json
sys.path.insert(0, {str(Path(__file__).parent)!r})
from pathlib import Path
from checkpoints import tiny_llama_config, write_llama_checkpoint
from specgen.job import build_runner, resolve
from specgen.pipelines.requests import Request
from specgen.recipe import recipe_from_dict
seed, compile = int(sys.argv[1]), sys.argv[2] == "1"
folder = Path({str(tmp_path)!r}) / f"t{{seed}}"
if not folder.exists():
    write_llama_checkpoint(folder, tiny_llama_config(), seed=seed)
recipe = recipe_from_dict({{"target": {{"model": str(folder)}}, "draft": {{"method": "none"}},
    "sampling": {{"max_tokens": 8, "ignore_eos": True}}, "chat_template": False,
    "runtime": {{"device": "cpu", "batch_size": 2, "max_seq_len": 64, "compile": compile}}}})
runner, _, _ = build_runner(recipe, resolve(recipe), 0)
out = {{}}
runner.run([Request(f"p{{i}}", [5, 6, 7 + i], 8, i) for i in range(3)], lambda c: out.__setitem__(c.id, c.token_ids))
print(json.dumps(out))
""")

    def tokens(seed, cache):
        env = dict(os.environ, SPECGEN_CACHE=str(tmp_path / cache), PYTHONPATH=os.pathsep.join(sys.path))
        # this process's own compile cache (set by any runner it built) would win over SPECGEN_CACHE
        env.pop("TORCHINDUCTOR_CACHE_DIR", None)
        env.pop("TRITON_CACHE_DIR", None)
        run = subprocess.run([sys.executable, str(script), str(seed), "1"], env=env,
                             capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-2000:]
        return json.loads(run.stdout.strip().splitlines()[-1])

    # The second model's run finds the first's compiled code in the shared cache; it must decode as
    # the same model compiled from a cache without graphs does (compiled code against compiled code:
    # eager decoding computes other bits, and a tiny random model has near-ties that flip on them).
    # That cache keeps the shared one's C++ kernels (compiled from source, keyed by it), so the
    # reference lowers its graph anew without paying every kernel's compile again.
    first, second = tokens(1, "common"), tokens(2, "common")
    shutil.copytree(tmp_path / "common", tmp_path / "own",
                    ignore=lambda folder, names: [n for n in names if n in ("fxgraph", "aotautograd")])
    assert second == tokens(2, "own") and first != second


# Only where specgen's row-invariant bf16 micro-kernels run every GEMM (kernels/cpu_bf16_dot.py):
# elsewhere (AVX2 CPUs, where `auto` takes float32) the README promises no identical bf16 tokens, and
# none come (on an AMD EPYC Zen 3 this test's bf16 runs part, at 0e20d77 as since).
@pytest.mark.skipif(not cpu_has_avx512(), reason="bf16 tokens are identical only where AVX-512 runs specgen's GEMM kernels")
def test_compiled_speculative_step_equals_plain_decoding_in_bfloat16(tmp_path):
    """In bf16 a row's numbers depend on more than its inputs (GEMM kernels, attention's blocking,
    where a fused kernel rounds): verifying a token beside K drafts must still compute what a plain
    job (`draft.method: none`, its own compiled step) computes for it, to the bit, or greedy outputs
    part. SmolLM2's head layout (64-wide heads, 3 query heads per KV head), K pinned to 3 with a
    random draft: each step verifies 4 rows and keeps about 1."""
    from checkpoints import tiny_eagle3_config, tiny_llama_config, write_eagle3_checkpoint, write_llama_checkpoint

    from specgen.pipelines.policy import FixedPolicy

    config = tiny_llama_config(hidden_size=384, intermediate_size=512, num_attention_heads=6,
                               num_key_value_heads=2, head_dim=64)
    target = write_llama_checkpoint(tmp_path / "target", config)
    draft = write_eagle3_checkpoint(tmp_path / "eagle3", tiny_eagle3_config(config), config)
    ids = prompts(lengths=(3, 11, 6, 9, 14, 5))

    def bf16(recipe):
        return dataclasses.replace(recipe, target=dataclasses.replace(recipe.target, dtype="bfloat16"))

    plain, _ = run(runner_for(bf16(make_recipe(target, batch=1, compile=True))), ids, max_tokens=40)
    runner = runner_for(bf16(make_recipe(target, draft, k=3, batch=1, compile=True)))
    runner.use_policy(FixedPolicy(3))
    spec, totals = run(runner, ids, max_tokens=40)
    assert totals.k_steps[3] == totals.steps > 0
    assert spec == plain


def test_compiled_rotary_angles_are_stored_once_with_the_eager_bits():
    # Compiled, cos/sin must reach Inductor as one opaque op: as pointwise code it folded their trig
    # into the attention's loop over keys (one vector cos and sin per key, head and query row).
    # The op runs the eager code, so compiled and eager rotations agree bit for bit.
    from specgen.models.layers import RopeSettings, rope_cos_sin, rope_inv_freq

    inv_freq = rope_inv_freq(16, RopeSettings(theta=500000.0, rope_type="llama3", params={
        "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}))
    positions = torch.tensor([[0, 1, 2], [37, 900, 4095]])
    graphs = []

    def keep_graph(gm, example_inputs):
        graphs.append(gm.code)
        return gm

    def rotate(positions):
        return rope_cos_sin(positions, inv_freq, torch.float32, 1.25)

    torch._dynamo.reset()
    compiled = torch.compile(rotate, backend=keep_graph, fullgraph=True)(positions)
    inductor = torch.compile(rotate, fullgraph=True)(positions)
    eager = rotate(positions)
    assert any("specgen.rope_angles" in code for code in graphs)
    assert not any(".cos(" in code or "torch.cos" in code for code in graphs)
    for got in (compiled, inductor):
        assert all(torch.equal(g, e) for g, e in zip(got, eager))
    assert eager[0].shape == (2, 3, 1, 16)


def test_the_compiled_prefill_of_a_capturing_target_equals_eager(models, monkeypatch):  # noqa: F811
    """CUDA compiles the prefill as well (dynamic rows and length); its first run on an H200 failed
    to trace the layers an EAGLE-3 target captures. Compiled here on CPU, where it is otherwise
    eager: the tokens and the drafts' acceptances are the eager runner's, and the warm-up compiled
    every graph the run needs."""
    import specgen.pipelines.compiled as compiled

    target, draft = models
    ids = prompts(lengths=(3, 11, 6, 17, 2))
    eager, eager_totals = run(runner_for(make_recipe(target, draft, k=2, batch=2)), ids, max_tokens=10)
    monkeypatch.setattr(compiled, "compiles_prefill", lambda device: True)
    # unfrozen, as on CUDA (what this test stands for): a frozen CPU prefill takes the C++ GEMM
    # template at dynamic row counts, minutes of compiling that no run ever does
    monkeypatch.setattr(compiled, "freezes", lambda device, slots: False)
    runner = runner_for(make_recipe(target, draft, k=2, batch=2, compile=True))
    assert runner.functions.prefill_compiled and not runner.functions.frozen
    runner.warm_up()
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    tokens, totals = run(runner, ids, max_tokens=10)
    # ragged prompts (one and two rows, lengths 2 to 17) after the warm-up: nothing compiled mid-run
    # (GPU_NOTES 6: a guard on the prompt length would compile again at the first longer prompt)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    assert tokens == eager
    assert totals.spec.acceptance_histogram == eager_totals.spec.acceptance_histogram


@pytest.mark.parametrize("threads", [1, 2])
def test_a_compiled_step_reads_a_bf16_value_as_rounded_in_every_consumer(threads, lowered_anew):
    """A bf16 GEMM's output read by a consumer fused into its kernel (the C++ template's epilogue) and
    by one that reads the stored tensor must see the same rounded value, as eager does. Inductor keeps
    the float32 accumulator for the fused consumer unless `emulate_precision_casts` is on: the lm
    head's epilogue then computed top-p's radix keys (sampling.py) from unrounded logits, its
    probabilities came from the rounded ones, and a cut-off above every rounded logit kept no token
    (token 0 sampled: benchmarks/exactness.py, compiled seeded steps of 4 rows at 8 slots)."""
    from specgen.pipelines.compiled import compile_frozen_on_cpu
    from specgen.sampling import _order_key

    class Head(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(
                torch.randn(4096, 576, generator=torch.Generator().manual_seed(0)).bfloat16() * 0.05,
                requires_grad=False)

        def forward(self, hidden: torch.Tensor, temperature: torch.Tensor):
            # hidden: [32, 576] bf16; temperature: [32, 1] -> logits [32, 4096] bf16 and their keys
            logits = torch.nn.functional.linear(hidden, self.weight)
            return logits, _order_key(logits.float() / temperature + 0.0)

    head = Head().eval()
    hidden = torch.randn(32, 576, generator=torch.Generator().manual_seed(1)).bfloat16()
    temperature = torch.full((32, 1), 0.8)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            logits, keys = compile_frozen_on_cpu(head.forward)(hidden, temperature)
    finally:
        torch.set_num_threads(previous)
    assert logits.dtype == torch.bfloat16
    assert torch.equal(keys, _order_key(logits.float() / temperature + 0.0))
