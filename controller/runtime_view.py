"""A read-only window onto a pod-local HAProxy runtime API: the two reads the controller needs, nothing else.

HAProxy's runtime API has no authentication, so its admin socket stays a Unix socket inside the HAProxy pod. The
controller still has to see every HAProxy of a tier (`show servers state` and `show stat`, one batch a tick), so
the actuator beside each HAProxy serves this view on TCP: the client speaks the runtime API's interactive protocol
(`controller/haproxy.py`'s RuntimeClient, unchanged), each allowed command is forwarded to the admin socket in one
batch, and every other command is answered "Permission denied" like HAProxy's `level user` does. So the worst a
peer on the network can do here is read the server list and its counters.
"""

from __future__ import annotations

import logging
import re
import socket
import socketserver
import threading
import time

from prometheus_client import CollectorRegistry, Counter

from grayguard.controller.haproxy import PROMPT_SEP, HaproxyError, RuntimeClient

log = logging.getLogger("grayguard.actuator")

_NAME = r"[A-Za-z0-9_.:-]{1,64}"
# what RuntimeClient.show_servers_state and .backend_algorithms send (and `show stat` in general): reads only
ALLOWED = re.compile(rf"^(show servers state( {_NAME})?|show stat (-1|{_NAME}) (-1|[0-9]{{1,3}}) -1)$")
DENIED = "Permission denied\n"
MAX_REQUEST = 16384  # bytes: a few commands; anything longer is not the controller
MAX_COMMANDS = 16


def request_counter(registry: CollectorRegistry) -> Counter:
    """The view's connections by result, on registry (the actuator's)."""
    return Counter("grayguard_actuator_view_requests", "Connections to the read-only runtime view, by result (ok; "
                   "denied: a command other than the allowed reads; error)", ["result"], registry=registry)


def answer(lines: list[str], upstream: RuntimeClient) -> list[str]:
    """One reply per command: the allowed ones from HAProxy (one batch), the others denied."""
    allowed = [ln for ln in lines if ALLOWED.fullmatch(ln)]
    replies = iter(upstream.execute(allowed) if allowed else [])
    return [next(replies) if ALLOWED.fullmatch(ln) else DENIED for ln in lines]


class RuntimeView:
    """Serves the read-only view on a TCP address; start() binds it, stop() closes it."""

    def __init__(self, address: tuple[str, int], upstream: RuntimeClient, requests: Counter | None = None,
                 timeout_s: float = 2.0):
        self.upstream, self.timeout_s = upstream, timeout_s
        self.requests = requests if requests is not None else request_counter(CollectorRegistry())
        view = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                view._serve(self.request)

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True
            address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET

        self._server = Server(address, Handler, bind_and_activate=False)
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> tuple[str, int]:
        return self._server.server_address[:2]

    def start(self) -> RuntimeView:
        self._server.server_bind()
        self._server.server_activate()
        self._thread = threading.Thread(target=self._server.serve_forever, name="runtime-view", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _serve(self, conn: socket.socket) -> None:
        deadline = time.monotonic() + self.timeout_s
        lines = self._read(conn, deadline)
        if lines is None:
            self.requests.labels("error").inc()
            return
        interactive = bool(lines) and lines[0] == "prompt"
        commands = [ln for ln in lines[1 if interactive else 0:] if ln and ln != "quit"][:MAX_COMMANDS]
        try:
            replies = answer(commands, self.upstream)
        except HaproxyError as e:  # HAProxy itself did not answer: close, the client counts its own error
            log.warning("runtime view: HAProxy at %s: %s", self.upstream.endpoint, e)
            self.requests.labels("error").inc()
            return
        self.requests.labels("denied" if DENIED in replies else "ok").inc()
        out = PROMPT_SEP + PROMPT_SEP.join(r.encode() for r in replies) + PROMPT_SEP if interactive \
            else b"".join(r.encode() for r in replies)
        try:
            conn.settimeout(max(deadline - time.monotonic(), 0.1))
            conn.sendall(out)
        except OSError:
            pass  # the client went away: nothing to do

    def _read(self, conn: socket.socket, deadline: float) -> list[str] | None:
        """The request's lines, up to "quit" or the end of the stream; None on a timeout or an oversized request."""
        buf = b""
        while not (buf.endswith(b"quit\n") or len(buf) > MAX_REQUEST or _one_shot(buf)):
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            conn.settimeout(left)
            try:
                data = conn.recv(4096)
            except OSError:
                return None
            if not data:
                break
            buf += data
        if len(buf) > MAX_REQUEST:
            return None
        return [ln.strip() for ln in buf.decode(errors="replace").splitlines()]


def _one_shot(buf: bytes) -> bool:
    """A whole first line that is not "prompt": a non-interactive request, one command (HAProxy's own rule)."""
    first, nl, _ = buf.partition(b"\n")
    return bool(nl) and first.strip() != b"prompt"
