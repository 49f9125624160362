"""Data-parallel prompts and outputs: which rank takes a prompt, where each rank writes, the merge.

Contract:
- `shard_of(id, n)`: the rank (0..n-1) that takes a prompt, from a stable hash of its id alone, so
  every rank computes the same split without talking, and a resumed run (with the same or another
  number of ranks) gives each id that is not done yet to exactly one rank.
- `part_path(output, rank)`: where a rank appends its results with the usual rules (one whole line
  per write, data.ResultWriter): rank 0 into the output itself, rank r into `<output>.rank-<r>.part`.
- `finished_ids(output)`: the ids already written, in the output and in every part, whatever number
  of ranks wrote them; what a resumed run skips.
- `remove_parts(output, from_rank)`: a run that starts over (`--no-resume`) drops earlier parts.
- `merge_parts(output, order)`: appends every part's records whose ids the output lacks (in `order`,
  the prompts' order, where known), syncs the output, then removes the parts. A merge cut short
  (killed) is finished by the next run, single-process or not; it never duplicates or drops a record.
"""

from __future__ import annotations

import glob
import hashlib
import json
import re
from pathlib import Path

from specgen.data import ResultWriter, read_result_ids

_PART = re.compile(r"\.rank-(\d+)\.part$")


def shard_of(request_id: str, ranks: int) -> int:
    digest = hashlib.blake2b(request_id.encode(), digest_size=8, person=b"specgen-shard").digest()
    return int.from_bytes(digest, "little") % ranks


def part_path(output: Path, rank: int) -> Path:
    return output if rank == 0 else output.with_name(f"{output.name}.rank-{rank}.part")


def part_files(output: Path) -> list[Path]:
    """The parts beside an output (of any number of ranks), in rank order."""
    if not output.parent.is_dir():
        return []
    found = []
    for path in output.parent.glob(f"{glob.escape(output.name)}.rank-*.part"):
        match = _PART.search(path.name)
        if match and path.name == part_path(output, int(match.group(1))).name:
            found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found)]


def remove_parts(output: Path, from_rank: int = 1) -> None:
    """Remove the parts of ranks >= `from_rank` (a run that starts over: parts of ranks it does not
    have; each of its own ranks empties its own part)."""
    for part in part_files(output):
        match = _PART.search(part.name)
        if match and int(match.group(1)) >= from_rank:
            part.unlink(missing_ok=True)


def finished_ids(output: Path) -> set[str]:
    ids = read_result_ids(output) if output.exists() else set()
    for part in part_files(output):
        ids |= read_result_ids(part)
    return ids


def merge_parts(output: Path, order: list[str] | None = None) -> int:
    """Move the parts' records into the output; returns how many records it appended."""
    parts = part_files(output)
    if not parts:
        return 0
    records: dict[str, bytes] = {}
    for part in parts:
        for line in part.read_bytes().split(b"\n"):
            request_id = _id_of(line)
            if request_id is not None:
                records.setdefault(request_id, line + b"\n")
    with ResultWriter(output, resume=True) as writer:     # cuts a torn last line of the output
        new = [i for i in records if i not in writer.done_ids]
        rank = {request_id: n for n, request_id in enumerate(order or [])}
        new.sort(key=lambda i: rank.get(i, len(rank)))
        for request_id in new:
            writer.write_line(records[request_id])
        writer.sync()
    for part in parts:
        part.unlink(missing_ok=True)
    return len(new)


def _id_of(line: bytes) -> str | None:
    """The id of a whole result line; None for a torn or foreign one (a killed rank's last line)."""
    if not line.strip():
        return None
    try:
        record = json.loads(line)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    return str(record["id"]) if isinstance(record, dict) and "id" in record else None

