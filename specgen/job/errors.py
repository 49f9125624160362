"""What a job raises for a run that cannot start.

Contract: `JobError` is a problem with the run as a whole (memory, a checkpoint, the prompt source);
nothing was lost. Its `InputError` is input the run cannot use (a checkpoint, the output path, the
prompt source, the device asked for): exit code 2 (`exit_code`), as the CLI reports it.
"""

from __future__ import annotations


class JobError(Exception):
    """The run as a whole cannot start (memory, checkpoint, prompt source); nothing was lost."""


class InputError(JobError):
    """Input the run cannot use (checkpoint, output path, prompt source, device): exit code 2."""

    exit_code = 2
