"""Collects a decision's structured events through moe-fsm's own structlog logger.

moe-fsm runs inside someone else's engine, so it never calls
``structlog.configure`` or touches the host's logging setup: each recorder wraps
its own logger with its own processor chain. The chain appends every event to
the decision's list; when the stdlib logger ``moe_fsm.decision`` is enabled for
DEBUG, events are also forwarded there as JSON, for operators who want them live.
"""

from __future__ import annotations

import json
import logging

import structlog

FORWARD_LOGGER = logging.getLogger("moe_fsm.decision")


class _Collect:
    """Processor: keep a copy of the event in the decision's list."""

    def __init__(self, sink: list) -> None:
        self.sink = sink

    def __call__(self, logger, method_name, event_dict):
        self.sink.append(dict(event_dict))
        return event_dict


def _forward(logger, method_name, event_dict):
    if FORWARD_LOGGER.isEnabledFor(logging.DEBUG):
        FORWARD_LOGGER.debug(json.dumps(event_dict, sort_keys=True, default=str))
    return ""


class Recorder:
    """The event list of one decision; ``enabled=False`` keeps only what the outcome needs."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.events: list[dict] = []
        self._log = structlog.wrap_logger(
            structlog.ReturnLogger(),
            processors=[_Collect(self.events), _forward],
            wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG),
            cache_logger_on_first_use=False,
        ).bind()

    def emit(self, event: str, **fields) -> None:
        if self.enabled:
            self._log.info(event, **fields)
