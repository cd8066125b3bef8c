"""Logging of every Steadfast process: text or JSON lines, and the request id a line is about."""

from __future__ import annotations

import datetime
import json
import logging

from steadfast.config import env


def about(request_id: str) -> dict[str, str]:
    """A log call's `extra` for a line about one request: JSON logs carry its id as a field, the same id
    in the router's, the workers' and the pools' lines."""
    return {"request_id": request_id}


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time (UTC, ISO 8601), process (router, worker3, kvpool…), pid, level,
    logger, message, and `request_id` when the line is about one request; `exc` with a traceback."""

    def __init__(self, process: str) -> None:
        super().__init__()
        self.process = process

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, object] = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(timespec="milliseconds"),
            "process": self.process,
            "pid": record.process,
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if rid := getattr(record, "request_id", None):
            line["request_id"] = rid
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


def setup_logging(name: str) -> None:
    """Logging of one process named `name`: text lines, or JSON lines with STEADFAST_LOG_FORMAT=json (every
    process of a deployment inherits it from `steadfast serve --log-format json`)."""
    handler = logging.StreamHandler()
    if env.log_format() == "json":
        handler.setFormatter(JsonFormatter(name))
    else:
        handler.setFormatter(logging.Formatter(f"%(asctime)s {name}[%(process)d] %(levelname)s %(name)s: %(message)s"))
    # force: a worker forked by the zygote replaces the zygote's handler (its name)
    logging.basicConfig(level=env.log_level(), handlers=[handler], force=True)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # (a line per request to etcd, otherwise)
