"""A static test backend behind a real HAProxy: /health answers 200 until it is told to fail, and completions
stream slowly, so a test can have HAProxy mark a server DOWN while a request through it goes on."""

from __future__ import annotations

import http.server
import threading
import time


class StaticBackend:
    """An HTTP server on 127.0.0.1: GET /health (200, or 503 once healthy is False), POST /v1/completions (a stream of
    one chunk every 50 ms for stream_s seconds)."""

    def __init__(self, stream_s: float = 6.0):
        self.healthy = True
        self.stream_s = stream_s
        backend = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"  # the stream ends with the connection

            def do_GET(self):
                self.send_response(200 if backend.healthy else 503)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                end = time.monotonic() + backend.stream_s
                try:
                    while time.monotonic() < end:
                        self.wfile.write(b'data: {"choices": [{"text": "x"}]}\n\n')
                        self.wfile.flush()
                        time.sleep(0.05)
                    self.wfile.write(b"data: [DONE]\n\n")
                except OSError:
                    pass  # the client went away

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
