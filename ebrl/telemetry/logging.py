"""structlog on top of the standard ``logging`` module, so that EBRL stays quiet inside
other people's programs (warnings only, stdlib's default) until a script or the CLI calls
:func:`configure_logging`: a human console on stderr and, optionally, JSON lines in a file.

    >>> from ebrl.telemetry import configure_logging, get_logger
    >>> configure_logging("warning")
    >>> get_logger("ebrl.demo").info("hidden")  # below the level: prints nothing
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import structlog

_PRE = [
    structlog.stdlib.add_log_level,
    structlog.stdlib.add_logger_name,
    structlog.processors.TimeStamper(fmt="iso", utc=True),
]


def get_logger(name: str) -> structlog.stdlib.BoundLogger:
    """A structlog logger writing through ``logging.getLogger(name)``, whatever the global structlog config."""
    return structlog.wrap_logger(
        logging.getLogger(name),
        processors=[structlog.stdlib.filter_by_level, *_PRE,
                    structlog.processors.format_exc_info,
                    structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        wrapper_class=structlog.stdlib.BoundLogger,
    )


def configure_logging(level: str | int = "info", json_path: str | Path | None = None, console: bool = True,
                      console_level: str | int | None = None) -> None:
    """Send EBRL's logs to stderr (human, from ``console_level``, default ``level``) and/or a
    JSON-lines file (from ``level``). Safe to call again."""
    root = logging.getLogger("ebrl")
    for handler in list(root.handlers):
        root.removeHandler(handler)
        handler.close()
    root.setLevel(level.upper() if isinstance(level, str) else level)
    root.propagate = False
    if console:
        h = logging.StreamHandler(sys.stderr)
        if console_level is not None:
            h.setLevel(console_level.upper() if isinstance(console_level, str) else console_level)
        h.setFormatter(structlog.stdlib.ProcessorFormatter(
            processor=structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())))
        root.addHandler(h)
    if json_path is not None:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        f = logging.FileHandler(json_path, encoding="utf-8")
        f.setFormatter(structlog.stdlib.ProcessorFormatter(processor=structlog.processors.JSONRenderer()))
        root.addHandler(f)
