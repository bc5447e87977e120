"""One access-log line per HTTP request, and the X-Ignored-Fields header: both read what the route learnt.

The line is written when the response has ended (a stream's last chunk included), so it carries the tokens:
`127.0.0.1:50312 "POST /v1/chat/completions" 200 412.3 ms tokens 12+32 id chatcmpl-...`. Generation routes
have a RequestRecord (app.Observe) with the id and token counts; other routes log "-" for them. The line goes
to the `lmserve.access` logger at INFO; `--no-access-log` leaves this middleware out.
"""

from __future__ import annotations

import logging
import time
from urllib.parse import quote

from lmserve.server.state import IGNORED_FIELDS_KEY, RECORD_KEY

log = logging.getLogger("lmserve.access")
IGNORED_HEADER = b"x-ignored-fields"


# A header value allows visible ASCII and spaces only (h11 refuses the response otherwise, and the client sees the
# connection drop): a field name is the client's text, so anything else in it is percent-encoded.
_HEADER_SAFE = "".join(chr(c) for c in range(0x21, 0x7F) if chr(c) not in "%,")


def ignored_header(names: list[str]) -> bytes:
    """The X-Ignored-Fields value: the dotted names, comma-separated, percent-encoded, at most 1 KiB.

    An empty name (a JSON key "") is written `""`, and the cut at 1 KiB drops a trailing separator: h11 refuses a
    value that ends in a space, and the fuzzer's body {"\x01": .., "\x84y": .., "": ..} dropped the connection."""
    value = ", ".join(quote(n, safe=_HEADER_SAFE) or '""' for n in names).encode("ascii")[:1024]
    return value.rstrip(b", ")


class AccessLog:
    """Pure ASGI (no wrapping of `receive`): times the request, names ignored fields, logs one line at its end."""

    def __init__(self, app, enabled: bool = True) -> None:
        self.app, self.enabled = app, enabled

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status, logged = time.monotonic(), [0], [False]

        async def send_noted(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                ignored = scope.get("state", {}).get(IGNORED_FIELDS_KEY)
                if ignored:  # the body parsed before any response starts, so the names are known here
                    header = ignored_header(ignored)
                    message = {**message, "headers": [*message.get("headers", []), (IGNORED_HEADER, header)]}
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                self._log(scope, status[0], start, logged)

        try:
            await self.app(scope, receive, send_noted)
        finally:
            self._log(scope, status[0] or 499, start, logged)  # no last body: the client hung up first

    def _log(self, scope, status: int, start: float, logged: list[bool]) -> None:
        if logged[0] or not self.enabled:
            return
        logged[0] = True
        record = scope.get("state", {}).get(RECORD_KEY)
        tokens = f"{record.prompt_tokens}+{record.output_tokens}" if record is not None else "-"
        rid = record.request_id if record is not None else "-"
        client = scope.get("client")
        who = f"{client[0]}:{client[1]}" if client else "-"
        log.info('%s "%s %s" %d %.1f ms tokens %s id %s', who, scope.get("method", ""), scope.get("path", "")[:200],
                 status, (time.monotonic() - start) * 1e3, tokens, rid)
