"""pipelines/compile_clock.py: a call that builds code is booked as compile time, a replay is a step.

On CPU there are no CUDA graphs; the recording is announced here the way Inductor's cudagraph trees
announce every recording (Dynamo's compile callbacks, trigger CUDAGRAPH_RECORDING), and the GPU test
(tests/test_gpu.py) checks the same booking on a real compiled CUDA step."""

from __future__ import annotations

import torch
from torch._dynamo.callback import CallbackTrigger, callback_handler

from specgen.pipelines.compile_clock import CompileClock


def recording(x: torch.Tensor) -> torch.Tensor:
    """What a call looks like to the clock when it records a CUDA graph."""
    with callback_handler.install_callbacks(CallbackTrigger.CUDAGRAPH_RECORDING, "0/0"):
        return x + 1


def test_first_calls_recompiles_and_cuda_graph_recordings_are_compile_time_replays_are_not():
    CompileClock(compiled=True, device=torch.device("cpu")).call("earlier", lambda: None)   # a clock before ...
    torch._dynamo.reset()         # ... a reset (a runner's close), which clears Dynamo's callbacks
    clock = CompileClock(compiled=True, device=torch.device("cpu"))
    step = torch.compile(lambda x: x * 2, backend="eager", dynamic=False)
    clock.call(("step", 1), step, torch.ones(3))
    assert set(clock.seconds) == {("step", 1)}
    for _ in range(3):                                   # replays: steps, nothing booked
        clock.call(("step", 1), step, torch.ones(3))
    assert set(clock.seconds) == {("step", 1)}
    clock.call(("step", 1), step, torch.ones(5))         # a size the graph was specialised on changed
    assert set(clock.seconds) == {("step", 1), ("recompile", ("step", 1))}
    clock.call(("step", 1), recording, torch.ones(3))    # a CUDA graph recorded for a new window
    clock.call(("step", 1), recording, torch.ones(3))
    assert set(clock.seconds) == {("step", 1), ("recompile", ("step", 1)), ("cuda graph", ("step", 1))}
    before = clock.total()
    clock.call(("step", 1), step, torch.ones(3))
    assert clock.total() == before > 0


def test_an_eager_clock_books_nothing():
    clock = CompileClock(compiled=False, device=torch.device("cpu"))
    clock.call(("verify", 1), recording, torch.ones(2))
    assert clock.seconds == {} and clock.total() == 0
