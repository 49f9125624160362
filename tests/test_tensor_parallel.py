"""Tensor parallel under torchrun (CPU, gloo, 2 spawned ranks): each rank's slice of the target gives
the single-process logits, and speculative decoding on the split target is lossless (greedy and
seeded sampled speculative output == plain output on the same split target, for each draft)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from checkpoints import tiny_eagle3_config, tiny_llama_config, write_eagle3_checkpoint, write_llama_checkpoint
from checkpoints_deepseek import tiny_deepseek_config, tiny_kimi_config, write_deepseek_checkpoint, write_kimi_checkpoint
from checkpoints_dflash import tiny_dflash_config, write_dflash_checkpoint

from specgen.checkpoints.loading import load_target
from specgen.checkpoints.store import read_config
from specgen.models.tensor_parallel import TensorParallel, rank_shape, shard_fused_state

TESTS = Path(__file__).resolve().parent
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


def _env():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT", "LOCAL_WORLD_SIZE")}
    return env | {"OMP_NUM_THREADS": "1"}


def run(args, expect=0, env=None):
    done = subprocess.run(args, capture_output=True, text=True, timeout=600, env=_env() | (env or {}))
    assert done.returncode == expect, done.stdout + done.stderr
    return done


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    config = tiny_llama_config(vocab_size=300)        # 4 heads, 2 KV heads, 96 MLP rows: 2 ways
    return root, config, write_llama_checkpoint(root / "target", config)


def test_the_slices_of_a_state_put_back_together_are_the_state(llama):
    _, config, folder = llama
    whole = load_target(read_config(folder), folder, dtype=torch.float32, device="cpu", dummy=False)
    state = {k: v.clone() for k, v in whole.state_dict().items()}
    slices = [shard_fused_state(dict(state), whole.config, TensorParallel(r, 2), ["model.layers.0."])
              for r in range(2)]
    d, heads, kv = whole.config.head_dim, whole.config.num_heads, whole.config.num_kv_heads
    qkv = [s["model.layers.0.self_attn.qkv_proj.weight"].split([heads // 2 * d, kv // 2 * d, kv // 2 * d])
           for s in slices]
    q, k, v = state["model.layers.0.self_attn.qkv_proj.weight"].split([heads * d, kv * d, kv * d])
    # rank r holds query heads r*H/2.. and the KV heads they read
    assert torch.equal(torch.cat([qkv[0][0], qkv[1][0]]), q) and torch.equal(torch.cat([qkv[0][1], qkv[1][1]]), k)
    assert torch.equal(torch.cat([qkv[0][2], qkv[1][2]]), v)
    o = state["model.layers.0.self_attn.o_proj.weight"]
    assert torch.equal(torch.cat([s["model.layers.0.self_attn.o_proj.weight"] for s in slices], dim=1), o)
    gate, up = state["model.layers.0.mlp.gate_up_proj.weight"].chunk(2)
    parts = [s["model.layers.0.mlp.gate_up_proj.weight"].chunk(2) for s in slices]
    assert torch.equal(torch.cat([parts[0][0], parts[1][0]]), gate) and torch.equal(torch.cat([parts[0][1], parts[1][1]]), up)
    assert rank_shape(whole.config, TensorParallel(1, 2)).num_kv_heads == kv // 2


@pytest.fixture(scope="module")
def targets(llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("tp-targets")
    return {"llama": llama[2],
            # MLA heads, a dense layer, then MoE layers (8 experts, a shared one); FP8 weights
            "deepseek-v3": write_deepseek_checkpoint(root / "deepseek", tiny_deepseek_config(fp8=True)),
            # as released: routed experts packed INT4 in groups of 32 (64 rows each: a rank's half of
            # an expert's down columns fills whole groups)
            "kimi-k2.5": write_kimi_checkpoint(root / "kimi", tiny_kimi_config(int4=True, moe_intermediate_size=64))}


SPLITS = {"llama": ["tp"], "deepseek-v3": ["tp", "ep", "tp+fp8", "ep+fp8"],
          "kimi-k2.5": ["tp", "ep", "tp+int4", "ep+int4"]}


@pytest.mark.parametrize("target", list(SPLITS))
def test_each_rank_computes_the_single_process_logits(targets, target, tmp_path):
    """Every split of each layout (`ep`: whole experts per rank; `+fp8`: the FP8 weights stay FP8,
    target.fp8_weights: keep, and split with their scales; `+int4`: the packed INT4 experts stay
    packed and split with their scales)."""
    folder, modes = targets[target], SPLITS[target]
    singles = sorted({"single" + m[2:] for m in modes})
    run([sys.executable, str(TESTS / "tp_worker.py"), str(folder), str(tmp_path), ",".join(singles)])
    run([*TORCHRUN, str(TESTS / "tp_worker.py"), str(folder), str(tmp_path), ",".join(modes)])
    for mode in modes:
        single = torch.load(tmp_path / f"single{mode[2:]}.pt")
        ranks = [torch.load(tmp_path / f"{mode}-rank-{r}.pt") for r in range(2)]
        assert torch.equal(ranks[0], ranks[1]), mode        # every rank verifies the same logits
        # kept INT4: the products take their activations in bf16, so the float32 sums' other order
        # across ranks (tp: each rank's partial down product; ep: the pairs and the shared experts'
        # halves) moves a bf16 rounding now and then, layer after layer (ep measured 2.4e-3, tp 7.2e-3)
        tolerance = 2e-2 if mode.endswith("int4") else 1e-5
        torch.testing.assert_close(ranks[0], single, rtol=tolerance, atol=tolerance, msg=mode)
        assert single.std() > 0.1


@pytest.fixture(scope="module")
def job(llama):
    root, config, target = llama
    drafts = {"eagle3": write_eagle3_checkpoint(root / "eagle3", tiny_eagle3_config(config, draft_vocab_size=200),
                                                config),
              "dflash": write_dflash_checkpoint(root / "dflash", tiny_dflash_config(config, layers=2, block_size=4))}
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{n}", "prompt": f"count {n} sheep " * (1 + n % 3)}) + "\n"
                               for n in range(6)))
    return root, target, drafts, prompts


def tp_run(job, name, *, method="none", k=2, sampled=False, launcher=TORCHRUN, tp=2, expect=0,
           expert_parallel=False, env=None):
    root, target, drafts, prompts = job
    draft = {"method": method}
    if method != "none":
        draft["num_speculative_tokens"] = k
        if drafts.get(method) is not None:
            draft["model"] = str(drafts[method])
    recipe = {"target": {"model": str(target)},
              "draft": draft,
              "sampling": {"max_tokens": 12, "seed": 3, "ignore_eos": True,
                           **({"temperature": 0.9, "top_p": 0.95} if sampled else {})},
              "runtime": {"device": "cpu", "batch_size": 3, "max_seq_len": 128, "threads": 1, "compile": False,
                          "tensor_parallel_size": tp, "expert_parallel": expert_parallel},
              "chat_template": False}
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    out = root / f"{name}.jsonl"
    done = run([*launcher, *([] if launcher else [sys.executable]), "-m", "specgen", "run", str(path),
                "--prompts", str(prompts), "--output", str(out)], expect=expect, env=env)
    if expect:
        return " ".join((done.stdout + done.stderr).split())
    return {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}, " ".join(done.stderr.split())


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded-sampled"])
def test_speculative_output_equals_plain_output_on_a_split_target(job, sampled):
    plain, said = tp_run(job, f"plain-{sampled}", sampled=sampled)
    assert "tensor parallel: rank 0 of 2" in said and "split over 2 tensor-parallel ranks" in said
    assert len(plain) == 6 and all(r["num_output_tokens"] == 12 for r in plain.values())
    # greedy: both drafts and auto's shared k; sampled: the rejection rule once (each run spawns ranks)
    methods = [("eagle3", 2), ("dflash", 3), ("eagle3", "auto")] if not sampled else [("eagle3", 2)]
    for method, k in methods:
        spec, _ = tp_run(job, f"{method}-{k}-{sampled}", method=method, k=k, sampled=sampled)
        assert {i: r["token_ids"] for i, r in spec.items()} == {i: r["token_ids"] for i, r in plain.items()}, method
        if k != "auto":   # auto, on a job this short, may rightly take plain steps only (its k is rank 0's)
            assert sum(r["spec"]["num_drafts"] for r in spec.values()) > 0


def test_each_rank_leaves_without_finalizing_once_the_job_is_written(job, tmp_path):
    """parallel/world.leave_process: torch keeps gloo's worker threads past destroy_process_group,
    and one freeing its last collective's tensors while the interpreter finalizes aborts the rank
    (SIGABRT after a complete job, seen under load). A rank of `specgen run` ends before finalizing:
    an exit hook (atexit, which finalizing runs first) never runs, on either rank, and the job is whole."""
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    # the hook marks the ranks (`python -m specgen`) and the launcher, not the probes they start
    # (sys.argv is read at exit: while site imports it, `-m`'s module path is not there yet)
    (hooks / "sitecustomize.py").write_text(
        "import atexit, os, pathlib, sys\n"
        "def mark():\n"
        "    who = sys.argv[0].replace(os.sep, '/')\n"
        "    name = ('rank-' + os.environ.get('RANK', '?') if who.endswith('specgen/__main__.py') else\n"
        "            'launcher' if who.endswith('torch/distributed/run.py') else None)\n"
        "    if name:\n"
        f"        (pathlib.Path({str(tmp_path)!r}) / ('finalized-' + name)).write_text('')\n"
        "atexit.register(mark)\n")
    path = os.pathsep.join(filter(None, (str(hooks), os.environ.get("PYTHONPATH"))))
    out, _ = tp_run(job, "leaves", env={"PYTHONPATH": path})
    assert len(out) == 6 and all(r["num_output_tokens"] == 12 for r in out.values())
    finalized = sorted(p.name for p in tmp_path.glob("finalized-*"))
    # the launcher finalizes as any process does (the hook works); the ranks do not
    assert finalized == ["finalized-launcher"], finalized


def test_a_split_the_target_or_the_launch_cannot_take_is_a_clear_error(job):
    said = tp_run(job, "one-process", launcher=(), expect=2)
    assert "recipe.runtime.tensor_parallel_size: 2 ranks hold one copy" in said and "torchrun" in said
    said = tp_run(job, "three-ways", launcher=[*TORCHRUN[:-1], "3"], tp=3, expect=1)
    assert "does not divide the target's attention heads (4)" in said


@pytest.fixture(scope="module")
def deepseek_job(job, tmp_path_factory):
    root = tmp_path_factory.mktemp("tp-deepseek")
    # byte-tokenised prompts need ids up to 258; the MTP layer lives in the target's checkpoint
    target = write_deepseek_checkpoint(root / "deepseek", tiny_deepseek_config(vocab_size=300, fp8=True))
    return root, target, {"mtp": None}, job[3]


@pytest.mark.parametrize(("expert_parallel", "sampled"), [(False, False), (True, True)],
                         ids=["tp-greedy", "ep-seeded-sampled"])
def test_mtp_on_a_split_deepseek_target_is_lossless(deepseek_job, expert_parallel, sampled):
    name = f"{'ep' if expert_parallel else 'tp'}-{sampled}"
    plain, said = tp_run(deepseek_job, f"plain-{name}", sampled=sampled, expert_parallel=expert_parallel)
    assert "split over 2 tensor-parallel ranks" in said
    spec, _ = tp_run(deepseek_job, f"mtp-{name}", method="mtp", k=2, sampled=sampled,
                     expert_parallel=expert_parallel)
    assert {i: r["token_ids"] for i, r in spec.items()} == {i: r["token_ids"] for i, r in plain.items()}
    assert sum(r["spec"]["num_drafts"] for r in spec.values()) > 0


# name -> (the job's fixture, draft.method, expert parallel)
ORACLE_JOBS = {"llama-eagle3": ("job", "eagle3", False), "deepseek-ep-mtp": ("deepseek_job", "mtp", True)}


@pytest.mark.parametrize("name", list(ORACLE_JOBS))
def test_auto_k_is_one_k_per_step_on_every_rank_while_drafts_are_accepted(request, name):
    """`num_speculative_tokens: auto` on a split target, its draft's picks the tokens plain decoding
    emits, spoiled at chosen positions (tp_worker.py oracle-job), so blocks are accepted and the
    policy's estimates move: every rank runs the same k at every step (each times its own steps;
    the copy's first rank decides, parallel/decisions.py) and the output is the single-process
    plain output."""
    from specgen.job import run_job
    from specgen.recipe import recipe_from_dict

    fixture, method, expert_parallel = ORACLE_JOBS[name]
    root, target, drafts, prompts = request.getfixturevalue(fixture)

    def recipe(draft, tp):
        return {"target": {"model": str(target), "dtype": "float32"}, "draft": draft,
                "sampling": {"max_tokens": 12, "seed": 3, "ignore_eos": True},
                "runtime": {"device": "cpu", "batch_size": 3, "max_seq_len": 128, "threads": 1,
                            "compile": False, "tensor_parallel_size": tp,
                            "expert_parallel": expert_parallel and tp > 1},
                "chat_template": False}

    plain_out, out = root / f"oracle-plain-{name}.jsonl", root / f"oracle-auto-{name}.jsonl"
    threads = torch.get_num_threads()
    try:        # the single-process plain output, in this process
        run_job(recipe_from_dict(recipe({"method": "none"}, 1)), prompts=str(prompts), output=str(plain_out),
                resume=False)
    finally:
        torch.set_num_threads(threads)
    draft = {"method": method, "num_speculative_tokens": "auto"}
    if drafts.get(method) is not None:
        draft["model"] = str(drafts[method])
    path = root / f"oracle-auto-{name}.yaml"
    path.write_text(yaml.safe_dump(recipe(draft, 2)))
    run([*TORCHRUN, str(TESTS / "tp_worker.py"), "oracle-job", str(path), str(prompts), str(out), str(plain_out)])
    plain = {r["id"]: r["token_ids"] for r in map(json.loads, plain_out.read_text().splitlines())}
    spec = {r["id"]: r["token_ids"] for r in map(json.loads, out.read_text().splitlines())}
    assert len(plain) == 6 and spec == plain
    stats = json.loads((root / f"{out.name}.stats.json").read_text())
    assert "tensor parallel: rank 0 of 2" in stats["header"] and "K=auto" in stats["header"], stats["header"]
    ks = [json.loads((root / f"{out.name}.k-rank-{r}.json").read_text()) for r in range(2)]
    assert stats["spec"]["num_accepted_tokens"] > 0, (stats["spec"], ks)
    assert ks[0] == ks[1], ks
    # the steps logged are the job's (its statistics count the first rank's)
    k_steps = stats["speculation"]["k_steps"]
    assert any(ks[0]) and k_steps == [ks[0].count(k) for k in range(len(k_steps))], (k_steps, ks)


def test_inspect_and_the_memory_check_count_one_ranks_share(targets):
    from specgen.inspection.report import inspect_checkpoint

    whole = inspect_checkpoint(str(targets["deepseek-v3"]), tensor_parallel=1)
    split = inspect_checkpoint(str(targets["deepseek-v3"]), tensor_parallel=2, expert_parallel=True)
    rank = split.memory["per_rank"]
    assert "per_rank" not in whole.memory and split.runnable
    # the embedding, head and router are whole on every rank: more than half, less than all
    assert whole.memory["weights_bytes"] / 2 < rank["weights_bytes"] < whole.memory["weights_bytes"]
    assert rank["kv_cache_bytes"] == whole.memory["kv_cache_bytes"]          # the latent cache is whole
    llama = inspect_checkpoint(str(targets["llama"]), tensor_parallel=2)
    assert llama.memory["per_rank"]["kv_cache_bytes"] * 2 == llama.memory["kv_cache_bytes"]
    three = inspect_checkpoint(str(targets["llama"]), tensor_parallel=3)
    assert not three.runnable and any("does not divide the target's attention heads (4)" in p for p in three.problems)

    from specgen.job import Resolved, estimate_bytes
    from specgen.recipe import recipe_from_dict

    config = read_config(targets["llama"])
    plan = {"target": {"model": "m"}, "runtime": {"batch_size": 4, "max_seq_len": 256}}
    one, two = (estimate_bytes(recipe_from_dict(dict(plan, runtime=dict(plan["runtime"], tensor_parallel_size=n))),
                               Resolved(torch.device("cpu"), torch.float32, None, config, None, None, torch.float32))
                for n in (1, 2))
    assert two["target KV cache"] * 2 == one["target KV cache"]
    assert one["target weights"] / 2 < two["target weights"] < one["target weights"]
