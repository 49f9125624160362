"""What building compiled code costs a run: booked as compile time, never as a step's cost.

Contract: `CompileClock(compiled, device)`; `clock.call(name, fn, *args)` calls a compiled part
(`fn`) and books the call's wall time under a name where the call built something:
- its first call: Dynamo traces, Inductor lowers it (or loads its graph cache: `from_graph_cache`),
  and on CUDA the graph is recorded: under `name`;
- a later call whose guards failed (a size a graph was specialised on changed): ("recompile", name);
- a later call that met input sizes its CUDA graphs had not (its warm-up run), or recorded the
  graph for them: under ("cuda graph", name). A compiled step takes the kv bucket and the draft
  window as dynamic sizes: one compiled graph serves them all, but CUDA graphs replay fixed
  shapes, so Inductor's cudagraph trees warm up and then record one graph per size they meet,
  mid-run (`auto` after a run of plain steps drafts over a window it may not have drafted over
  before; a longer request reaches a new bucket). Both synchronise and allocate from the graph
  pool; taken as a step, they would make the variant look dearer than it is. Recordings are
  counted through Dynamo's public compile callbacks (trigger CUDAGRAPH_RECORDING); warm-ups by
  the functions the device's cudagraph tree holds (one per size; `cuda_graph_functions`).
`seconds` maps names to seconds (`total()` their sum); the runner takes a step whose call booked
any as compile time, not a cost its policy learns from (pipelines/runner.py).
`slowest_lowering()`: the longest a step's graph took to lower in this process.
Nothing is timed when steps run eagerly (`compiled` false): every call is a step.
"""

from __future__ import annotations

import time

import torch

# The longest a step's graph took to lower in this process (graphs loaded from the graph cache left
# out): see `slowest_lowering`.
_slowest_lowering = 0.0
# CUDA graphs Inductor has recorded in this process (its compile callbacks, CUDAGRAPH_RECORDING)
_recorded = 0


def slowest_lowering() -> float:
    """Seconds the slowest step graph lowered (not loaded from the graph cache) in this process took.
    A runner built after another (bench) finds the kernels its plain step needs already built by the
    first, and compiles it fast; a variant of other shapes still builds its own, so the plain step's
    time alone would promise a mid-run compile far cheaper than it is (seen: a 79 s compile taken
    mid-run for a round of 24 prompts, which ran at 0.6x)."""
    return _slowest_lowering


def graphs_compiled() -> int:
    """Graphs Dynamo has compiled in this process (a counter it keeps; read per call, about 0.1 us)."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def graph_cache_hits() -> int:
    """Graphs Inductor has loaded from its graph cache in this process instead of lowering them."""
    return torch._dynamo.utils.counters["inductor"]["fxgraph_cache_hit"]


def cuda_graphs_recorded() -> int:
    """CUDA graphs recorded in this process since the first clock was made (`listen_for_recordings`)."""
    return _recorded


def cuda_graph_functions(device: torch.device) -> int:
    """Functions the device's cudagraph tree holds: one per compiled graph and input size met, each
    added by a warm-up run (0 off CUDA, or before any; an internal of Inductor's, read defensively)."""
    if device.type != "cuda":
        return 0
    try:
        from torch._inductor.cudagraph_trees import get_manager

        manager = get_manager(device.index if device.index is not None else torch.cuda.current_device(),
                              create_if_none_exists=False)
        return len(manager.ids_to_funcs) if manager is not None else 0
    except (ImportError, AttributeError):
        return 0


def _on_compile_end(args=None) -> None:
    # Dynamo's compile callbacks end with a trigger: a trace, or a CUDA-graph recording at run time
    # (cudagraph_trees runs every recording inside `install_callbacks(CUDAGRAPH_RECORDING, ...)`)
    from torch._dynamo.callback import CallbackTrigger

    if getattr(args, "callback_trigger", None) == CallbackTrigger.CUDAGRAPH_RECORDING:
        global _recorded
        _recorded += 1


def listen_for_recordings() -> None:
    """Count CUDA-graph recordings from now on (Dynamo's public callback hook). Checked at every
    call: `torch._dynamo.reset()` (a runner's close, between a bench's runners) clears the hooks."""
    from torch._dynamo.callback import callback_handler

    if _on_compile_end not in callback_handler.end_callbacks:
        callback_handler.register_end_callback(_on_compile_end)


class CompileClock:
    def __init__(self, compiled: bool, device: torch.device) -> None:
        self.compiled = compiled
        self.device = device
        # ("step", k), ("verify", t): the first call; ("recompile", name), ("cuda graph", name): later ones
        self.seconds: dict = {}
        # the names whose compile loaded Inductor's graph cache (3-3.4x faster than lowering anew)
        self.from_graph_cache: set = set()

    def total(self) -> float:
        """Seconds spent building compiled code so far."""
        return sum(self.seconds.values())

    def call(self, name, fn, *args):
        """`fn(*args)`; its time booked under a name where the call built something (module docstring)."""
        if not self.compiled:
            return fn(*args)
        listen_for_recordings()
        first = name not in self.seconds
        graphs, recorded = graphs_compiled(), cuda_graphs_recorded()
        functions = cuda_graph_functions(self.device)
        hits = graph_cache_hits() if first else 0
        start = time.perf_counter()
        out = fn(*args)
        if first:
            key = name
        elif graphs_compiled() != graphs:
            key = ("recompile", name)
        elif cuda_graphs_recorded() != recorded or cuda_graph_functions(self.device) != functions:
            key = ("cuda graph", name)
        else:
            return out
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - start
        if first and graph_cache_hits() > hits:
            self.from_graph_cache.add(name)
        elif first:
            global _slowest_lowering
            _slowest_lowering = max(_slowest_lowering, self.seconds[key])
        return out
