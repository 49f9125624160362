"""What this machine can give a run: CPU threads, measured rather than assumed.

Contract: `choose_threads(requested)` returns the intra-op thread count to use and a short reason for
the run's header. `requested` (recipe `runtime.threads`) wins when given; otherwise the count is the
CPUs this process may run on (its affinity mask), minus those that other processes keep busy right
now (sampled from /proc/stat over a fraction of a second), and never more than OMP_NUM_THREADS
when the user set it. Why: compiled CPU code is many short parallel regions whose threads spin-wait
for each other; one thread that shares its core with another busy process stalls every region, and
throughput collapses (2.8 vs 73.8 tok/s seen with 2 threads on 2 cores, one of them busy).
`cpu_description()` names the CPU and the features specgen's choices depend on, for figures.
"""

from __future__ import annotations

import os
import time


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _cpu_times() -> dict[int, tuple[float, float]]:
    """(busy, total) jiffies of each CPU this process may run on; empty where /proc/stat is not."""
    mine = set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    times = {}
    try:
        with open("/proc/stat") as f:
            for line in f:
                name, *values = line.split()
                if not name.startswith("cpu") or name == "cpu" or not name[3:].isdigit():
                    continue
                cpu = int(name[3:])
                if mine is not None and cpu not in mine:
                    continue
                fields = [float(v) for v in values]
                idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)   # idle + iowait
                total = sum(fields[:8])                 # guest time is counted in user already
                times[cpu] = (total - idle, total)
    except (OSError, ValueError):
        return {}
    return times


def busy_cpus(seconds: float = 0.25) -> float:
    """CPUs' worth of work other processes do now on this process's CPUs (it is idle meanwhile)."""
    first = _cpu_times()
    if not first:
        return 0.0
    time.sleep(seconds)
    second = _cpu_times()
    busy = 0.0
    for cpu, (busy0, total0) in first.items():
        busy1, total1 = second.get(cpu, (busy0, total0))
        if total1 > total0:
            busy += (busy1 - busy0) / (total1 - total0)
    return busy


def choose_threads(requested: int | None) -> tuple[int, str]:
    if requested is not None:
        return requested, "runtime.threads"
    cpus = usable_cpus()
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:
        cpus = min(cpus, int(env))
    busy = round(busy_cpus())
    threads = max(1, cpus - busy)
    if threads < cpus:
        return threads, f"{busy} of {cpus} CPUs busy with other work"
    return threads, f"{cpus} CPUs free"


def cpu_flags() -> set[str]:
    """The instruction-set flags /proc/cpuinfo lists for this CPU (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_description() -> str:
    """The CPU's model name and the features that decide specgen's dtypes and kernels, e.g. "AMD EPYC
    9R14 (AVX-512, AVX512-BF16, no AMX), 2 CPUs": what a figure measured here must state."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if not key.strip():
                    break                   # the first CPU's block is enough
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    name = fields.get("model name", "unknown CPU")
    if "cpu family" in fields:      # a VM may name only the vendor ("AMD EPYC"): the family tells Zen 3 from 4
        name += f" (family {fields['cpu family']}, model {fields.get('model', '?')})"
    features = [("AVX-512" if cpu_has_avx512() else "no AVX-512"),
                ("AVX512-BF16" if "avx512_bf16" in cpu_flags() else "no AVX512-BF16"),
                ("AMX" if cpu_has_amx() else "no AMX")]
    return f"{name} ({', '.join(features)}), {usable_cpus()} CPUs"


def cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512-BF16 or AMX): there bf16 GEMMs run
    2-3x faster than fp32 (measured on this project's 2-core EPYC)."""
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


def cpu_has_amx() -> bool:
    """Whether this CPU has AMX tiles for bf16 (Intel Xeon Sapphire Rapids and later): Inductor's
    compiled bf16 GEMMs there take its AMX micro-kernel, not specgen's (kernels/cpu_bf16_dot.py)."""
    return "amx_bf16" in cpu_flags()


def cpu_has_avx512() -> bool:
    """Whether this CPU has the AVX-512 subsets Inductor's AVX-512 code needs (F, BW, DQ, VL): there
    specgen's compiled bf16 GEMMs run on a kernel of their own, native or converting
    (kernels/cpu_bf16_dot.py)."""
    return {"avx512f", "avx512bw", "avx512dq", "avx512vl"} <= cpu_flags()
