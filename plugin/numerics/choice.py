"""Modes that travel as strings (a checkpoint's JSON value, a CLI choice) held as enums in the code."""
from __future__ import annotations

from enum import Enum


class Choice(str, Enum):
    """An enum whose members are their string values: equal to them, hashed like them, and printed as them
    (str() and format() give the value on every Python version), so a member can go wherever the string went."""

    def __str__(self) -> str:
        return self.value

    @classmethod
    def values(cls) -> tuple[str, ...]:
        return tuple(m.value for m in cls)

    @classmethod
    def parse(cls, value, what: str):
        """The member for `value` (a member or its string), else "<what>=<value> is not one of ..." (a field)."""
        if value not in cls.values():
            raise ValueError(f"{what}={value!r} is not one of {', '.join(map(repr, cls.values()))}")
        return cls(value)

    @classmethod
    def lookup(cls, value, noun: str, where: str = ""):
        """The member for `value` (a member or its string), else "<where>: unknown <noun> <value>; valid: ..."
        (an argument)."""
        if value not in cls.values():
            where = f"{where}: " if where else ""
            raise ValueError(f"{where}unknown {noun} {value!r}; valid: {', '.join(cls.values())}")
        return cls(value)
