"""A log line said once per run object and reason, not once per call.

Why: a speedup decides per layer call (eager or graphed, offloaded or not); the same reason would fill a notebook's
output thousands of times. Each owner keeps its own ``SayOnce``, so a new run (a new object, or ``reset()``) says
its reasons again.
"""

from __future__ import annotations

import logging


class SayOnce:
    """``say(key, message, level)`` logs ``"<prefix>: <message>"`` the first time ``key`` is seen."""

    def __init__(self, logger: logging.Logger, prefix: str) -> None:
        self.logger, self.prefix = logger, prefix
        self._said: set[str] = set()

    def __call__(self, key: str, message: str, level: int = logging.WARNING) -> bool:
        """Log ``message`` unless ``key`` was said before; return whether it was logged now."""
        if key in self._said:
            return False
        self._said.add(key)
        self.logger.log(level, "%s: %s", self.prefix, message)
        return True

    def said(self, key: str) -> bool:
        return key in self._said

    def reset(self) -> None:
        self._said.clear()
