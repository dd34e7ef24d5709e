"""Hash a frozen input once: decisions are cached and memoized by their inputs, hashed on every lookup."""

from __future__ import annotations

from dataclasses import fields
from operator import attrgetter


def hashed_once(cls):
    """Class decorator (above ``@dataclass(frozen=True)``): the field hash is computed on first use and kept.

    Equality is unchanged (the dataclass's field comparison); the kept hash lives outside the fields.
    """
    names = [f.name for f in fields(cls) if (f.compare if f.hash is None else f.hash)]
    values = attrgetter(*names) if len(names) > 1 else (lambda self, get=attrgetter(names[0]): (get(self),))

    def __hash__(self) -> int:
        try:
            return self.__dict__["_hash"]
        except KeyError:
            cached = hash(values(self))
            object.__setattr__(self, "_hash", cached)
            return cached

    cls.__hash__ = __hash__
    return cls
