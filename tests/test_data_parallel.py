"""Data parallel under torchrun (CPU, gloo, spawned ranks): the split of the prompts, the parts and
their merge, and whole jobs: 2 ranks write what one process writes, and a rank killed mid-run loses
nothing and duplicates nothing once the same command runs again."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import yaml
from checkpoints import tiny_eagle3_config, tiny_llama_config, write_eagle3_checkpoint, write_llama_checkpoint

from specgen.parallel.shards import finished_ids, merge_parts, part_files, part_path, remove_parts, shard_of
from specgen.parallel.world import World

TESTS = Path(__file__).resolve().parent
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


# ------------------------------------------------------------------------------------------ shards


def test_every_id_falls_in_exactly_one_shard_the_same_in_every_process():
    ids = [f"prompt-{n}" for n in range(2000)]
    for ranks in (1, 2, 3, 8):
        shards = [shard_of(i, ranks) for i in ids]
        assert all(0 <= s < ranks for s in shards)
        counts = Counter(shards)
        assert min(counts.values()) > 0.8 * len(ids) / ranks       # balanced
    # a stable hash (not Python's salted hash()): another interpreter computes the same split
    code = "from specgen.parallel.shards import shard_of; print([shard_of(f'prompt-{n}', 3) for n in range(50)])"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env=dict(os.environ, PYTHONHASHSEED="123"))
    assert json.loads(other.stdout) == [shard_of(f"prompt-{n}", 3) for n in range(50)]


def line(request_id: str, text: str = "x") -> str:
    return json.dumps({"id": request_id, "text": text}) + "\n"


def test_parts_count_as_done_and_merge_once_in_prompt_order(tmp_path):
    out = tmp_path / "out[1].jsonl"            # glob characters in the name are taken literally
    out.write_text(line("a") + line("b"))
    part_path(out, 1).write_text(line("d") + line("c") + '{"id": "e", "te')   # a killed rank's torn line
    part_path(out, 3).write_text(line("b", "again") + line("f"))   # an earlier run's, with more ranks
    (tmp_path / "out[1].jsonl.rank-x.part").write_text(line("z"))  # not a part
    assert part_files(out) == [part_path(out, 1), part_path(out, 3)]
    assert finished_ids(out) == {"a", "b", "c", "d", "f"}
    assert merge_parts(out, order=["a", "b", "c", "d", "e", "f"]) == 3
    records = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["id"] for r in records] == ["a", "b", "c", "d", "f"]
    assert records[1]["text"] == "x"            # the output's own record stays; no duplicate
    assert part_files(out) == []
    assert merge_parts(out) == 0                # nothing left: a second merge changes nothing


def test_a_whole_record_without_its_newline_is_not_done(tmp_path):
    # a killed writer's last line may be whole JSON yet lack its newline: the resumed writer cuts
    # it, so it must count as not done, or that prompt would be lost
    out = tmp_path / "out.jsonl"
    out.write_text(line("a") + line("b").rstrip("\n"))
    part_path(out, 1).write_text(line("c") + line("d").rstrip("\n"))
    assert finished_ids(out) == {"a", "c"}


def test_a_run_that_starts_over_drops_the_parts_of_ranks_it_does_not_have(tmp_path):
    out = tmp_path / "out.jsonl"
    for rank in (1, 2, 3):
        part_path(out, rank).write_text(line(str(rank)))
    remove_parts(out, from_rank=2)
    assert part_files(out) == [part_path(out, 1)]


def test_the_world_comes_from_torchruns_variables():
    assert World.from_env({}) == World()
    w = World.from_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"})
    assert (w.rank, w.size, w.local_rank, w.local_size, w.leader, w.distributed) == (3, 4, 1, 2, False, True)
    with pytest.raises(ValueError, match="RANK 4, WORLD_SIZE 4"):
        World.from_env({"RANK": "4", "WORLD_SIZE": "4"})


# ------------------------------------------------------------------------------------ whole jobs


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("dp")
    config = tiny_llama_config(vocab_size=300)
    target = write_llama_checkpoint(root / "target", config)
    draft = write_eagle3_checkpoint(root / "eagle3", tiny_eagle3_config(config, draft_vocab_size=200), config)
    prompts = root / "prompts.jsonl"
    ids = [f"p{n}" for n in range(14)]
    assert min(Counter(shard_of(i, 2) for i in ids).values()) >= 4     # each rank has a few to lose
    prompts.write_text("".join(json.dumps({"id": i, "prompt": f"tell me about {n} things " * (1 + n % 3)}) + "\n"
                               for n, i in enumerate(ids)) + "{not json\n")
    recipe = root / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({
        "target": {"model": str(target)},
        "draft": {"method": "eagle3", "model": str(draft), "num_speculative_tokens": 2},
        # seeded sampling: every token depends on the seed and the id's noise, not on the rank
        "sampling": {"max_tokens": 10, "seed": 7, "temperature": 0.8, "ignore_eos": True},
        "runtime": {"device": "cpu", "batch_size": 2, "max_seq_len": 128, "threads": 1, "compile": False},
        "chat_template": False,
    }))
    single = root / "single.jsonl"
    cli(recipe, prompts, single)          # the bad line is an error record: exit 3
    return root, recipe, prompts, by_id(single)


def cli(recipe, prompts, out, *, launcher=(), errors=True):
    """`specgen run` (under `launcher`); `errors`: the output holds error records (the bad line),
    which one process says with exit code 3, and a torchrun job in its summary (exit 0: torchrun
    reads any non-zero exit as the job's failure)."""
    done = subprocess.run([*launcher, *([] if launcher else [sys.executable]), "-m", "specgen", "run", str(recipe),
                           "--prompts", str(prompts), "--output", str(out)],
                          capture_output=True, text=True, timeout=600, env=_env())
    assert done.returncode == (3 if errors and not launcher else 0), done.stdout + done.stderr
    assert ("1 of 15 records are errors" in " ".join(done.stderr.split())) is errors, done.stderr
    return done


def _env():
    # one thread per rank; no inherited torchrun variables from an outer launcher
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT", "LOCAL_WORLD_SIZE")}
    return env | {"OMP_NUM_THREADS": "1"}


def by_id(path: Path) -> dict[str, dict]:
    records = [json.loads(x) for x in path.read_text().splitlines()]
    ids = [r["id"] for r in records]
    assert len(ids) == len(set(ids)), "a duplicated id"
    return {r["id"]: r for r in records}


def same_results(a: dict[str, dict], b: dict[str, dict]) -> None:
    assert a.keys() == b.keys()
    for i in a:
        assert (a[i]["token_ids"], a[i]["finish_reason"]) == (b[i]["token_ids"], b[i]["finish_reason"]), i


def test_two_ranks_write_what_one_process_writes(job):
    root, recipe, prompts, single = job
    out = root / "two.jsonl"
    done = cli(recipe, prompts, out, launcher=TORCHRUN)
    same_results(by_id(out), single)
    assert part_files(out) == []                       # merged
    stats = json.loads((root / "two.jsonl.stats.json").read_text())
    assert stats["complete"] and stats["requests"] == 15 and stats["errors"] == 1
    ranks = stats["data_parallel"]["per_rank"]
    assert [r["rank"] for r in ranks] == [0, 1] and all(r["requests"] >= 4 for r in ranks)
    assert sum(r["requests"] for r in ranks) == stats["this_run"]["requests"] == 15
    assert stats["output_tokens"] == sum(r["num_output_tokens"] for r in single.values())
    assert stats["spec"]["num_drafts"] == sum(r["spec"]["num_drafts"] for r in single.values() if r["spec"])
    said = " ".join(done.stderr.split())        # rich wraps at the console's width
    assert "over 2 data-parallel ranks" in said and "data parallel: copy 1 of 2" in said


def test_a_rank_killed_mid_run_loses_and_duplicates_nothing_when_the_command_runs_again(job):
    root, recipe, prompts, single = job
    out = root / "killed.jsonl"
    killed = subprocess.run([*TORCHRUN, str(TESTS / "dp_worker.py"), str(recipe), str(prompts), str(out),
                             "--die-after", "2"], capture_output=True, text=True, timeout=600, env=_env())
    assert killed.returncode != 0, killed.stdout + killed.stderr
    lost = by_id(part_path(out, 1))                   # rank 1 wrote 2 prompts before it died
    assert len(lost) >= 2 and len(lost) < sum(shard_of(i, 2) == 1 for i in single)
    kept = len(by_id(out)) + len(lost)                # rank 0's, in the output itself
    # the same command again (as the CLI): it makes only what the killed run had not written
    cli(recipe, prompts, out, launcher=TORCHRUN)
    same_results(by_id(out), single)
    assert part_files(out) == []
    stats = json.loads((root / "killed.jsonl.stats.json").read_text())
    assert stats["this_run"]["resumed_past"] == kept and stats["this_run"]["requests"] == 15 - kept
    # and a third time: nothing left to do
    cli(recipe, prompts, out, launcher=TORCHRUN)
    same_results(by_id(out), single)
    stats = json.loads((root / "killed.jsonl.stats.json").read_text())
    assert stats["this_run"]["requests"] == 0 and stats["this_run"]["resumed_past"] == 15


def test_a_single_process_resumes_what_two_ranks_left(job):
    root, recipe, prompts, single = job
    out = root / "reshard.jsonl"
    killed = subprocess.run([*TORCHRUN, str(TESTS / "dp_worker.py"), str(recipe), str(prompts), str(out),
                             "--die-after", "1"], capture_output=True, text=True, timeout=600, env=_env())
    assert killed.returncode != 0 and part_files(out)
    kept = len(by_id(out)) + sum(len(by_id(part)) for part in part_files(out))
    cli(recipe, prompts, out)                # no torchrun: one process takes every shard
    same_results(by_id(out), single)
    assert part_files(out) == []
    stats = json.loads((root / "reshard.jsonl.stats.json").read_text())
    assert stats["this_run"]["requests"] == 15 - kept and stats["requests"] == 15
