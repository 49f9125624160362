"""Checkpoint discovery, conversion and tensor reading (no model code here)."""

from specgen.checkpoints.store import CheckpointError, read_config, resolve_checkpoint

__all__ = ["CheckpointError", "read_config", "resolve_checkpoint"]
