"""An `Inspection` as Rich tables (for people) or JSON (for scripts); nothing here decides anything."""

from __future__ import annotations

import json
import math

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from specgen.inspection.report import Inspection


def to_json(report: Inspection) -> str:
    return json.dumps(report.to_dict(), indent=2, default=str)


def unreadable_json(path: str, error: Exception) -> str:
    return json.dumps({"path": path, "readable": False, "error": str(error)}, indent=2)


def human_bytes(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    exp = min(int(math.log(n, 1024)), 4)
    return f"{n / 1024 ** exp:,.2f} {('B', 'KiB', 'MiB', 'GiB', 'TiB')[exp]}"


def render(report: Inspection, console: Console) -> None:
    console.print(Group(*_parts(report)))


def _parts(report: Inspection) -> list:
    what = report.architecture if report.role != "draft" else f"{report.method} draft ({report.architecture})"
    if report.role == "target" and report.method == "mtp":
        what += " with an MTP layer inside (draft.method: mtp)"
    verdict = Text("runnable", style="bold green") if report.runnable else Text("NOT runnable", style="bold red")
    head = Text.assemble((f"{report.path}\n", "bold"), f"{report.format}, {report.role}: {what}  ", verdict,
                         f"  ({report.seconds * 1000:.0f} ms, headers only)")
    parts: list = [head]
    if report.fields:
        parts.append(_pairs("config", report.fields))
    layout = report.layout
    described = {"files": f"{layout.get('files')}{' + index' if layout.get('index') else ''}",
                 "tensors": f"{layout.get('tensors', 0):,}"}
    if layout.get("quantization"):
        described["quantization"] = layout["quantization"]
    if layout.get("tokenizer"):
        described["tokenizer"] = layout["tokenizer"]
    if layout.get("converted from"):
        described["converted from"] = layout["converted from"]
    if layout.get("groups"):
        described["key groups"] = ", ".join(f"{k} ({n:,})" for k, n in layout["groups"].items())
    parts.append(_pairs("layout", described))
    if report.tensors_by_dtype:
        table = Table(title="tensors by dtype", title_justify="left", box=None)
        for column in ("dtype", "tensors", "parameters", "bytes"):
            table.add_column(column, justify="left" if column == "dtype" else "right")
        for dtype, row in report.tensors_by_dtype.items():
            table.add_row(dtype, f"{row['tensors']:,}", f"{row['parameters']:,}", human_bytes(row["bytes"]))
        parts.append(table)
    if report.memory:
        m = report.memory
        memory = {f"weights ({m['dtype']})": human_bytes(m["weights_bytes"])}
        if "fp8_weights_bytes" in m:
            memory["weights (FP8 kept: GPUs with FP8 tensor cores)"] = human_bytes(m["fp8_weights_bytes"])
        if "int4_weights_bytes" in m:
            memory["weights (INT4 experts kept packed)"] = human_bytes(m["int4_weights_bytes"])
        memory["KV cache per token"] = human_bytes(m["kv_cache_bytes_per_token"])
        if "full_kv_bytes_per_token" in m:
            memory["  (uncompressed K/V would be)"] = human_bytes(m["full_kv_bytes_per_token"])
        memory[f"KV cache, batch {m['batch_size']} x {m['max_seq_len']} tokens"] = human_bytes(m["kv_cache_bytes"])
        rank = m.get("per_rank")
        if rank:
            split = f"{rank['tensor_parallel_size']} tensor-parallel ranks" + (
                ", experts whole" if rank["expert_parallel"] else "")
            memory[f"each of {split}: weights"] = human_bytes(rank["weights_bytes"])
            if "fp8_weights_bytes" in rank:
                memory["  weights (FP8 kept)"] = human_bytes(rank["fp8_weights_bytes"])
            if "int4_weights_bytes" in rank:
                memory["  weights (INT4 experts kept packed)"] = human_bytes(rank["int4_weights_bytes"])
            memory["  KV cache per token"] = human_bytes(rank["kv_cache_bytes_per_token"])
            memory[f"  KV cache, batch {m['batch_size']} x {m['max_seq_len']} tokens"] = human_bytes(rank["kv_cache_bytes"])
        for gpu in m.get("gpus", ()):
            verdict = ("fits" if gpu["fits"] else "weights fit, not this cache" if gpu["weights_fit"]
                       else "does not fit")
            who = "each rank on a" if rank else "one"
            memory[f"{who} {gpu['gpu']} GPU"] = (f"{verdict}: {gpu['kv_cache_tokens']:,} tokens of KV cache left"
                                                 if gpu["weights_fit"] else verdict)
        parts.append(_pairs("memory to run", memory))
    if report.compatibility is not None:
        table = Table(title=f"with target {report.target}", title_justify="left", box=None)
        table.add_column("check")
        table.add_column("")
        table.add_column("reason")
        for c in report.compatibility:
            table.add_row(c.name, Text("PASS", "green") if c.ok else Text("FAIL", "bold red"), c.detail)
        parts.append(table)
    if report.problems:
        shown = report.problems[:20]
        more = len(report.problems) - len(shown)
        lines = "\n".join(f"- {p}" for p in shown) + (f"\n- ... and {more} more (--json lists all)" if more else "")
        parts.append(Text.assemble(("problems\n", "bold red"), lines))
    return parts


def _pairs(title: str, values: dict) -> Table:
    table = Table(title=title, title_justify="left", box=None, show_header=False)
    table.add_column(style="dim")
    table.add_column()
    for key, value in values.items():
        table.add_row(str(key), str(value))
    return table
