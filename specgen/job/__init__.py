"""`specgen run` as a library: a recipe resolved, sized, built into a runner, run, and counted.

The package holds one job per module (docs/how-it-works.md):
- resolved.py: the recipe resolved into checkpoints, device and dtypes, checked dry before loading;
- memory.py: the memory estimate and the check made before any weight loads;
- build.py: the models loaded and bound into a Runner (threads, compile, draft, policy);
- run.py: `run_job`: shards, resume, the results file, the parts' merge;
- statistics.py: the statistics file, each rank's figures, the mismatched-draft watch;
- errors.py: `JobError`, `InputError`.
The names below are the library's: `from specgen.job import run_job` and the like.
"""

from specgen.job.build import build_runner, decide_compile
from specgen.job.errors import InputError, JobError
from specgen.job.memory import available_bytes, check_memory, estimate_bytes
from specgen.job.resolved import Resolved, auto_dtype, draft_dtype, resolve
from specgen.job.run import JobSummary, run_job

__all__ = ["InputError", "JobError", "JobSummary", "Resolved", "auto_dtype", "available_bytes", "build_runner",
           "check_memory", "decide_compile", "draft_dtype", "estimate_bytes", "resolve", "run_job"]
