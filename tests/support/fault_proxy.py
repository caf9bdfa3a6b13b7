"""A fault-injecting HTTP proxy for the S3 endpoint: every request is counted and forwarded to
moto's server, except the ones a test chose to break.

Faults, per request number (1-based, counting every request the proxy sees):
  "500"  an S3 InternalError answer, nothing forwarded;
  "503"  an S3 SlowDown (throttling) answer, nothing forwarded;
  "cut"  half the request body is read, then the connection is closed with no answer;
  "cut-answer"  the request is forwarded, and the connection closed halfway through the
         answer's body (after headers that promise all of it).
A "cut" never reaches the server, so a retried request can never find its first attempt
already applied (S3 clients retry on exactly these faults). A "cut-answer" does reach it: it
is for reads, whose repetition changes nothing.
"""

from __future__ import annotations

import http.client
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

ERROR_BODY = (
    '<?xml version="1.0" encoding="UTF-8"?>\n'
    "<Error><Code>{code}</Code><Message>injected by the test proxy</Message></Error>"
)
ANSWERS = {"500": (500, "InternalError"), "503": (503, "SlowDown")}
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-connection"}


class FaultProxy:
    """Start with `FaultProxy(upstream).start()`; `endpoint` is what clients use."""

    def __init__(self, upstream: str) -> None:
        self.upstream = urlsplit(upstream).netloc
        self.lock = threading.Lock()
        self.count = 0
        self.faults: dict[int, str] = {}
        self.persistent: tuple[int, str] | None = None
        self.injected: list[tuple[int, str, str, str]] = []  # (request number, fault, method, path)
        self.first_fault_at: float | None = None  # time.monotonic() of the first injected fault
        self.in_flight = 0
        self.most_in_flight = 0  # the most requests that were being handled at once
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"

    def start(self) -> FaultProxy:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def reset(self, faults: dict[int, str] | None = None, from_request: tuple[int, str] | None = None) -> None:
        """Count from zero; break the requests `faults` numbers, and every request from
        `from_request[0]` on with `from_request[1]` (a persistent fault)."""
        with self.lock:
            self.count = 0
            self.faults = dict(faults or {})
            self.persistent = from_request
            self.injected = []
            self.first_fault_at = None
            self.most_in_flight = 0

    def _count_in_flight(self, change: int) -> None:
        with self.lock:
            self.in_flight += change
            self.most_in_flight = max(self.most_in_flight, self.in_flight)

    def _fault_for(self, method: str, path: str) -> str | None:
        with self.lock:
            self.count += 1
            fault = self.faults.get(self.count)
            if fault is None and self.persistent is not None and self.count >= self.persistent[0]:
                fault = self.persistent[1]
            if fault is not None:
                self.injected.append((self.count, fault, method, path))
                self.first_fault_at = self.first_fault_at or time.monotonic()
            return fault


def _handler(proxy: FaultProxy) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # quiet
            pass

        def handle_one_request(self) -> None:
            try:
                super().handle_one_request()
            except (ConnectionError, socket.timeout):
                self.close_connection = True

        def _body(self, limit: int | None = None) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                chunks = []
                while True:
                    size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                    if size == 0:
                        while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                            pass
                        return b"".join(chunks)
                    chunks.append(self.rfile.read(size))
                    self.rfile.readline()
            length = int(self.headers.get("Content-Length") or 0)
            return self.rfile.read(length if limit is None else min(length, limit))

        def _relay(self) -> None:
            proxy._count_in_flight(+1)
            try:
                self._answer()
            finally:
                proxy._count_in_flight(-1)

        def _answer(self) -> None:
            fault = proxy._fault_for(self.command, self.path)
            if fault == "cut":
                self._body(limit=int(self.headers.get("Content-Length") or 0) // 2)
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
                return
            body = self._body()
            if fault in ANSWERS:
                status, code = ANSWERS[fault]
                payload = ERROR_BODY.format(code=code).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)
                return
            headers = {key: value for key, value in self.headers.items() if key.lower() not in HOP_BY_HOP}
            headers["Content-Length"] = str(len(body))
            upstream = http.client.HTTPConnection(proxy.upstream, timeout=120)
            try:
                upstream.request(self.command, self.path, body=body, headers=headers)
                response = upstream.getresponse()
                payload = response.read()
                self.send_response(response.status, response.reason)
                for key, value in response.getheaders():
                    if key.lower() not in HOP_BY_HOP and key.lower() != "content-length":
                        self.send_header(key, value)
                # a HEAD answer carries the object's length, not its (empty) body's
                length = response.getheader("Content-Length", "0") if self.command == "HEAD" else str(len(payload))
                self.send_header("Content-Length", length)
                self.end_headers()
                if fault == "cut-answer":
                    self.wfile.write(payload[:len(payload) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                elif self.command != "HEAD":
                    self.wfile.write(payload)
            finally:
                upstream.close()

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _relay

    return Handler
