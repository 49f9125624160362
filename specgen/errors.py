"""The error a checkpoint problem raises, in every layer that finds one.

Contract: `CheckpointError` is raised for a checkpoint that cannot be found, read or understood, with a
message that names the path or file. The loaders (checkpoints/) find most such problems, the model
and draft builders (models/, drafts/) the rest (a layout or config that does not fit); the CLI turns
any of them into one clear line. It lives here, below every layer, so that models/ and drafts/ raise
it without importing the loaders that call them.
"""


class CheckpointError(Exception):
    """A checkpoint that cannot be found, read or understood; the message names the path."""
