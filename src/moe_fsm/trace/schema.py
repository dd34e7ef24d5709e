"""Validate a decision trace against the published JSON Schema.

The schema ships twice: ``docs/trace-schema.json`` for readers and
``moe_fsm/data/trace-schema.json`` as package data for the CLI (a test keeps the
two identical). Validation uses ``jsonschema`` where it is installed (a test
dependency) and otherwise moe-fsm's own validator of the keywords the schema
uses (:mod:`moe_fsm.trace.mini_schema`), so a malformed trace is refused with
a message on every installation.
"""

from __future__ import annotations

import json
from functools import lru_cache

from moe_fsm.errors import InputError

SCHEMA_RESOURCE = "data/trace-schema.json"


class TraceSchemaError(InputError):
    """A document does not match the trace schema; ``errors`` lists each problem as 'path: message'."""

    def __init__(self, errors: list[str], source: str = "trace") -> None:
        shown = errors[:10]
        more = f"\n  ... and {len(errors) - len(shown)} more" if len(errors) > len(shown) else ""
        super().__init__(f"{source} does not match the decision-trace schema:\n  " + "\n  ".join(shown) + more)
        self.errors = errors


@lru_cache(maxsize=1)
def load_schema() -> dict:
    """The schema as shipped in the package."""
    from importlib import resources

    text = resources.files("moe_fsm").joinpath(SCHEMA_RESOURCE).read_text()
    return json.loads(text)


def jsonschema_installed() -> bool:
    try:
        import jsonschema  # noqa: F401
    except ImportError:
        return False
    return True


@lru_cache(maxsize=1)
def _validator():
    try:
        import jsonschema
    except ImportError:
        from moe_fsm.trace.mini_schema import MiniValidator

        return MiniValidator(load_schema())
    schema = load_schema()
    cls = jsonschema.Draft202012Validator
    cls.check_schema(schema)
    return cls(schema)


def errors(document: object) -> list[str]:
    """Every schema violation as 'json/path: message', most specific first; [] when valid."""
    validator = _validator()
    found = []
    try:
        violations = list(validator.iter_errors(document))
    except RecursionError:
        return ["(document): nests too deeply to validate"]
    for err in sorted(violations, key=lambda e: (list(map(str, e.absolute_path)), e.message)):
        leaves = _leaves(err)
        for leaf in leaves:
            where = "/".join(str(p) for p in leaf.absolute_path) or "(document)"
            line = f"{where}: {leaf.message}"
            if line not in found:
                found.append(line)
    return found


def _leaves(err) -> list:
    """The innermost errors of a conditional (if/then, allOf) failure: they say what is actually wrong."""
    if not err.context:
        return [err]
    out = []
    for sub in err.context:
        out.extend(_leaves(sub))
    return out


def validate(document: object, source: str = "trace") -> None:
    """Raise TraceSchemaError listing every problem."""
    problems = errors(document)
    if problems:
        raise TraceSchemaError(problems, source)
