"""A bench report three ways: a Rich table, JSON (every figure), and a PNG (matplotlib); Markdown
from the JSON is bench/markdown.py's.

The JSON's head: command, commit (source_commit), cpu (machine.cpu_description), date, prompts,
options, device, dtype, threads, versions.

JSON fields per measurement: config, batch_size, tokens_per_second (median), samples (one per round),
speedup_vs_ar, speedup_vs_hf and speedup_vs_llamacpp (median of the rounds' paired ratios), mean_acceptance_length,
draft_acceptance_rate, acceptance_rate_per_position, acceptance_histogram, num_drafts, k_histogram
(steps per k drafted: `auto` chooses), step_ms (timed runs, prefill left out), step_ratio (over ar's,
paired by round), split_ms (eager twin: target / verify / draft / prefill / host /
total, ms per step), warmup_seconds, shares_runner_of (the config whose compiled step it ran on; its
warm-up is then what it added), compiled, peak_memory_bytes, output_tokens, error (what a failed
configuration raised, or why a skipped one was not run; its figures are then null), skipped (true:
it would not fit in memory beside the others, bench/measure.memory_shortfall), dtype (hf: the dtype
transformers ran in; on CPU the faster of float32 and bf16, bench/hf.py; llamacpp: the GGUF's block
formats, and the fallback it took if llama.cpp crashed, bench/llamacpp.py). The "vs llama.cpp" column
appears where the llamacpp baseline ran.
"""

from __future__ import annotations

import json
import os
import platform
from dataclasses import asdict
from pathlib import Path

from rich.table import Table

from specgen.bench.measure import BenchReport, Measurement

FIELDS = ("config", "batch_size", "tokens_per_second", "samples", "leg_samples", "speedup_vs_ar",
          "speedup_vs_hf", "speedup_vs_llamacpp", "mean_acceptance_length", "draft_acceptance_rate", "acceptance_rate_per_position",
          "acceptance_histogram", "num_drafts", "k_histogram", "step_ms", "step_ratio", "split_ms",
          "warmup_seconds", "shares_runner_of", "compiled", "peak_memory_bytes", "output_tokens", "error",
          "skipped", "dtype")


def measurement_dict(m: Measurement) -> dict:
    spec = m.spec or {}
    return {
        "config": m.config, "batch_size": m.batch_size, "tokens_per_second": m.tokens_per_second,
        "samples": m.samples, "leg_samples": m.leg_samples, "speedup_vs_ar": m.speedup_vs_ar,
        "speedup_vs_hf": m.speedup_vs_hf, "speedup_vs_llamacpp": m.speedup_vs_llamacpp,
        "mean_acceptance_length": spec.get("mean_acceptance_length"),
        "draft_acceptance_rate": spec.get("draft_acceptance_rate"),
        "acceptance_rate_per_position": spec.get("acceptance_rate_per_position"),
        "acceptance_histogram": spec.get("acceptance_histogram"), "num_drafts": spec.get("num_drafts"),
        "k_histogram": spec.get("k_histogram"), "step_ms": m.step_ms, "step_ratio": m.step_ratio,
        "split_ms": m.split_ms, "warmup_seconds": m.warmup_seconds, "shares_runner_of": m.shares_runner_of,
        "policy": m.policy,
        "compiled": m.compiled, "peak_memory_bytes": m.peak_memory_bytes, "output_tokens": m.output_tokens,
        "error": m.error, "skipped": m.skipped, "dtype": m.dtype,
    }


def source_commit() -> str:
    """The commit specgen's source is at (`-dirty`: with changes not committed), or "unknown" where it
    is not a git checkout: a figure says what code made it."""
    import subprocess

    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        if head.returncode != 0:
            return "unknown"
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head.stdout.strip() + ("-dirty" if dirty else "")


def report_dict(report: BenchReport, command: str) -> dict:
    import datetime

    import torch
    import transformers

    from specgen.machine import cpu_description

    return {
        "command": command, "commit": source_commit(), "cpu": cpu_description(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "prompts": report.prompts, "num_prompts": report.num_prompts,
        "options": asdict(report.options), "device": report.device, "dtype": report.dtype,
        "threads": report.threads, "cpus": os.cpu_count(),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "python": platform.python_version()},
        "results": [measurement_dict(m) for m in report.measurements],
    }


def write_json(report: BenchReport, path: Path, command: str) -> dict:
    """Writes the JSON report; returns what it wrote."""
    data = report_dict(report, command)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    return data


def times_text(value: float | None, digits: int = 2) -> str:
    """A ratio as a table shows it: "1.05x", or "-"."""
    return "-" if value is None else f"{value:.{digits}f}x"


def k_shares(histogram: list[int] | None) -> str:
    """How often each k ran, when it varied (`auto`): "0:12% 1:80% 2:8%"."""
    steps = sum(histogram or [])
    used = [(k, n) for k, n in enumerate(histogram or []) if n]
    if not steps or len(used) < 2:
        return "-" if not used else f"{used[0][0]}"
    return " ".join(f"{k}:{n / steps:.0%}" for k, n in used)


def table(report: BenchReport) -> Table:
    t = Table(title=f"specgen bench: {report.num_prompts} prompts ({report.prompts}), "
                    f"{report.options.max_tokens} max new tokens, {report.device}, {report.dtype}, "
                    f"{report.threads} threads, median of {report.options.repeats} rounds "
                    f"(speed-ups: of each round's ratio)")
    with_llamacpp = any(m.config == "llamacpp" for m in report.measurements)
    for name in ("batch", "config", "tok/s", "vs ar", "vs hf", *(["vs llama.cpp"] if with_llamacpp else []),
                 "accept len", "accept rate", "per position", "steps by k", "step ms (x ar)",
                 "split ms (eager): target/verify/draft/host", "warm-up s"):
        t.add_column(name, justify="left" if name in ("config", "per position") else "right")
    for m in report.measurements:
        d = measurement_dict(m)
        split = m.split_ms
        split_text = ("-" if not split else
                      "/".join(f"{split.get(p, 0):.0f}" for p in ("target", "verify", "draft", "host")))
        rates = d["acceptance_rate_per_position"]
        step = "-" if m.step_ms is None else f"{m.step_ms:.1f}"
        if m.step_ratio is not None:
            step += f" ({m.step_ratio:.2f}x)"
        speed = ("skipped" if m.skipped else "failed") if m.error else f"{m.tokens_per_second:,.1f}"
        t.add_row(str(m.batch_size), f"{m.config} ({m.dtype})" if m.dtype else m.config, speed, times_text(m.speedup_vs_ar),
                  times_text(m.speedup_vs_hf),
                  *([times_text(m.speedup_vs_llamacpp)] if with_llamacpp else []),
                  "-" if d["mean_acceptance_length"] is None else f"{d['mean_acceptance_length']:.2f}",
                  "-" if d["draft_acceptance_rate"] is None else f"{d['draft_acceptance_rate']:.0%}",
                  "-" if not rates else " ".join("-" if r is None else f"{r:.0%}" for r in rates),
                  k_shares(d["k_histogram"]), step, split_text,
                  f"{m.warmup_seconds:.0f}" + (" +" if m.shares_runner_of else ""))
    notes = [f"batch {m.batch_size}, {m.config} {'skipped' if m.skipped else 'failed'}: {m.error}"
             for m in report.measurements if m.error]
    if any(m.shares_runner_of for m in report.measurements):
        notes.append("warm-up s \"N +\": N seconds on top of the runner it shares with its draft's other K "
                     "settings (the model loaded once; each K's step compiled once)")
    if notes:
        t.caption = "\n".join(notes)
    return t


def write_png(report: BenchReport, path: Path) -> None:
    """Acceptance rate by draft position, and speed-up over `ar` by batch size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    configs = [c for c in dict.fromkeys(m.config for m in report.measurements)]
    batches = sorted({m.batch_size for m in report.measurements})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for n, config in enumerate(configs):
        color = colors[n % len(colors)]                 # one colour per configuration in both panels
        rows = [m for m in report.measurements if m.config == config]
        spec = next((m.spec for m in rows if m.spec), None)
        if spec and spec.get("acceptance_rate_per_position"):
            rates = [float("nan") if r is None else r for r in spec["acceptance_rate_per_position"]]
            left.plot(range(1, len(rates) + 1), rates, marker="o", color=color,
                      label=f"{config} (len {spec['mean_acceptance_length']:.2f})")
        speed = {m.batch_size: m.speedup_vs_ar for m in rows if m.speedup_vs_ar is not None}
        if speed:
            # batch sizes as evenly spaced categories: 1, 8, 64 read better than on a log axis
            right.plot([batches.index(b) for b in batches if b in speed], [speed[b] for b in batches if b in speed],
                       marker="o", color=color, label=config)
    left.set(title="acceptance rate by draft position", xlabel="position", ylabel="accepted", ylim=(0, 1))
    right.axhline(1.0, color="grey", lw=0.8, ls="--")
    right.set(title="speed-up over ar (tokens/s)", xlabel="batch size", ylabel="x ar",
              xticks=range(len(batches)))
    right.set_xticklabels([str(b) for b in batches])
    for ax in (left, right):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle(f"{report.device}, {report.dtype}, {report.num_prompts} prompts ({report.prompts})", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
