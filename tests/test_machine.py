"""CPU threads: what the machine can actually give, not every core blindly."""

from __future__ import annotations

import specgen.machine as machine


def test_busy_cpus_are_left_to_the_processes_that_use_them(monkeypatch):
    monkeypatch.setattr(machine, "usable_cpus", lambda: 2)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(machine, "busy_cpus", lambda seconds=0.25: 1.1)
    assert machine.choose_threads(None) == (1, "1 of 2 CPUs busy with other work")
    monkeypatch.setattr(machine, "busy_cpus", lambda seconds=0.25: 0.2)
    assert machine.choose_threads(None) == (2, "2 CPUs free")
    monkeypatch.setattr(machine, "busy_cpus", lambda seconds=0.25: 5.0)
    assert machine.choose_threads(None)[0] == 1                     # never fewer than one


def test_an_explicit_setting_wins_and_omp_num_threads_caps_auto(monkeypatch):
    monkeypatch.setattr(machine, "usable_cpus", lambda: 8)
    monkeypatch.setattr(machine, "busy_cpus", lambda seconds=0.25: 0.0)
    assert machine.choose_threads(3) == (3, "runtime.threads")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert machine.choose_threads(None)[0] == 2


def test_busy_cpus_reads_the_machine():
    import os

    assert 0.0 <= machine.busy_cpus(0.05) <= (os.cpu_count() or 1) + 1e-6


def test_only_the_cpus_this_process_may_use_are_counted(monkeypatch):
    """A container limited to CPU 1 of a host whose CPU 0 is flat out: CPU 1 is free."""
    import io

    samples = iter([
        "cpu  100 0 0 100 0 0 0 0\ncpu0 100 0 0 0 0 0 0 0\ncpu1 0 0 0 100 0 0 0 0\nintr 1\n",
        "cpu  200 0 0 200 0 0 0 0\ncpu0 200 0 0 0 0 0 0 0\ncpu1 0 0 0 200 0 0 0 0\nintr 1\n",
    ])
    monkeypatch.setattr(machine, "open", lambda path: io.StringIO(next(samples)), raising=False)
    monkeypatch.setattr(machine.os, "sched_getaffinity", lambda pid: {1})
    monkeypatch.setattr(machine.time, "sleep", lambda seconds: None)
    assert machine.busy_cpus() == 0.0
