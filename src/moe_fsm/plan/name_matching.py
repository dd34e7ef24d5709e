"""Module-name matching, as each engine's quantization config classes match a layer's name against their lists.

Exclusion lists, compressed-tensors targets, Quark's layer configs, GPTQ's ``dynamic`` keys and ModelOpt's
``quantized_layers`` each match names their own way: substrings or wildcards (``SubstringOrGlob``), exact names
and ``re:`` regexes (``VllmRegex``), dotted prefixes (``PrefixIndex``). Name lists are indexed once per config
and pattern lists are capped (``MAX_PATTERNS``), and a regex's match is time-bounded (``REGEX_TIMEOUT_S``), so a
plan's cost does not grow with layers x list length and a hostile pattern cannot hang it. Torch-free, core.
"""

from __future__ import annotations

import re
from fnmatch import translate
from typing import Optional

import regex

from moe_fsm.errors import InputError


# Wildcard and regex patterns are tried one by one against each layer's name, so a list holds at most this many
# (published checkpoints list tens: one per excluded attention block); plain names are looked up, any number of them.
MAX_PATTERNS = 4096
REGEX_TIMEOUT_S = 0.5  # a re: pattern's match against one module name (~50 characters) takes microseconds
INDEX_DEPTH = 16  # quantized_layers keys are indexed by their first 16 dotted prefixes (module names have ~6)


def is_wildcard(pattern: str) -> bool:
    return any(c in pattern for c in "*?[")


def capped(patterns: list, where: str, kind: str) -> list:
    if len(patterns) > MAX_PATTERNS:
        raise InputError(f"quantization_config: {where} holds {len(patterns)} {kind} patterns; moe-fsm takes at most "
                         f"{MAX_PATTERNS} (each is tried against every layer; list plain module names instead)")
    return patterns


def substrings(name: str):
    return (name[i:j] for i in range(len(name)) for j in range(i + 1, len(name) + 1))


class SubstringOrGlob:
    """The first pattern (in list order) that is a substring of a name, or (``glob``) matches it as a wildcard.

    ``glob``: ModelOpt's ``is_layer_excluded`` (the name itself, a pattern inside the name, or an fnmatch
    wildcard; ``prefix*`` also covers the module's children). Without it: a plain substring test, the
    ``match_mode="substring"`` of vLLM's ``is_layer_skipped`` (AWQ's and MoeWNA16's ``modules_to_not_convert``).
    """

    def __init__(self, patterns: list[str], where: str, glob: bool) -> None:
        self.plain: dict[str, int] = {}
        wild = []
        for order, pattern in enumerate(patterns):
            if not pattern:
                continue
            if glob and is_wildcard(pattern):
                wild.append((order, pattern, re.compile(translate(pattern)).match))
            else:
                self.plain.setdefault(pattern, order)
        self.wild = capped(wild, where, "wildcard")
        self.patterns = patterns

    def first(self, name: str) -> Optional[str]:
        hits = [self.plain[s] for s in substrings(name) if s in self.plain]
        for order, pattern, match in self.wild:
            if hits and order > min(hits):
                break
            if match(name) or pattern in name or pattern.endswith("*") and match(name + "."):
                hits.append(order)
                break
        return self.patterns[min(hits)] if hits else None


class VllmRegex:
    """Names as vLLM's compressed-tensors, Quark and GPTQ-``dynamic`` matching reads them: exact names, ``re:``
    regexes (``re.match``: from the start), and for compressed-tensors the class target (``Linear``).

    vLLM matches a ``re:`` pattern with ``re.match``; a pattern that backtracks without end, such as
    ``re:(.|.)*Z``, would hang ``plan`` there. So a pattern must compile under ``re`` (it means what it means to
    vLLM) and is matched by the ``regex`` package in its re-compatible mode (VERSION0: same syntax, same match),
    whose repeat guards finish most such patterns at once and whose ``timeout`` bounds the rest
    (``REGEX_TIMEOUT_S``, an InputError naming the pattern and the module name). ``prefix`` is the marker a
    regex carries ("re:" for compressed-tensors and Quark; GPTQ's ``dynamic`` keys are all regexes).
    """

    def __init__(self, patterns: list[str], where: str, prefix: str = "re:") -> None:
        self.exact = {p: order for order, p in reversed(list(enumerate(patterns))) if not p.startswith(prefix)}
        regexes = []
        for order, p in enumerate(patterns):
            if p.startswith(prefix):
                source = p[len(prefix):]
                try:
                    re.compile(source)
                except (re.error, RecursionError, OverflowError) as err:
                    raise InputError(f"quantization_config: {where} pattern {p!r} is not a regular expression: {err}") from None
                try:
                    regexes.append((order, p, regex.compile(source, flags=regex.VERSION0).match))
                except (regex.error, RecursionError, OverflowError) as err:
                    raise InputError(f"quantization_config: {where} pattern {p!r} is one moe-fsm's bounded matcher "
                                     f"(the regex package) cannot compile: {err}") from None
        self.regexes = capped(regexes, where, "regex")
        self.patterns = patterns
        self.where = where

    def matches(self, order_pattern_match, name: str) -> bool:
        _, pattern, match = order_pattern_match
        try:
            return match(name, timeout=REGEX_TIMEOUT_S) is not None
        except TimeoutError:
            raise InputError(f"quantization_config: {self.where} pattern {pattern!r} was still matching module "
                             f"{name!r} after {REGEX_TIMEOUT_S} s (it backtracks without end, as nested "
                             "repeats such as (.|.)* can); write it without repeats inside repeats") from None

    def first(self, name: str) -> Optional[str]:
        """The first pattern, in list order, equal to ``name`` or whose regex matches it."""
        hits = [self.exact[name]] if name in self.exact else []
        for entry in self.regexes:
            if hits and entry[0] > min(hits):
                break
            if self.matches(entry, name):
                hits.append(entry[0])
                break
        return self.patterns[min(hits)] if hits else None

    def first_containing(self, class_name: str) -> Optional[str]:
        """compressed-tensors' match of a module's class name: a regex matching it, or a target it contains."""
        for order, pattern in enumerate(self.patterns):
            if pattern.startswith("re:"):
                entry = next(e for e in self.regexes if e[0] == order)
                if self.matches(entry, class_name):
                    return pattern
            elif pattern.lower() in class_name.lower():
                return pattern
        return None




class PrefixIndex:
    """The first key (in order) that starts with a dotted prefix: ``quantized_layers`` looked up per layer."""

    def __init__(self, keys) -> None:
        self.keys = list(keys)
        self.index: dict[str, str] = {}
        for key in self.keys:
            end = -1
            for _ in range(INDEX_DEPTH):
                end = key.find(".", end + 1)
                if end < 0:
                    break
                self.index.setdefault(key[:end + 1], key)

    def first(self, prefix: str) -> Optional[str]:
        if prefix.endswith(".") and prefix.count(".") <= INDEX_DEPTH:
            return self.index.get(prefix)
        return next((k for k in self.keys if k.startswith(prefix)), None)
