"""A small threaded HTTP proxy in front of fake-gcs-server that misbehaves on request.

The emulator never throttles, never fails and never loses an answer; real GCS does all
three. Rules pick requests by method and a substring of path + query, let the first
``skip`` matching requests through, then act on the next ``times``:

* an HTTP status (429, 503, 403, ...): answered here, never forwarded;
* ``"drop"``: the connection is closed without forwarding (the request never landed);
* ``"lose_answer"``: forwarded, then the connection is closed (it landed; nobody knows);
* ``"corrupt_body"``: one byte of the uploaded data is flipped on the way to the server;
* ``"corrupt_crc"``: forwarded; the ``crc32c`` in the JSON answer is replaced.

Every request is logged as ``(method, path, action)`` for the tests to inspect, and every
``Authorization`` header seen is kept (tests check credentials were really sent).

A whole-server ``mode`` (``proxy.mode = "stall"``, switchable at any time) stands for a
storage service that is down, and takes precedence over the rules: ``healthy`` (rules
apply), ``refuse``, ``stall`` and ``deny_writes`` (writes get GCS's 403 JSON error), as
:mod:`tierstore.testing.server_modes` defines them for every backend's proxy.
"""

from __future__ import annotations

import http.client
import json
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from typing import Any
from urllib.parse import urlparse

from tierstore.testing.server_modes import MODES, ModesHandler, ServerModes

__all__ = ["MODES", "FaultProxy", "Rule"]

_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host"}
_WRONG_CRC = "AAAAAA=="  # CRC32C 0, which no non-empty test payload has
# What GCS answers a caller without storage.objects.create (or .delete) permission.
_DENIED = {
    "error": {
        "code": 403,
        "message": "anonymous caller does not have "
        "storage.objects.create access to the Google Cloud Storage object.",
        "errors": [
            {
                "message": "anonymous caller does not have "
                "storage.objects.create access to the Google Cloud Storage "
                "object.",
                "domain": "global",
                "reason": "forbidden",
            }
        ],
    }
}


@dataclass
class Rule:
    action: int | str
    method: str | None
    match: str
    skip: int
    times: int

    def wants(self, method: str, path: str) -> bool:
        return (self.method in (None, method)) and self.match in path


class FaultProxy(ServerModes):
    poll_interval = 0.02

    def __init__(self, target: str) -> None:
        parsed = urlparse(target)
        self.target = target.rstrip("/")
        self._target_host = (parsed.hostname or "127.0.0.1", parsed.port or 80)
        self.log: list[tuple[str, str, str]] = []
        self.authorizations: set[str] = set()  # Authorization headers seen
        self._rules: list[Rule] = []
        self._lock = threading.Lock()
        super().__init__()

    def start(self) -> FaultProxy:
        """Serving already (kept so that fixtures read ``FaultProxy(url).start()``)."""
        return self

    def stop(self) -> None:
        """Stop serving; stalled requests and open connections are dropped."""
        self.close()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        return _handler_for(self)

    def _record(self, method: str, path: str, fault: str) -> None:
        with self._lock:
            self.log.append((method, path, fault))

    def inject(
        self, action: int | str, *, method: str | None = None, match: str = "", skip: int = 0, times: int = 1
    ) -> None:
        with self._lock:
            self._rules.append(Rule(action, method, match, skip, times))

    def clear(self) -> None:
        """Forget every rule and the log."""
        with self._lock:
            self._rules.clear()
            self.log.clear()

    def actions(self, action: str) -> list[tuple[str, str, str]]:
        return [entry for entry in self.log if entry[2] == action]

    def decide(self, method: str, path: str) -> str:
        """Each rule counts every request it matches; the first rule due acts."""
        with self._lock:
            action: str | None = None
            for rule in self._rules:
                if not rule.wants(method, path):
                    continue
                if rule.skip:
                    rule.skip -= 1
                elif rule.times and action is None:
                    rule.times -= 1
                    action = str(rule.action)
            self.log.append((method, path, action or "forward"))
            return action or "forward"

    def forward(
        self, method: str, path: str, headers: dict[str, str], body: bytes
    ) -> tuple[int, list[tuple[str, str]], bytes]:
        conn = http.client.HTTPConnection(*self._target_host, timeout=60)
        try:
            conn.request(method, path, body=body or None, headers=headers)
            response = conn.getresponse()
            data = response.read()
            out = [
                (k, v.replace(self.target, self.url))
                for k, v in response.getheaders()
                if k.lower() not in _HOP_BY_HOP
            ]
            return response.status, out, data
        finally:
            conn.close()


def _flip_data_byte(body: bytes, content_type: str) -> bytes:
    """Flip a byte of the object's data (the last part of a multipart body)."""
    data = bytearray(body)
    if not data:
        return body
    index = len(data) // 2
    if content_type.startswith("multipart/"):
        index = body.rindex(b"\r\n--") - 1  # last data byte, before the closing boundary
    data[index] ^= 0xFF
    return bytes(data)


def _corrupt_crc(data: bytes) -> bytes:
    try:
        resource: Any = json.loads(data)
    except ValueError:
        return data
    if isinstance(resource, dict) and "crc32c" in resource:
        resource["crc32c"] = _WRONG_CRC
    return json.dumps(resource).encode()


def _handler_for(proxy: FaultProxy) -> type[BaseHTTPRequestHandler]:
    class Handler(ModesHandler):
        def _proxy(self) -> None:
            body = self._body()
            if self._meet_mode():
                return
            action = proxy.decide(self.command, self.path)
            if "Authorization" in self.headers:
                proxy.authorizations.add(self.headers["Authorization"])
            if action.isdigit():
                self._answer(
                    int(action),
                    [("Content-Type", "application/json")],
                    json.dumps(
                        {"error": {"code": int(action), "message": "injected by FaultProxy"}}
                    ).encode(),
                )
                return
            if action == "drop":
                self.close_connection = True
                return
            if action == "corrupt_body":
                body = _flip_data_byte(body, self.headers.get("Content-Type", ""))
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
            status, out, data = proxy.forward(self.command, self.path, headers, body)
            if action == "lose_answer":
                self.close_connection = True
                return
            if action == "corrupt_crc":
                data = _corrupt_crc(data)
            self._answer(status, out, data)

        def _deny(self) -> None:
            self._answer(
                403, [("Content-Type", "application/json; charset=UTF-8")], json.dumps(_DENIED).encode()
            )

        def _answer(self, status: int, headers: list[tuple[str, str]], data: bytes) -> None:
            self.send_response(status)
            for name, value in headers:
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _proxy

    Handler.proxy = proxy
    return Handler
