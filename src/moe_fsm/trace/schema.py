"""Validate a decision trace against the published JSON Schema.

The schema ships twice: ``docs/trace-schema.json`` for readers and
``moe_fsm/data/trace-schema.json`` as package data for the CLI (a test keeps the
two identical). Validation needs ``jsonschema``, a test dependency and not a
runtime one: without it :func:`validate` raises :class:`SchemaUnavailable` with
the install command, and :func:`available` says so beforehand.
"""

from __future__ import annotations

import json
from functools import lru_cache

from moe_fsm.errors import InputError

SCHEMA_RESOURCE = "data/trace-schema.json"
INSTALL_HINT = "pip install 'moe-fsm[test]' (or pip install jsonschema)"


class SchemaUnavailable(RuntimeError):
    """jsonschema is not installed, so traces cannot be validated here."""


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


def available() -> bool:
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
        raise SchemaUnavailable(f"validating traces needs the jsonschema package: {INSTALL_HINT}") from None
    schema = load_schema()
    cls = jsonschema.Draft202012Validator
    cls.check_schema(schema)
    return cls(schema)


def errors(document: object) -> list[str]:
    """Every schema violation as 'json/path: message', most specific first; [] when valid."""
    validator = _validator()
    found = []
    for err in sorted(validator.iter_errors(document), key=lambda e: (list(map(str, e.absolute_path)), e.message)):
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
    """Raise TraceSchemaError listing every problem, or SchemaUnavailable without jsonschema."""
    problems = errors(document)
    if problems:
        raise TraceSchemaError(problems, source)
