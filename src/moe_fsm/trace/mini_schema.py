"""A JSON Schema (draft 2020-12) validator for the keywords the trace schema uses, with no dependency.

``explain`` and ``replay`` must refuse a malformed trace with a message, not a
KeyError, on a machine that has only moe-fsm's own dependencies; jsonschema is
a test extra. This validator covers exactly the keywords of
``data/trace-schema.json`` (a test checks that it uses no other) and agrees with
jsonschema on validity (a test and the fuzz test compare them); an unknown
keyword is an error, so a schema change cannot silently weaken validation.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Iterator

ANNOTATIONS = frozenset({"$schema", "$id", "$comment", "title", "description", "$defs", "examples", "default"})
ASSERTIONS = frozenset({
    "$ref", "type", "const", "enum", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "minLength",
    "maxLength", "pattern", "minItems", "maxItems", "uniqueItems", "prefixItems", "items", "contains", "minContains",
    "maxContains", "required", "properties", "patternProperties", "additionalProperties", "propertyNames",
    "minProperties", "maxProperties", "dependentRequired", "allOf", "anyOf", "oneOf", "not", "if", "then", "else",
})


class SchemaKeywordError(ValueError):
    """The schema uses a keyword this validator does not implement."""


class MiniError:
    """One violation, shaped like jsonschema's ValidationError where moe_fsm.trace.schema reads it."""

    def __init__(self, path: tuple, message: str) -> None:
        self.absolute_path = list(path)
        self.message = message
        self.context: list = []


class MiniValidator:
    def __init__(self, schema: dict) -> None:
        check_keywords(schema)
        self.root = schema

    def iter_errors(self, instance) -> Iterator[MiniError]:
        try:
            yield from list(self._errors(instance, self.root, ()))
        except RecursionError:
            yield MiniError((), "the document nests too deeply to validate")

    def is_valid(self, instance) -> bool:
        return next(iter(self.iter_errors(instance)), None) is None

    def _valid(self, instance, schema) -> bool:
        return next(iter(self._errors(instance, schema, ())), None) is None

    def _resolve(self, ref: str):
        if not ref.startswith("#"):
            raise SchemaKeywordError(f"only local references are supported, got {ref!r}")
        node = self.root
        for part in filter(None, ref[1:].split("/")):
            node = node[part.replace("~1", "/").replace("~0", "~")]
        return node

    def _errors(self, inst, schema, path) -> Iterator[MiniError]:
        if schema is True:
            return
        if schema is False:
            yield MiniError(path, "no value is allowed here")
            return
        if "$ref" in schema:
            yield from self._errors(inst, self._resolve(schema["$ref"]), path)
        if "type" in schema:
            types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
            if not any(_is_type(inst, t) for t in types):
                yield MiniError(path, f"{_short(inst)} is not of type {' or '.join(map(repr, types))}")
                return
        if "const" in schema and not _equal(inst, schema["const"]):
            yield MiniError(path, f"{schema['const']!r} was expected")
        if "enum" in schema and not any(_equal(inst, v) for v in schema["enum"]):
            yield MiniError(path, f"{_short(inst)} is not one of {schema['enum']!r}")
        if _is_type(inst, "number"):
            yield from self._number(inst, schema, path)
        elif isinstance(inst, str):
            yield from self._string(inst, schema, path)
        elif isinstance(inst, list):
            yield from self._array(inst, schema, path)
        elif isinstance(inst, dict):
            yield from self._object(inst, schema, path)
        for sub in schema.get("allOf", ()):
            yield from self._errors(inst, sub, path)
        if "anyOf" in schema and not any(self._valid(inst, sub) for sub in schema["anyOf"]):
            yield MiniError(path, f"{_short(inst)} is not valid under any of the given schemas")
        if "oneOf" in schema:
            matched = sum(self._valid(inst, sub) for sub in schema["oneOf"])
            if matched != 1:
                yield MiniError(path, f"{_short(inst)} is valid under {matched} of the given schemas, not exactly one")
        if "not" in schema and self._valid(inst, schema["not"]):
            yield MiniError(path, f"{_short(inst)} should not be valid under {schema['not']!r}")
        if "if" in schema:
            branch = schema.get("then" if self._valid(inst, schema["if"]) else "else")
            if branch is not None:
                yield from self._errors(inst, branch, path)

    def _number(self, inst, schema, path):
        if "minimum" in schema and inst < schema["minimum"]:
            yield MiniError(path, f"{inst!r} is less than the minimum of {schema['minimum']!r}")
        if "maximum" in schema and inst > schema["maximum"]:
            yield MiniError(path, f"{inst!r} is greater than the maximum of {schema['maximum']!r}")
        if "exclusiveMinimum" in schema and inst <= schema["exclusiveMinimum"]:
            yield MiniError(path, f"{inst!r} is less than or equal to the minimum of {schema['exclusiveMinimum']!r}")
        if "exclusiveMaximum" in schema and inst >= schema["exclusiveMaximum"]:
            yield MiniError(path, f"{inst!r} is greater than or equal to the maximum of {schema['exclusiveMaximum']!r}")

    def _string(self, inst, schema, path):
        if "minLength" in schema and len(inst) < schema["minLength"]:
            yield MiniError(path, f"{_short(inst)} is too short")
        if "maxLength" in schema and len(inst) > schema["maxLength"]:
            yield MiniError(path, f"{_short(inst)} is too long")
        if "pattern" in schema and not _pattern(schema["pattern"]).search(inst):
            yield MiniError(path, f"{_short(inst)} does not match {schema['pattern']!r}")

    def _array(self, inst, schema, path):
        if "minItems" in schema and len(inst) < schema["minItems"]:
            yield MiniError(path, f"{_short(inst)} should have at least {schema['minItems']} item(s)")
        if "maxItems" in schema and len(inst) > schema["maxItems"]:
            yield MiniError(path, f"{_short(inst)} should have at most {schema['maxItems']} item(s)")
        if schema.get("uniqueItems") and any(_equal(a, b) for i, a in enumerate(inst) for b in inst[i + 1:]):
            yield MiniError(path, f"{_short(inst)} has non-unique elements")
        prefix = schema.get("prefixItems", ())
        for i, (item, sub) in enumerate(zip(inst, prefix)):
            yield from self._errors(item, sub, (*path, i))
        if "items" in schema:
            for i in range(len(prefix), len(inst)):
                yield from self._errors(inst[i], schema["items"], (*path, i))
        if "contains" in schema:
            found = sum(self._valid(item, schema["contains"]) for item in inst)
            low, high = schema.get("minContains", 1), schema.get("maxContains")
            if found < low or (high is not None and found > high):
                yield MiniError(path, f"{_short(inst)} contains {found} matching item(s); expected "
                                      f"{low}{'' if high is None else f' to {high}'}")

    def _object(self, inst, schema, path):
        for name in schema.get("required", ()):
            if name not in inst:
                yield MiniError(path, f"{name!r} is a required property")
        properties, patterns = schema.get("properties", {}), schema.get("patternProperties", {})
        for key, value in inst.items():
            known = False
            if key in properties:
                known = True
                yield from self._errors(value, properties[key], (*path, key))
            for pattern, sub in patterns.items():
                if _pattern(pattern).search(key):
                    known = True
                    yield from self._errors(value, sub, (*path, key))
            if not known and "additionalProperties" in schema:
                extra = schema["additionalProperties"]
                if extra is False:
                    yield MiniError(path, f"additional property {key!r} is not allowed")
                else:
                    yield from self._errors(value, extra, (*path, key))
        if "propertyNames" in schema:
            for key in inst:
                if not self._valid(key, schema["propertyNames"]):
                    yield MiniError(path, f"property name {key!r} is not allowed")
        if "minProperties" in schema and len(inst) < schema["minProperties"]:
            yield MiniError(path, f"the object should have at least {schema['minProperties']} properties")
        if "maxProperties" in schema and len(inst) > schema["maxProperties"]:
            yield MiniError(path, f"the object should have at most {schema['maxProperties']} properties")
        for key, needed in schema.get("dependentRequired", {}).items():
            if key in inst:
                for name in needed:
                    if name not in inst:
                        yield MiniError(path, f"{name!r} is a dependency of {key!r}")


def check_keywords(schema) -> None:
    """Raise SchemaKeywordError for a keyword this validator would silently ignore."""
    def walk(node, where):
        if isinstance(node, bool):
            return
        if not isinstance(node, dict):
            raise SchemaKeywordError(f"{where}: a schema must be an object or a boolean")
        unknown = set(node) - ASSERTIONS - ANNOTATIONS
        if unknown:
            raise SchemaKeywordError(f"{where}: unsupported keyword(s) {sorted(unknown)}")
        for key in ("properties", "patternProperties", "$defs"):
            for name, sub in node.get(key, {}).items():
                walk(sub, f"{where}/{key}/{name}")
        for key in ("allOf", "anyOf", "oneOf", "prefixItems"):
            for i, sub in enumerate(node.get(key, ())):
                walk(sub, f"{where}/{key}/{i}")
        for key in ("items", "contains", "not", "if", "then", "else", "additionalProperties", "propertyNames"):
            if key in node:
                walk(node[key], f"{where}/{key}")

    walk(schema, "#")


def _is_type(inst, name: str) -> bool:
    if name == "null":
        return inst is None
    if name == "boolean":
        return isinstance(inst, bool)
    if name == "integer":
        return (isinstance(inst, int) and not isinstance(inst, bool)) or (isinstance(inst, float) and inst.is_integer())
    if name == "number":
        return isinstance(inst, (int, float)) and not isinstance(inst, bool)
    if name == "string":
        return isinstance(inst, str)
    if name == "array":
        return isinstance(inst, list)
    if name == "object":
        return isinstance(inst, dict)
    raise SchemaKeywordError(f"unknown type {name!r}")


def _equal(a, b) -> bool:
    """JSON equality: true is not 1, 1 is 1.0, containers compare item by item."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


@lru_cache(maxsize=None)
def _pattern(text: str) -> re.Pattern:
    return re.compile(text)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
