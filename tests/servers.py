"""Network helpers for the adapter tests (no third-party imports, so both adapters' tests use them).

Small real TCP servers on 127.0.0.1 for the server backend's failure paths (one that accepts and never answers,
one that drops its first connections before it answers ``GET /v1/models`` like a vLLM server), a deadline for calls
that must time out, and ``blocked_network()``: sockets refused and every attempt recorded.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import warnings


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TcpServer:
    """Accepts connections on a free port of 127.0.0.1 in a thread.

    Connection ``n`` (from 0) is closed at once while ``n < drop_first``; after that the request is read and
    recorded, then answered with ``models`` (``GET /v1/models``'s JSON) or, when ``models`` is None, never answered:
    the connection stays open until the server stops.
    """

    def __init__(self, drop_first: int = 0, models: dict | None = None) -> None:
        self.drop_first = drop_first
        self.models = models
        self.connections = 0
        self.requests: list[bytes] = []  # the raw request heads received
        self._open: list[socket.socket] = []
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(16)
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._serve, daemon=True, name="tcp-test-server")
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:  # closed by stop()
                return
            n, self.connections = self.connections, self.connections + 1
            if n < self.drop_first:
                conn.close()
                continue
            self._open.append(conn)
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        head = b""
        try:
            while b"\r\n\r\n" not in head:
                data = conn.recv(65536)
                if not data:
                    return
                head += data
        except OSError:
            return
        self.requests.append(head)
        if self.models is None:
            return  # never answer; the connection stays open until stop()
        body = json.dumps(self.models).encode()
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        conn.close()

    def stop(self) -> None:
        self._sock.close()
        for conn in self._open:
            try:
                conn.close()
            except OSError:
                pass

    def __enter__(self) -> "TcpServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def call_with_deadline(fn, seconds: float):
    """``fn()`` in a thread; returns (result, exception). Fails the test if ``fn`` is still running after
    ``seconds`` (a timeout that does not fire would otherwise hang the test run)."""
    out: dict = {}

    def run() -> None:
        try:
            out["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still waiting after {seconds} s: the timeout did not fire"
    return out.get("result"), out.get("error")


@contextlib.contextmanager
def blocked_network():
    """Sockets blocked (pytest-socket; Unix sockets allowed) while inside; yields the list of attempts to open one,
    resolve a host name or look one up, so that an attempt some library caught and swallowed is still seen."""
    import pytest_socket

    attempts: list = []
    original = socket.socket, socket.getaddrinfo, socket.gethostbyname
    pytest_socket.disable_socket(allow_unix_socket=True)
    guarded, guarded_getaddrinfo, guarded_gethostbyname = socket.socket, socket.getaddrinfo, socket.gethostbyname

    class RecordingSocket(guarded):
        def __new__(cls, family=-1, type=-1, proto=-1, fileno=None):
            if family != getattr(socket, "AF_UNIX", None):
                attempts.append(("socket", family))
            return super().__new__(cls, family, type, proto, fileno)

    def getaddrinfo(*args, **kwargs):
        attempts.append(("getaddrinfo", args[:2]))
        return guarded_getaddrinfo(*args, **kwargs)

    def gethostbyname(*args, **kwargs):
        attempts.append(("gethostbyname", args[:1]))
        return guarded_gethostbyname(*args, **kwargs)

    socket.socket, socket.getaddrinfo, socket.gethostbyname = RecordingSocket, getaddrinfo, gethostbyname
    try:
        try:  # the block itself works
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # pytest-socket warns when it refuses a socket
                socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        except pytest_socket.SocketBlockedError:
            pass
        else:
            raise AssertionError("sockets are not blocked")
        attempts.clear()
        yield attempts
    finally:
        socket.socket, socket.getaddrinfo, socket.gethostbyname = original
