"""The whole-server faults of a backend's fault proxy: healthy, refusing, stalled, read-only.

:class:`ColdTierContract` runs a cold tier behind a proxy that can be switched between
:data:`MODES`; each backend's suite has one (the S3 and GCS suites), and they differ only in
the wire protocol (how a request is forwarded, how a fault is answered). This base is what
they share, so "refuse" and "stall" mean the same thing for every backend:

* ``healthy``: forward;
* ``refuse``: the listening socket is closed but its port stays bound, so a connect is
  answered RST (refused) and no one else can take the port before ``healthy`` listens on it
  again; open keep-alive connections are dropped;
* ``stall``: requests are read and never answered until the mode changes or the proxy
  closes, when they are dropped unanswered (no client thread stays stuck);
* ``deny_writes``: writes (POST, PUT, PATCH, DELETE) meet the backend's permission error,
  reads are forwarded.

A subclass gives the request handler (:meth:`_handler`), a :class:`ModesHandler` whose
:meth:`~ModesHandler._meet_mode` applies the mode before the backend's own rules and
whose :meth:`~ModesHandler._deny` answers a denied write;
:meth:`_record` is told each fault met.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

__all__ = ["HOP_BY_HOP", "MODES", "WRITES", "ModesHandler", "ServerModes", "assert_stall_ends"]

MODES = ("healthy", "refuse", "stall", "deny_writes")
WRITES = ("POST", "PUT", "PATCH", "DELETE")
# Headers that describe one connection, not the message: a proxy never forwards them.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "expect",
        "transfer-encoding",
        "proxy-connection",
        "te",
        "trailer",
        "upgrade",
    }
)


class ServerModes:
    """A local HTTP server on a fixed port whose mode is one of :data:`MODES`."""

    poll_interval = 0.05  # seconds between serve_forever's checks for shutdown

    def __init__(self) -> None:
        self._mode = "healthy"
        self._mode_lock = threading.Lock()
        self._released = threading.Event()  # set: stalled requests let go
        self._connections: set[socket.socket] = set()
        self._connections_lock = threading.Lock()
        self._hold: socket.socket | None = None  # keeps the port while refusing
        self._server: ThreadingHTTPServer | None = None
        self._address: tuple[str, int] = ("127.0.0.1", 0)
        self._serve()
        self.url = f"http://{self._address[0]}:{self._address[1]}"

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        raise NotImplementedError("a backend's proxy forwards its own protocol")

    def _record(self, method: str, path: str, fault: str) -> None:
        """Told of each request that met a whole-server fault (the proxy's log)."""

    @property
    def mode(self) -> str:
        return self._mode

    @mode.setter
    def mode(self, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; one of {MODES}")
        with self._mode_lock:
            previous, self._mode = self._mode, mode
            if previous == mode:
                return
            self._released.set()  # stalled requests leave with the stall
            self._released = threading.Event()
            if mode == "refuse":
                self._refuse()
            elif previous == "refuse":
                self._serve()

    def close(self) -> None:
        """Stop serving; stalled requests and open connections are dropped."""
        with self._mode_lock:
            self._released.set()
            self._close_server()
            if self._hold is not None:
                self._hold.close()
                self._hold = None
            self._drop_connections()

    def _serve(self) -> None:
        if self._hold is not None:
            self._hold.close()
            self._hold = None
        # ThreadingHTTPServer binds with SO_REUSEADDR: the port just released is taken again.
        server = ThreadingHTTPServer(self._address, self._handler())
        server.daemon_threads = True
        host, port = server.server_address[:2]
        self._address = (str(host), int(port))
        self._server = server
        threading.Thread(target=server.serve_forever, args=(self.poll_interval,), daemon=True).start()

    def _close_server(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def _refuse(self) -> None:
        self._close_server()
        hold = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        hold.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        hold.bind(self._address)
        self._hold = hold
        self._drop_connections()

    def _track(self, conn: socket.socket) -> None:
        with self._connections_lock:
            self._connections.add(conn)

    def _untrack(self, conn: socket.socket) -> None:
        with self._connections_lock:
            self._connections.discard(conn)

    def _drop_connections(self) -> None:
        with self._connections_lock:
            connections = list(self._connections)
        for conn in connections:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already gone

    def _stall(self) -> None:
        """Hold a request unanswered until the stall ends (a mode change or close)."""
        self._released.wait()

    def _down(self, method: str, path: str) -> str | None:
        """The whole-server fault this request meets (recorded), or ``None``."""
        mode = self._mode
        fault = None
        if mode in ("refuse", "stall") or (mode == "deny_writes" and method in WRITES):
            fault = mode
        if fault is not None:
            self._record(method, path, fault)
        return fault


class ModesHandler(BaseHTTPRequestHandler):
    """A request handler of a :class:`ServerModes` proxy (``proxy``, set by the subclass)."""

    protocol_version = "HTTP/1.1"  # keep-alive, and 100-continue as botocore expects
    proxy: ServerModes

    def log_message(self, format: str, *args: object) -> None:
        pass  # one line per request on stderr otherwise

    def setup(self) -> None:
        super().setup()
        self.proxy._track(self.connection)

    def finish(self) -> None:
        self.proxy._untrack(self.connection)
        super().finish()

    def _body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _meet_mode(self) -> bool:
        """Whether the whole-server mode ended this request: ``refuse`` and ``stall`` (once
        the stall ends) drop the connection unanswered, as a restarted server does;
        ``deny_writes`` answers a write with the backend's permission error (:meth:`_deny`)."""
        fault = self.proxy._down(self.command, self.path)
        if fault == "stall":
            self.proxy._stall()
        if fault in ("refuse", "stall"):
            self._drop()
        elif fault == "deny_writes":
            self._deny()
        return fault is not None

    def _deny(self) -> None:
        raise NotImplementedError("a backend's proxy answers in its own protocol")

    def _drop(self) -> None:
        self.close_connection = True
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def assert_stall_ends(
    proxy: ServerModes, request: Callable[[], object], end: Callable[[], None], *, hang: float = 60.0
) -> None:
    """Check a proxy's own ``stall``: ``request`` (a client call through ``proxy``) is still
    unanswered half a second in, and once ``end()`` (a mode change, or ``proxy.close``) it
    ends in an error within ``hang`` seconds, never held for ever."""
    from tierstore.testing.backend_contract import in_background

    proxy.mode = "stall"
    waiter, box = in_background(request)
    waiter.join(0.5)
    assert waiter.is_alive(), f"a stalled request was answered: {box}"
    end()
    waiter.join(hang)
    assert not waiter.is_alive() and "error" in box, box
