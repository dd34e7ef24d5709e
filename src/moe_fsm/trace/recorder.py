"""Collects a decision's structured events; forwards them through structlog when someone listens.

Every event is a flat dict (``event`` plus its fields) appended to the
decision's list, which becomes the trace document's ``events``. That costs one
dict per event. structlog stays the event API for consumers: when the stdlib
logger ``moe_fsm.decision`` is enabled for DEBUG, each event also goes through
moe-fsm's own structlog logger and processor chain, which renders it as JSON
into that logger. Nobody listening means structlog's pipeline is not paid for
(it is not even imported). moe-fsm runs inside someone else's engine, so it
never calls ``structlog.configure`` or touches the host's logging setup.
"""

from __future__ import annotations

import json
import logging

FORWARD_LOGGER = logging.getLogger("moe_fsm.decision")
_structlog_logger = None


def _forward(logger, method_name, event_dict):
    FORWARD_LOGGER.debug(json.dumps(event_dict, sort_keys=True, default=str))
    return ""


def _listener():
    """moe-fsm's own structlog logger (built on first use), whose chain forwards to ``moe_fsm.decision``."""
    global _structlog_logger
    if _structlog_logger is None:
        import structlog

        _structlog_logger = structlog.wrap_logger(
            structlog.ReturnLogger(),
            processors=[_forward],
            wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG),
            cache_logger_on_first_use=False,
        )
    return _structlog_logger


class Recorder:
    """The event list of one decision; ``enabled=False`` keeps only what the outcome needs."""

    __slots__ = ("enabled", "events", "_live")

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.events: list[dict] = []
        self._live = enabled and FORWARD_LOGGER.isEnabledFor(logging.DEBUG)

    def emit(self, event: str, **fields) -> None:
        if self.enabled:
            fields["event"] = event
            self.append(fields)

    def append(self, event: dict) -> None:
        """Record an event dict as it is (it may be shared between decisions: events are read-only)."""
        if self.enabled:
            self.events.append(event)
            if self._live:
                _listener().info(event["event"], **{k: v for k, v in event.items() if k != "event"})
