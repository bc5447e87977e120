"""HTTP connections that must send each request in time: uvicorn's h11 protocol with a read deadline.

uvicorn closes a keep-alive connection that stays idle, but not one that trickles its headers or its
body a byte at a time: such "slow loris" clients would each hold a connection (and a file descriptor)
forever, until the server can accept no one else. Here a request must arrive whole (headers and body)
within `read_timeout` seconds of its first byte, or of the connection opening for the first request;
otherwise the connection is closed. A handler that was reading the body sees a disconnect, as if the
client had left. Once a request has arrived, streaming the answer takes as long as it takes.
"""

from __future__ import annotations

import asyncio
from typing import Callable

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

# scope["state"]: when (monotonic) the StartGate (server/gate.py) took the request; the load wait's start
ARRIVED_KEY = "lmserve_arrived"
_RECEIVING = (h11.IDLE, h11.SEND_BODY)  # their side: headers not all here yet, or the body still arriving


class DeadlineH11Protocol(H11Protocol):
    """uvicorn's h11 protocol; `read_timeout` and `on_timeout` are set on the subclass `with_deadline` makes."""

    read_timeout: float = 30.0
    on_timeout: Callable[[], None] = staticmethod(lambda: None)
    _deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        receiving = self.conn.their_state in _RECEIVING
        if receiving and self._deadline is None:  # the first byte of the next request on a kept-alive connection
            self._arm()
        elif not receiving:
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._deadline = self.loop.call_later(self.read_timeout, self._expire)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self) -> None:
        self._deadline = None
        if self.conn.their_state in _RECEIVING and not self.transport.is_closing():
            self.on_timeout()
            self.transport.close()  # connection_lost then tells a running handler it is disconnected


def with_deadline(read_timeout: float, on_timeout: Callable[[], None]) -> type[DeadlineH11Protocol]:
    """The protocol class to give uvicorn (`http=`): requests must arrive within `read_timeout` seconds."""
    return type("DeadlineH11Protocol", (DeadlineH11Protocol,),
                {"read_timeout": read_timeout, "on_timeout": staticmethod(on_timeout)})
