"""HTTP-level limits that keep the server answering under hostile input.

- `RequestGuard`, an ASGI middleware: a body larger than `max_body_bytes` is answered 413 before it is read
  (from its Content-Length, or as soon as a chunked body passes the limit); a body that takes longer than
  `read_timeout_s` to arrive is answered 408; an unhandled error becomes a 500 in the OpenAI error shape
  without closing the client's keep-alive connection.
- `guarded_h11_protocol`: uvicorn's h11 protocol with a deadline on the request line and headers (a slow-loris
  client that trickles its headers is answered 408 and disconnected after `read_timeout_s`).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from ._api_errors import APIError, error_body

__all__ = ["RequestGuard", "guarded_h11_protocol"]

log = logging.getLogger("tutel_jax.serving")


def _json_bytes(err: APIError) -> bytes:
    return json.dumps(err.body()).encode()


def too_large(limit: int) -> APIError:
    return APIError(413, f"request body exceeds the server's limit of {limit} bytes (--max-request-bytes)",
                    code="request_too_large")


def too_slow(timeout_s: float) -> APIError:
    return APIError(408, f"the request did not arrive within {timeout_s:g} s (--read-timeout)",
                    code="request_timeout")


class RequestGuard:
    """ASGI middleware around the app (see the module docstring). The errors it raises while the app reads the
    body are `APIError`s, answered by the app's APIError handler."""

    def __init__(self, app: Any, max_body_bytes: int, read_timeout_s: float):
        from starlette.requests import ClientDisconnect  # the `serve` extra: imported only by a serving app

        self.app, self.max_body_bytes, self.read_timeout_s = app, max_body_bytes, read_timeout_s
        self.client_disconnect = ClientDisconnect

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            err = too_large(self.max_body_bytes) if length.isdigit() else APIError(
                400, "Content-Length is not a number", code="invalid_request")
            return await _answer(send, err, close=True)  # the body is never read
        reader = _BodyReader(receive, self.max_body_bytes, self.read_timeout_s)
        started = False

        async def tracked_send(message: dict) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                if not reader.done and _has_body(scope):
                    # answered before the whole body was read: the connection cannot be reused
                    message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            await send(message)

        try:
            await self.app(scope, reader.receive, tracked_send)
        except self.client_disconnect:  # the client went away mid-body (a truncated request): nobody to answer
            log.info("client disconnected before its request body was complete")
        except Exception as exc:  # noqa: BLE001 - answer it here: re-raising would reset the connection
            log.exception("unhandled error")
            if not started:
                await _answer(send, APIError(500, f"internal error: {exc}", code="internal_error",
                                             type="server_error"))


class _BodyReader:
    """One request's `receive` with the body's size limit and deadline; once the body is read, the server's own
    receive (disconnect notices) passes through unguarded."""

    def __init__(self, receive: Any, limit: int, timeout_s: float):
        self._receive, self.limit, self.timeout_s = receive, limit, timeout_s
        self._loop = asyncio.get_running_loop()
        self.deadline = self._loop.time() + timeout_s
        self.received = 0
        self.done = False

    async def receive(self) -> dict:
        if self.done:
            return await self._receive()
        try:
            message = await asyncio.wait_for(self._receive(), max(self.deadline - self._loop.time(), 0.0))
        except asyncio.TimeoutError:
            raise too_slow(self.timeout_s) from None
        if message["type"] == "http.request":
            self.received += len(message.get("body", b""))
            if self.received > self.limit:
                raise too_large(self.limit)
            self.done = not message.get("more_body", False)
        return message


def _has_body(scope: dict) -> bool:
    headers = dict(scope.get("headers") or [])
    return headers.get(b"content-length", b"0") != b"0" or b"transfer-encoding" in headers


async def _answer(send: Any, err: APIError, close: bool = False) -> None:
    body = _json_bytes(err)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def guarded_h11_protocol(read_timeout_s: float) -> type:
    """uvicorn's H11Protocol with a deadline of `read_timeout_s` from the first byte of a request to the end of
    its headers (the body's deadline is RequestGuard's)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    timeout_body = json.dumps(error_body(f"the request headers did not arrive within {read_timeout_s:g} s "
                                         "(--read-timeout)", code="request_timeout")).encode()

    class GuardedH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def data_received(self, data: bytes) -> None:
            before = self.cycle
            waiting = before is None or before.response_complete  # these bytes begin or continue new headers
            super().data_received(data)
            if self.cycle is not before:  # a request's headers are complete
                self._cancel_header_timer()
            elif waiting and self._header_timer is None and not self.transport.is_closing():
                self._header_timer = self.loop.call_later(read_timeout_s, self._headers_too_slow, before)

        def _cancel_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self, cycle: Any) -> None:
            self._header_timer = None
            if self.cycle is cycle and not self.transport.is_closing():
                self.logger.warning("request headers not complete after %g s: closing the connection",
                                    read_timeout_s)
                self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                                     b"connection: close\r\ncontent-length: " + str(len(timeout_body)).encode()
                                     + b"\r\n\r\n" + timeout_body)
                self.transport.close()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_header_timer()
            super().connection_lost(exc)

    return GuardedH11Protocol
