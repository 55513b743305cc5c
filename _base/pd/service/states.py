"""State machines of node-side objects: each is an `Enum` of states beside one `Transitions`
table saying which state may follow which; `table.move(obj, new)` is the only way `obj.state`
changes, so an illegal step is a bug that names itself instead of a request stuck in a state
nothing expects.
"""

from __future__ import annotations

import enum


class IllegalTransition(RuntimeError):
    pass


class Transitions:
    def __init__(self, table: dict[enum.Enum, tuple[enum.Enum, ...]]) -> None:
        states = {s for s in table} | {n for nexts in table.values() for n in nexts}
        missing = states - set(table)
        if missing:
            raise ValueError(f"states without a row: {sorted(s.name for s in missing)}")
        self.table = {s: frozenset(nexts) for s, nexts in table.items()}

    def can_move(self, old: enum.Enum, new: enum.Enum) -> bool:
        return new in self.table[old]

    def move(self, obj, new: enum.Enum) -> None:
        """`obj.state = new`, refusing a step the table does not allow."""
        old = obj.state
        if not self.can_move(old, new):
            raise IllegalTransition(f"{type(obj).__name__} cannot move from {old.name} to {new.name}")
        obj.state = new
