"""Narrowing a run's tail: once few slots are live, move them down and step over those slots only.

Contract: `plan_narrowing(live, width)` -> (new width, [(src, dst), ...]) or None. In the tail of a
run (no request left to admit) an eager CPU step costs in proportion to its rows, so once at most
half of the `width` slots are `live` they move to the lowest slots and the step runs over a power
of two of them (few distinct shapes). `move_rows(tensors, src, dst)` copies one slot's row of each
of the step's tensors (state, caches, sampling); everything else that is kept per slot (policy,
proposer, grammar, the runner's bookkeeping) has a `move(src, dst)` of its own. Compiled steps keep
their shape, and results in flight name the old slots: the runner narrows only eager steps with
nothing in flight.
"""

from __future__ import annotations


def plan_narrowing(live: list[int], width: int) -> tuple[int, list[tuple[int, int]]] | None:
    if not live or len(live) > width // 2:
        return None
    narrow = 1 << (len(live) - 1).bit_length()          # a power of two: few distinct shapes
    live_set = set(live)
    free = [b for b in range(narrow) if b not in live_set]
    return narrow, [(b, free.pop(0)) for b in live if b >= narrow]


def move_rows(tensors, src: int, dst: int) -> None:
    for t in tensors:
        t[dst] = t[src]
