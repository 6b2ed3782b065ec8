"""The process's log format: `text` (one line per record) or `json` (one JSON object per line,
an access record's fields as keys). Set once by the CLI before anything logs."""

from __future__ import annotations

import json
import logging
from typing import Any

from pdserve.api.access import access_logger

LOG_FORMATS = ("text", "json")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        out.update(getattr(record, "access", {}))
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out)


def configure_logging(level: str, fmt: str = "text") -> None:
    if fmt not in LOG_FORMATS:
        raise ValueError(f"--log-format must be one of {LOG_FORMATS}, got {fmt!r}")
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    access_logger.setLevel(logging.INFO)  # access records are written at any --log-level
