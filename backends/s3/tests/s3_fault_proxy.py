"""A tiny HTTP proxy in front of moto that misbehaves on request.

moto never throttles, never drops a connection and never checks ``x-amz-checksum-*``
values, so the failures an S3 client must survive are injected here, on the wire, while
every request that is let through reaches the real moto server unchanged. Rules match a
method and substrings of the path (query included) and fire for their first ``times``
matching requests:

* ``slowdown`` / ``internal`` / ``conflict`` / ``timeout`` / ``bad_digest`` / ``deny`` /
  ``not_found``: answer 503 SlowDown / 500 InternalError / 409 ConditionalRequestConflict /
  400 RequestTimeout / 400 BadDigest / 403 AccessDenied / 404 NoSuchKey without forwarding
  (a 404 for a key that is there: an eventually consistent store, a misrouting proxy);
* ``reset``: read the request, then reset the connection (nothing reaches moto);
* ``lose_answer``: forward to moto, then reset the connection (the request took effect,
  the client never learns it);
* ``wrong_checksum`` / ``truncate``: forward with a wrong ``x-amz-checksum-crc32c`` /
  one byte short, as a server that stored something else would behave;
* ``delay``: forward after ``delay`` seconds (makes concurrency observable);
* ``small_pages``: forward a listing asking for pages of 2 keys (exercises pagination).

``before`` runs when a rule fires, before its action (e.g. to let a rival write first).

A whole-server ``mode`` (``proxy.mode = "stall"``, switchable at any time) stands for a
cold tier that is down, and takes precedence over the rules: ``healthy`` (rules apply),
``refuse``, ``stall`` and ``deny_writes`` (writes get 403 AccessDenied), as
:mod:`tierstore.testing.server_modes` defines them for every backend's proxy.

``python s3_fault_proxy.py UPSTREAM [MODE]`` serves in its own process (the benchmarks
use it so): it prints its URL and runs until its standard input closes.
"""

from __future__ import annotations

import http.client
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from urllib.parse import urlparse

from tierstore.testing.server_modes import HOP_BY_HOP, MODES, ModesHandler, ServerModes

__all__ = ["FaultProxy", "Rule", "MODES"]


_ERRORS = {
    "slowdown": (503, "SlowDown", "Please reduce your request rate."),
    "internal": (500, "InternalError", "We encountered an internal error. Please try again."),
    "conflict": (409, "ConditionalRequestConflict", "A conflicting operation is in progress."),
    "timeout": (400, "RequestTimeout", "Your socket connection to the server was not read."),
    "bad_digest": (400, "BadDigest", "The CRC32C you specified did not match the calculated."),
    "deny": (403, "AccessDenied", "Access Denied"),
    "not_found": (404, "NoSuchKey", "The specified key does not exist."),
}


@dataclass
class Rule:
    action: str
    method: str | None = None
    contains: tuple[str, ...] = ()
    excludes: tuple[str, ...] = ()
    times: int = 1
    delay: float = 0.0
    before: Callable[[], None] | None = None
    fired: int = 0

    def matches(self, method: str, path: str) -> bool:
        return (
            self.fired < self.times
            and (self.method is None or self.method == method)
            and all(s in path for s in self.contains)
            and not any(s in path for s in self.excludes)
        )


@dataclass
class Seen:
    method: str
    path: str
    action: str
    status: int | None = None  # moto's answer, where the request was forwarded


@dataclass
class _State:
    rules: list[Rule] = field(default_factory=list)
    seen: list[Seen] = field(default_factory=list)
    in_flight: dict[str, int] = field(default_factory=dict)
    peak: dict[str, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


class FaultProxy(ServerModes):
    """Forwards to ``upstream`` (moto) on ``self.url``; see the module docstring."""

    def __init__(self, upstream: str, mode: str = "healthy") -> None:
        parsed = urlparse(upstream)
        self._upstream = (parsed.hostname or "127.0.0.1", parsed.port or 80)
        self._state = _State()
        super().__init__()
        self.mode = mode

    def _record(self, method: str, path: str, fault: str) -> None:
        with self._state.lock:
            self._state.seen.append(Seen(method, path, fault))

    def add(
        self,
        action: str,
        *,
        method: str | None = None,
        contains: tuple[str, ...] = (),
        excludes: tuple[str, ...] = (),
        times: int = 1,
        delay: float = 0.0,
        before: Callable[[], None] | None = None,
    ) -> Rule:
        rule = Rule(action, method, contains, excludes, times, delay, before)
        with self._state.lock:
            self._state.rules.append(rule)
        return rule

    def seen(self, method: str | None = None, contains: str = "") -> list[Seen]:
        with self._state.lock:
            return [
                s for s in self._state.seen if (method is None or s.method == method) and contains in s.path
            ]

    def in_flight(self, kind: str) -> int:
        """Requests of ``kind`` (``"part"``, or a method) forwarded and not yet answered."""
        with self._state.lock:
            return self._state.in_flight.get(kind, 0)

    def peak_in_flight(self, kind: str) -> int:
        with self._state.lock:
            return self._state.peak.get(kind, 0)

    def reset(self) -> None:
        with self._state.lock:
            self._state.rules.clear()
            self._state.seen.clear()
            self._state.peak.clear()

    def _match(self, method: str, path: str) -> tuple[Rule | None, Seen]:
        with self._state.lock:
            found = next((r for r in self._state.rules if r.matches(method, path)), None)
            if found is not None:
                found.fired += 1
            seen = Seen(method, path, found.action if found else "forward")
            self._state.seen.append(seen)
            return found, seen

    def _count(self, kind: str, step: int) -> None:
        with self._state.lock:
            now = self._state.in_flight.get(kind, 0) + step
            self._state.in_flight[kind] = now
            self._state.peak[kind] = max(self._state.peak.get(kind, 0), now)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(ModesHandler):
            def _serve(self) -> None:
                body = self._body()
                if self._meet_mode():
                    return
                rule, seen = proxy._match(self.command, self.path)
                if rule is not None and rule.before is not None:
                    rule.before()
                if seen.action in _ERRORS:
                    self._answer_error(*_ERRORS[seen.action])
                elif seen.action == "reset":
                    self._reset()
                else:
                    self._forward(rule, seen, body)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _serve

            def _answer_error(self, status: int, code: str, message: str) -> None:
                xml = (
                    f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{code}</Code>"
                    f"<Message>{message}</Message></Error>"
                ).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(xml)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(xml)

            def _deny(self) -> None:
                self._answer_error(*_ERRORS["deny"])

            def _drop(self) -> None:
                self._reset()  # a stall ends unanswered, as when the server is restarted

            def _reset(self) -> None:
                # SO_LINGER 0: close() sends RST, as a dropped connection looks to clients.
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                self.connection.close()
                self.close_connection = True

            def _forward(self, rule: Rule | None, seen: Seen, body: bytes) -> None:
                headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
                action, path = seen.action, self.path
                if action == "wrong_checksum":
                    headers = {k: v for k, v in headers.items() if k.lower() != "x-amz-checksum-crc32c"}
                    headers["x-amz-checksum-crc32c"] = "AAAAAA=="
                elif action == "small_pages":
                    path = f"{path}&max-keys=2"
                elif action == "truncate":
                    body = body[:-1]
                    headers = {k: v for k, v in headers.items() if k.lower() != "content-length"}
                    headers["Content-Length"] = str(len(body))
                kind = "part" if "partNumber=" in self.path else self.command
                proxy._count(kind, 1)
                try:
                    if rule is not None and rule.delay:
                        time.sleep(rule.delay)
                    status, reason, answer_headers, data = self._upstream(path, headers, body)
                finally:
                    proxy._count(kind, -1)
                seen.status = status
                if action == "lose_answer":
                    self._reset()
                    return
                self._relay(status, reason, answer_headers, data)

            def _upstream(
                self, path: str, headers: dict[str, str], body: bytes
            ) -> tuple[int, str, list[tuple[str, str]], bytes]:
                conn = http.client.HTTPConnection(*proxy._upstream, timeout=60)
                try:
                    conn.request(self.command, path, body=body or None, headers=headers)
                    answer = conn.getresponse()
                    data = answer.read()
                    return answer.status, answer.reason, answer.getheaders(), data
                finally:
                    conn.close()

            def _relay(self, status: int, reason: str, headers: list[tuple[str, str]], data: bytes) -> None:
                self.send_response(status, reason)
                for name, value in headers:
                    lower = name.lower()
                    if lower in HOP_BY_HOP or lower in ("date", "server"):
                        continue
                    if lower == "content-length" and self.command != "HEAD":
                        continue
                    self.send_header(name, value)
                if self.command != "HEAD" and status not in (204, 304):
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

        Handler.proxy = proxy
        return Handler


def _serve_until_stdin_closes(upstream: str, mode: str) -> None:
    proxy = FaultProxy(upstream, mode)
    print(proxy.url, flush=True)
    sys.stdin.read()  # until the parent closes our stdin (or exits)
    proxy.close()


if __name__ == "__main__":
    _serve_until_stdin_closes(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "healthy")
