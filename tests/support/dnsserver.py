"""A DNS server for tests: what HAProxy's resolvers ask of the cluster DNS (CoreDNS) about a headless Service.

The subset it speaks (RFC 1035 wire format over UDP on 127.0.0.1; names written uncompressed):
- a query of one question of class IN (anything else, or a reply, is dropped unanswered; an EDNS OPT record in the
  query's additional section is ignored, as the answers are small);
- SRV for the service name: one record per pod (priority 0, an equal weight share, the pod's port and target name),
  with each target's A record in the additional section, as CoreDNS sends them;
- A for a target name: its IPv4 address; any other type of a known name: NOERROR with no answer (NODATA);
- NXDOMAIN for every other name. No TCP, no truncation, no AAAA, no recursion.
The pods can be changed while it runs (set_pods); every question asked is kept in `asked`.
"""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass

TYPE_A, TYPE_SRV, CLASS_IN = 1, 33, 1
RCODE_NXDOMAIN = 3
FLAG_QR, FLAG_AA, FLAG_RD, FLAG_RA = 0x8000, 0x0400, 0x0100, 0x0080


@dataclass(frozen=True)
class Pod:
    """One SRV record: its target name, port, and the target's IPv4 address."""

    target: str
    port: int
    address: str


def encode_name(name: str) -> bytes:
    """A domain name as length-prefixed labels, ending in the root's zero length."""
    return b"".join(bytes([len(x)]) + x.encode("ascii") for x in name.strip(".").split(".") if x) + b"\0"


def decode_name(msg: bytes, at: int) -> tuple[str, int]:
    """(lower-cased name, offset after it) of the uncompressed name at `at` (a question's name is never compressed)."""
    labels = []
    while msg[at]:
        n = msg[at]
        if n & 0xC0:
            raise ValueError("compressed name in a question")
        labels.append(msg[at + 1:at + 1 + n].decode("ascii").lower())
        at += 1 + n
    return ".".join(labels), at + 1


def record(name: str, rtype: int, ttl: int, rdata: bytes) -> bytes:
    return encode_name(name) + struct.pack("!HHIH", rtype, CLASS_IN, ttl, len(rdata)) + rdata


class DnsServer:
    """Answers SRV queries for `service` with the current pods; start(), then stop() (or use it as a context)."""

    def __init__(self, service: str, pods: Sequence[Pod] = (), ttl: int = 5):
        self.service = service.strip(".").lower()
        self.ttl = ttl  # CoreDNS's kubernetes plugin answers with 5 s
        self.asked: list[tuple[str, int]] = []  # (name, type) of every question, in order
        self._pods: tuple[Pod, ...] = tuple(pods)
        self._lock = threading.Lock()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.settimeout(0.1)  # the loop looks at the stop flag this often
        self.port = self._sock.getsockname()[1]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="dnsserver", daemon=True)

    def set_pods(self, pods: Sequence[Pod]) -> None:
        """Replace the SRV answer's records (a scale up or down) from the next query on."""
        with self._lock:
            self._pods = tuple(pods)

    def start(self) -> DnsServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close()

    def __enter__(self) -> DnsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                query, peer = self._sock.recvfrom(4096)
            except TimeoutError:
                continue
            try:
                reply = self.answer(query)
            except (ValueError, IndexError, struct.error):
                continue  # malformed: dropped, as the resolver retries
            if reply is not None:
                self._sock.sendto(reply, peer)

    def answer(self, query: bytes) -> bytes | None:
        """The reply to one query message; None for what this server does not answer."""
        qid, flags, qdcount = struct.unpack("!HHH", query[:6])
        if flags & FLAG_QR or qdcount != 1 or (flags >> 11) & 0xF:  # a reply, several questions, not a QUERY
            return None
        name, end = decode_name(query, 12)
        qtype, qclass = struct.unpack("!HH", query[end:end + 4])
        if qclass != CLASS_IN:
            return None
        question = query[12:end + 4]  # echoed as asked (its case too)
        with self._lock:
            pods = self._pods
            self.asked.append((name, qtype))
        hosts = {p.target.strip(".").lower(): p.address for p in pods}
        answers, additional, rcode = [], [], 0
        if name == self.service:
            if qtype == TYPE_SRV:
                share = 100 // max(len(pods), 1)
                answers = [record(name, TYPE_SRV, self.ttl, struct.pack("!HHH", 0, share, p.port)
                                  + encode_name(p.target)) for p in pods]
                additional = [record(p.target, TYPE_A, self.ttl, socket.inet_aton(p.address)) for p in pods]
        elif name in hosts:
            if qtype == TYPE_A:
                answers = [record(name, TYPE_A, self.ttl, socket.inet_aton(hosts[name]))]
        else:
            rcode = RCODE_NXDOMAIN
        out_flags = FLAG_QR | FLAG_AA | (flags & FLAG_RD) | FLAG_RA | rcode
        header = struct.pack("!HHHHHH", qid, out_flags, 1, len(answers), 0, len(additional))
        return header + question + b"".join(answers) + b"".join(additional)
