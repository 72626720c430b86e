"""logs.py: a hidden secret never reaches a log line, in either format."""

from __future__ import annotations

import json
import logging

from nulltickets import logs


def record(message: str, *args: object) -> logging.LogRecord:
    return logging.LogRecord("psycopg.pool", logging.WARNING, __file__, 1, message, args, None)


def test_a_hidden_password_is_scrubbed_from_text_and_json_lines() -> None:
    logs.hide("hunter2-secret", "")
    line = logs.TextFormatter().format(record("connect failed: %s", "password hunter2-secret"))
    assert line.endswith("connect failed: password ***")
    doc = json.loads(logs.JsonFormatter().format(record("token 'hunter2-secret\"' refused")))
    assert doc["message"] == "token '***\"' refused"
    assert logs.scrub("nothing to hide") == "nothing to hide"
