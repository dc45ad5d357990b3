"""The `fa_backend` logger and its environment switch.

FA_BACKEND_LOG=debug|info|off sets the level of logger "fa_backend" and, for debug/info, attaches a
stderr handler. Unset, the logger has only a NullHandler and follows the application's logging
configuration.
"""

from __future__ import annotations

import logging
import os

LOGGER = logging.getLogger("fa_backend")
LOGGER.addHandler(logging.NullHandler())
DISPATCH_LOGGER = logging.getLogger("fa_backend.dispatch")

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "off": logging.CRITICAL + 1}
_seen: set = set()


def configure_from_env() -> None:
    value = os.environ.get("FA_BACKEND_LOG", "").strip().lower()
    if not value:
        return
    if value not in _LEVELS:
        raise ValueError(f"FA_BACKEND_LOG must be one of {sorted(_LEVELS)}, got {value!r}")
    LOGGER.setLevel(_LEVELS[value])
    if value != "off" and not any(getattr(h, "_fa_backend", False) for h in LOGGER.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[%(name)s] %(levelname)s %(message)s"))
        handler._fa_backend = True  # type: ignore[attr-defined]
        LOGGER.addHandler(handler)


def log_once(key, logger: logging.Logger, level: int, msg: str, *args) -> bool:
    """Log a record the first time `key` is seen in this process; True if it was logged."""
    if key in _seen:
        return False
    _seen.add(key)
    logger.log(level, msg, *args)
    return True


def reset_once() -> None:
    _seen.clear()


configure_from_env()
