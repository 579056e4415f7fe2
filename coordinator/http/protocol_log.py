"""The HTTP server's protocol log: a client's malformed request is one warning line, not a traceback.

aiohttp answers a request it cannot parse (a bad header, a broken chunked body, a line too long) with 400
and logs it through ``logger.exception``: a traceback at ERROR for every such request, which on a
service open to other services is noise that buries real errors. The client has its 400; the log keeps
one line saying what was wrong and from where. Any other exception keeps its traceback at ERROR.
"""

from __future__ import annotations

import logging

from aiohttp.http_exceptions import HttpProcessingError

PROTOCOL_LOGGER = "coordinator.http.protocol"


class MalformedRequestsOnOneLine(logging.Filter):
    """Turns a record carrying an ``HttpProcessingError`` into a WARNING without its traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            what = " ".join(str(exc.message).split())  # aiohttp's message spans lines (the bytes, a caret under them)
            record.msg = f"{record.msg}: malformed request refused with {exc.code}: {what}"
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.exc_info, record.exc_text = None, None
        return True


def protocol_logger() -> logging.Logger:
    """The logger to give aiohttp's request handler (``AppRunner(logger=...)``), with the filter on it once."""
    logger = logging.getLogger(PROTOCOL_LOGGER)
    if not any(isinstance(f, MalformedRequestsOnOneLine) for f in logger.filters):
        logger.addFilter(MalformedRequestsOnOneLine())
    return logger
