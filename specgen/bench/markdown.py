"""A bench report as Markdown: the figures the docs show, written from the JSON, never typed.

Contract: `markdown(report)` takes a bench report as `report_dict` writes it (bench/report.py: the
JSON `specgen bench --output` saves) and returns a Markdown block: one line saying what ran
(the command, the commit, the CPU or GPU, the dtype, the threads, the date) and one table of every
measurement (tokens/s, speed-ups over ar and hf, acceptance length, how often each k ran, ms per step
against ar's, warm-up seconds). `specgen bench --markdown FILE` writes it beside the JSON;
`python -m specgen.bench.markdown REPORT.json` prints it for a report saved earlier. docs/performance.md
holds these blocks as they were printed.
"""

from __future__ import annotations

import json
import sys

from specgen.bench.report import k_shares, times_text


def markdown(report: dict) -> str:
    options = report.get("options", {})
    machine = report.get("cpu") if str(report.get("device", "")).startswith("cpu") else report.get("device")
    lines = [
        f"`{report.get('command', 'specgen bench')}`",
        "",
        f"commit {report.get('commit', 'unknown')}, {machine}, {report.get('dtype')}, "
        f"{report.get('threads')} threads, {report.get('num_prompts')} prompts ({report.get('prompts')}), "
        f"up to {options.get('max_tokens')} new tokens, median of {options.get('repeats')} rounds, "
        f"{report.get('date', 'date unknown')}",
        "",
    ]
    results = report.get("results", [])
    llamacpp = any(r.get("config") == "llamacpp" for r in results)
    extra = " vs llama.cpp |" if llamacpp else ""
    lines += [f"| batch | config | tok/s | vs ar | vs hf |{extra} accept len | k (share of steps) | step ms (x ar) | warm-up s |",
              "|---:|---|---:|---:|---:|" + ("---:|" if llamacpp else "") + "---:|---|---:|---:|"]
    for r in results:
        if r.get("error"):
            speed = "skipped" if r.get("skipped") else "failed"
            lines.append(f"| {r['batch_size']} | {r['config']} | {speed} | - | - |{' - |' if llamacpp else ''}"
                         " - | - | - | - |")
            continue
        length = "-" if r.get("mean_acceptance_length") is None else f"{r['mean_acceptance_length']:.2f}"
        step = "-" if r.get("step_ms") is None else f"{r['step_ms']:.1f}"
        if r.get("step_ratio") is not None:
            step += f" ({r['step_ratio']:.2f}x)"
        warm = f"{r['warmup_seconds']:.0f}" + (" +" if r.get("shares_runner_of") else "")
        config = f"{r['config']} ({r['dtype']})" if r.get("dtype") else r["config"]
        lines.append(f"| {r['batch_size']} | {config} | {r['tokens_per_second']:,.1f} | "
                     f"{times_text(r.get('speedup_vs_ar'))} | {times_text(r.get('speedup_vs_hf'))} | "
                     + (f"{times_text(r.get('speedup_vs_llamacpp'))} | " if llamacpp else "") + f"{length} | "
                     f"{k_shares(r.get('k_histogram'))} | {step} | {warm} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    """`python -m specgen.bench.markdown REPORT.json [...]`: each report's block, in order."""
    if len(sys.argv) < 2:
        raise SystemExit("usage: python -m specgen.bench.markdown REPORT.json [REPORT.json ...]")
    print("\n".join(markdown(json.loads(open(path).read())) for path in sys.argv[1:]), end="")


if __name__ == "__main__":
    main()
