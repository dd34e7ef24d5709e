"""Hash a frozen input once: decisions are cached and memoized by their inputs, hashed on every lookup."""

from __future__ import annotations

from dataclasses import fields
from functools import wraps
from operator import attrgetter


def hashed_once(cls):
    """Class decorator (above ``@dataclass(frozen=True)``): the field hash is computed on first use and kept.

    Equality is unchanged (the dataclass's field comparison); the kept hash lives outside the fields.
    """
    names = [f.name for f in fields(cls) if (f.compare if f.hash is None else f.hash)]
    values = attrgetter(*names) if len(names) > 1 else (lambda self, get=attrgetter(names[0]): (get(self),))

    def __hash__(self) -> int:
        cached = self.__dict__.get("_hash")
        if cached is None:  # a lookup, not a caught KeyError: raising costs a new layer's first decision ~1 us a value
            cached = hash(values(self))
            object.__setattr__(self, "_hash", cached)
        return cached

    cls.__hash__ = __hash__
    return cls


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def field_dict(obj) -> dict:
    """A frozen input's fields by name, the start of its JSON form (``fields()`` is looked up once per class:
    a cold decision writes its inputs into the trace)."""
    names = _FIELD_NAMES.get(type(obj))
    if names is None:
        names = _FIELD_NAMES[type(obj)] = tuple(f.name for f in fields(obj))
    return {name: getattr(obj, name) for name in names}


def computed_once(method):
    """A frozen value's derived form (its JSON, its description), computed on first call and kept on the instance.

    For values a decision reuses (memoized plans, cached choices, the probed platform), whose
    derived form would otherwise be rebuilt for every trace. The result is shared: treat it as read-only.
    """
    attr = f"_{method.__name__}_once"

    @wraps(method)
    def once(self):
        value = self.__dict__.get(attr)
        if value is None:
            value = method(self)
            object.__setattr__(self, attr, value)
        return value

    return once
