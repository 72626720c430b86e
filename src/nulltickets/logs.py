"""Log output: one format for our own loggers and granian's, as text or JSON lines on stderr,
every record with an ISO 8601 UTC timestamp.

    2026-12-01T09:17:14.123Z INFO nulltickets: listening on http://127.0.0.1:7700
    {"ts": "2026-12-01T09:17:14.123Z", "level": "info", "logger": "nulltickets", "message": "..."}

`dictconfig()` is both what the server process applies and what granian is given as
`log_dictconfig`, so its own process and its worker log the same way.
"""

from __future__ import annotations

import json
import logging
import logging.config
import time
from typing import Any

# granian's loggers: its server (and the Rust side, which logs under the same name) and the
# access log.
GRANIAN_LOGGERS = ("_granian", "granian.access")

# Text no record may show (a database password), whoever logs it: our code, granian, a driver.
_hidden: set[str] = set()


def hide(*secrets: str) -> None:
    """Never write these in a log record or in a command's error line (see `scrub`)."""
    _hidden.update(s for s in secrets if s)


def scrub(text: str) -> str:
    """`text` with every hidden secret replaced by `***`."""
    for secret in sorted(_hidden, key=len, reverse=True):
        if secret in text:
            text = text.replace(secret, "***")
    return text


def timestamp(created: float) -> str:
    """`created` (seconds since the epoch) as ISO 8601 UTC with milliseconds."""
    seconds = int(created)
    millis = int((created - seconds) * 1000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{millis:03d}Z"


class TextFormatter(logging.Formatter):
    """`<timestamp> <LEVEL> <logger>: <message>`, then the traceback if there is one."""

    def format(self, record: logging.LogRecord) -> str:
        line = (
            f"{timestamp(record.created)} {record.levelname} {record.name}: {record.getMessage()}"
        )
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return scrub(line)


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, message (and exception when there is one)."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": timestamp(record.created),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": scrub(record.getMessage()),
        }
        if record.exc_info:
            doc["exception"] = scrub(self.formatException(record.exc_info))
        return json.dumps(doc, ensure_ascii=False)


FORMATTERS = {"text": TextFormatter, "json": JsonFormatter}


def dictconfig(log_format: str = "text", log_level: str = "info") -> dict[str, Any]:
    """A `logging.config.dictConfig` document: every logger ours and granian's writes to
    stderr in `log_format` at `log_level` (the access log, when on, at INFO)."""
    formatter = FORMATTERS[log_format]
    level = log_level.upper()
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"nulltickets": {"()": f"{__name__}.{formatter.__name__}"}},
        "handlers": {
            "stderr": {
                "class": "logging.StreamHandler",
                "formatter": "nulltickets",
                "stream": "ext://sys.stderr",
            }
        },
        "loggers": {
            "nulltickets": {"handlers": ["stderr"], "level": level, "propagate": False},
            "_granian": {"handlers": ["stderr"], "level": level, "propagate": False},
            "granian.access": {"handlers": ["stderr"], "level": "INFO", "propagate": False},
        },
        "root": {"handlers": ["stderr"], "level": level},
    }


def configure(log_format: str = "text", log_level: str = "info") -> None:
    logging.config.dictConfig(dictconfig(log_format, log_level))
