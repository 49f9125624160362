"""`specgen inspect-checkpoint`: identify and validate a checkpoint, and a draft against its target,
from headers alone (identify.py: what a path is; report.py: the checks and figures; render.py: Rich
and JSON output)."""
