"""An HTTP proxy that adds a fixed delay to every request before forwarding it (to moto).

It stands for a distant object store: ``python -m benchmarks.infra.latency_proxy UPSTREAM DELAY``
listens on 127.0.0.1, prints its URL and forwards each request to ``UPSTREAM`` after
``DELAY`` seconds, over one kept-alive upstream connection per client connection.
Request and answer bodies pass through unchanged; it exits when its stdin closes.
"""

from __future__ import annotations

import http.client
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from io import BufferedIOBase
from urllib.parse import urlparse

from benchmarks.infra.servers import serve_until_stdin_closes
from tierstore.testing.server_modes import HOP_BY_HOP

_CHUNK = 1 << 20


def _read_chunked(rfile: BufferedIOBase) -> bytes:
    """The body of a ``Transfer-Encoding: chunked`` request, decoded."""
    pieces: list[bytes] = []
    while True:
        size = int(rfile.readline().split(b";")[0].strip() or b"0", 16)
        if size == 0:
            while rfile.readline() not in (b"\r\n", b"\n", b""):
                pass
            return b"".join(pieces)
        pieces.append(rfile.read(size))
        rfile.readline()


def make_handler(upstream: tuple[str, int], delay: float) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, and 100-continue as botocore expects
        _conn: http.client.HTTPConnection | None = None

        def log_message(self, format: str, *args: object) -> None:
            pass

        def _body(self) -> bytes:
            if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
                return _read_chunked(self.rfile)
            length = int(self.headers.get("Content-Length") or 0)
            return self.rfile.read(length) if length else b""

        def _serve(self) -> None:
            body = self._body()
            headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
            if body or self.command in ("PUT", "POST"):
                headers["Content-Length"] = str(len(body))
            time.sleep(delay)  # the added latency of this request
            answer = self._upstream(headers, body)
            self._relay(answer)

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _serve

        def _upstream(self, headers: dict[str, str], body: bytes) -> http.client.HTTPResponse:
            for attempt in range(2):  # an idle kept-alive upstream connection may be gone
                if self._conn is None:
                    self._conn = http.client.HTTPConnection(*upstream, timeout=600)
                try:
                    self._conn.request(self.command, self.path, body=body or None, headers=headers)
                    return self._conn.getresponse()
                except (ConnectionError, http.client.HTTPException):
                    self._conn.close()
                    self._conn = None
                    if attempt:
                        raise
            raise AssertionError("unreachable")

        def _relay(self, answer: http.client.HTTPResponse) -> None:
            length = answer.getheader("Content-Length")
            data = None
            if self.command != "HEAD" and length is None:
                data = answer.read()  # chunked or close-delimited: buffer it
            self.send_response(answer.status, answer.reason)
            for name, value in answer.getheaders():
                if name.lower() not in HOP_BY_HOP and name.lower() != "content-length":
                    self.send_header(name, value)
            if self.command == "HEAD":
                if length is not None:
                    self.send_header("Content-Length", length)
                self.end_headers()
                answer.read()
                return
            self.send_header("Content-Length", str(len(data)) if data is not None else str(length))
            self.end_headers()
            if data is not None:
                self.wfile.write(data)
                return
            while chunk := answer.read(_CHUNK):
                self.wfile.write(chunk)

    return Handler


def serve(upstream_url: str, delay: float) -> None:
    parsed = urlparse(upstream_url)
    upstream = (parsed.hostname or "127.0.0.1", parsed.port or 80)
    server = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(upstream, delay))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    host, port = server.server_address[:2]
    serve_until_stdin_closes(str(host), int(port))
    server.shutdown()


if __name__ == "__main__":
    serve(sys.argv[1], float(sys.argv[2]))
