"""Text for a terminal: what a trace or a file holds is shown, never obeyed.

A layer name or a backend name in a trace may carry terminal escape sequences
(ESC [ ... to recolour, move the cursor or retitle the window); printed raw,
they would act on the reader's terminal. Control characters other than newline
and tab are shown as Python escapes instead.
"""

from __future__ import annotations

import re

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029]")
_ANY_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")  # newline and tab too


def printable(text: str) -> str:
    return _CONTROL.sub(_escape, text)


def one_line(text: str) -> str:
    """``printable`` with newline and tab escaped too: a value from a file shown inside a line (a table cell, a
    name in a header) can neither start a line of its own nor shift the columns."""
    return _ANY_CONTROL.sub(_escape, text)


def _escape(match: re.Match) -> str:
    return match.group().encode("unicode_escape").decode("ascii")
