"""A data-parallel rank for tests/test_data_parallel.py, started by torchrun (spawned, never forked).

`dp_worker.py RECIPE PROMPTS OUTPUT [--die-after N]`: runs the job like `specgen run`; with
--die-after, rank 1 kills itself with SIGKILL (no handler, no cleanup) once N of its prompts are
written, and torchrun then stops the other ranks: a machine lost mid-run.
"""

from __future__ import annotations

import argparse
import os
import signal

from specgen.job import run_job
from specgen.parallel.world import World
from specgen.recipe import load_recipe


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("recipe")
    parser.add_argument("prompts")
    parser.add_argument("output")
    parser.add_argument("--die-after", type=int, default=None)
    args = parser.parse_args()
    world = World.from_env()

    def on_progress(p) -> None:
        if args.die_after is not None and world.rank == 1 and p.finished >= args.die_after:
            os.kill(os.getpid(), signal.SIGKILL)

    run_job(load_recipe(args.recipe, ()), prompts=args.prompts, output=args.output, on_progress=on_progress,
            world=world)


if __name__ == "__main__":
    main()
