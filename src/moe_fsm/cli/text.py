"""Text for a terminal: what a trace or a file holds is shown, never obeyed.

A layer name or a backend name in a trace may carry terminal escape sequences
(ESC [ ... to recolour, move the cursor or retitle the window); printed raw,
they would act on the reader's terminal. Control characters other than newline
and tab are shown as Python escapes instead.
"""

from __future__ import annotations

import re

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029]")


def printable(text: str) -> str:
    return _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)
