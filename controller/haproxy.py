"""HAProxy runtime API client: read server state, write weights and states in one batch (the controller's
gateway seam, controller/gateway.py, as HAProxy implements it).

One connection per batch in interactive mode ("prompt"): each command on its own line, each reply
ends with the prompt "\\n> ", so replies pair with commands one to one and a batch is not limited
by HAProxy's 16 KB line buffer. Names are validated before anything is sent: a ';', space or
newline in a backend or server name would inject commands.

Fencing (docs/architecture.md, "Leader election"): with a registry every write batch is fenced by an epoch kept in
HAProxy itself (a process variable, `get var`/`set var`), read in the batch's own connection before the batch is
sent; the connection's idle timeout is cut to CLI_TIMEOUT_S first, so a writer paused between that read and its
batch finds its connection closed by HAProxy and its batch unsent.
"""

from __future__ import annotations

import hashlib
import math
import re
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from grayguard.config import HAPROXY_NAME_RE
from grayguard.controller.gateway import GatewayError
from grayguard.reflexes import CHECK_STATUS_HANA

# srv_agent_state bits (HAProxy include/haproxy/check-t.h CHK_ST_*): configured, administratively enabled
CHK_ST_CONFIGURED, CHK_ST_ENABLED = 0x0002, 0x0004
# `show stat` status of a server its agent check marked down (exporters/agent.py answered "down")
STATUS_AGENT_DOWN = "DOWN (agent)"
# srv_admin_state bits (HAProxy include/haproxy/server-t.h, enum srv_admin). HMAINT (0x40) is no maintenance: it says
# the server's FQDN was set at run time, which HAProxy does on every server-template slot an SRV record fills (a filled
# slot shows 64, an emptied one 96 = HMAINT | RMAINT); tests/deploy/test_gateway_srv.py fails if it counted as MAINT
ADMF_FMAINT, ADMF_IMAINT, ADMF_CMAINT, ADMF_FDRAIN, ADMF_IDRAIN, ADMF_RMAINT, ADMF_HMAINT = (
    0x01, 0x02, 0x04, 0x08, 0x10, 0x20, 0x40)
MAINT_MASK = ADMF_FMAINT | ADMF_IMAINT | ADMF_CMAINT | ADMF_RMAINT
DRAIN_MASK = ADMF_FDRAIN | ADMF_IDRAIN
STATIC_ALGOS = frozenset({"static-rr", "first"})
PROMPT_SEP = b"\n> "
# a fenced connection's idle timeout (`set timeout cli`, whole seconds in HAProxy 2.6): HAProxy closes it, batch
# unsent, when the writer sends nothing for this long after reading the epoch
CLI_TIMEOUT_S = 1
# after setting its epoch a writer waits this long before its first batch: every connection that read the epoch
# before has sent its batch by then, or been closed by HAProxy (CLI_TIMEOUT_S, plus HAProxy's timer granularity)
CLAIM_WAIT_S = CLI_TIMEOUT_S + 0.5
EPOCH_READ_S = 0.5  # a batch is not sent when its epoch was read longer ago than this (the writer's own clock)
_VAR_RE = re.compile(r"type=sint value=<(-?\d+)>")
_READ_VERBS = ("show ", "get ", "help")


class HaproxyError(GatewayError):
    """A runtime API failure; kind is a short metric label."""


class FencedError(HaproxyError):
    """A fenced batch HAProxy was not sent (or an epoch set, the batch to follow): why, and the epoch HAProxy has."""

    def __init__(self, message: str, gateway: int | None, claimed: bool = False):
        super().__init__("fenced", message)
        self.gateway, self.claimed = gateway, claimed


def epoch_var(prefix: str, scope: str) -> str:
    """The process variable holding the fencing epoch of a scope (a registry prefix's pool, or "all")."""
    return "proc.grayguard_epoch_" + hashlib.sha256(f"{prefix}/{scope}".encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Fence:
    """What a batch requires of HAProxy's epoch for its scope, read in the batch's own connection.

    epoch: the writer's (None: it has no term). claim_until: until then (the client's monotonic clock, at the
    epoch read) its lease is confirmed for longer than a claim can take, so it may set its epoch where HAProxy has
    another (the batch follows after CLAIM_WAIT_S). restore: the batch may go where HAProxy has no epoch at all (it
    restarted: the membership from the snapshot, by any replica)."""

    var: str
    epoch: int | None
    claim_until: float = -math.inf
    restore: bool = False
    seen: Callable[[str, int | None], None] | None = None  # told (endpoint, the epoch HAProxy had) at every read


def is_write(line: str) -> bool:
    return not line.startswith(_READ_VERBS)


def write_backend(lines: Sequence[str]) -> str | None:
    """The backend the write lines of a batch touch (`<verb> ... <backend>/<server> ...`); None: reads only.
    A batch over several backends raises: a fence is per backend's scope."""
    found = {tok.split("/", 1)[0] for ln in lines if is_write(ln) for tok in ln.split()[2:3] if "/" in tok}
    if any(is_write(ln) for ln in lines) and len(found) != 1:
        raise HaproxyError("unsafe_name", f"a fenced batch must write one backend: {sorted(found) or lines[:1]}")
    return next(iter(found), None)


def parse_var(reply: str) -> int | None:
    """The value of a `get var` reply; None when the variable is not set."""
    m = _VAR_RE.search(reply)
    return int(m.group(1)) if m else None


class UnsafeNameError(HaproxyError):
    """A name that could inject runtime-API commands; nothing was sent."""

    def __init__(self, name: str):
        super().__init__("unsafe_name", f"refusing unsafe HAProxy name {name!r}: only letters, digits, "
                         "'-', '_', '.' and ':' are allowed")


def check_name(name: str) -> str:
    """Return name if HAProxy would accept it as a proxy/server name, else raise UnsafeNameError."""
    if not isinstance(name, str) or not HAPROXY_NAME_RE.match(name):
        raise UnsafeNameError(str(name))
    return name


@dataclass(frozen=True)
class ServerState:
    """One server as `show servers state` reports it."""

    backend: str
    name: str
    address: str  # host:port, an IPv6 host in brackets ([::1]:8000), as Prometheus' `instance` writes it
    weight: int  # current (user) weight
    initial_weight: int
    admin_state: int
    op_state: int
    fqdn: str | None = None  # the hostname the server is configured by (srv_fqdn), None for an address
    check_status: int | None = None  # srv_check_status: the last check's verdict (HCHK_STATUS_*), None: unknown
    # `show stat` hanafail: times HAProxy marked it down for errors since it started (None: unknown). The HANA
    # check status lasts only until the next check (inter); the counter stays, so a tick cannot miss one.
    hanafail: int | None = None
    agent_state: int | None = None  # srv_agent_state (CHK_ST_* bits); None: unknown
    status: str | None = None  # `show stat` status ("UP", "DOWN (agent)", "MAINT", ...); None: unknown
    agent_text: str | None = None  # `show stat` last_agt: the agent's last answer ("down (hang: ...)"); None: unknown

    @property
    def drain(self) -> bool:
        return bool(self.admin_state & DRAIN_MASK)

    @property
    def maint(self) -> bool:
        return bool(self.admin_state & MAINT_MASK)

    @property
    def down(self) -> bool:
        """DOWN by its health check or error-limit: srv_op_state 0 (stopped) while not in MAINT (MAINT stops it too)."""
        return self.op_state == 0 and not self.maint

    @property
    def marked_down_for_errors(self) -> bool:
        """DOWN by `observe layer7` + `error-limit` + `on-error mark-down`: check_status HANA (until a check
        overwrites it), not by a failed health check."""
        return self.down and self.check_status == CHECK_STATUS_HANA

    @property
    def agent_down(self) -> bool:
        """DOWN because its agent check answered "down" (the node's exporter saw garbage, a CUDA error or a hang)."""
        return self.down and self.status == STATUS_AGENT_DOWN

    @property
    def agent_off(self) -> bool:
        """Its agent check is configured but administratively disabled (`disable agent`)."""
        a = self.agent_state
        return a is not None and bool(a & CHK_ST_CONFIGURED) and not a & CHK_ST_ENABLED


@dataclass(frozen=True)
class Command:
    """A runtime API write: a server's weight (int), admin state ("ready"/"drain") or agent ("enable"/"disable")."""

    backend: str
    server: str
    kind: str  # "weight", "state" or "agent"
    value: int | str

    def render(self) -> str:
        check_name(self.backend)
        check_name(self.server)
        if self.kind == "weight":
            if not isinstance(self.value, int) or isinstance(self.value, bool) or not 0 <= self.value <= 256:
                raise HaproxyError("bad_value", f"weight must be an int in 0..256, got {self.value!r}")
        elif self.kind == "state":
            if self.value not in ("ready", "drain", "maint"):
                raise HaproxyError("bad_value", f"unknown state {self.value!r}")
        elif self.kind == "agent":
            if self.value not in ("enable", "disable"):
                raise HaproxyError("bad_value", f"unknown agent action {self.value!r}")
            return f"{self.value} agent {self.backend}/{self.server}"
        else:
            raise HaproxyError("bad_value", f"unknown command kind {self.kind!r}")
        return f"set server {self.backend}/{self.server} {self.kind} {self.value}"


@dataclass(frozen=True)
class CommandResult:
    command: Command
    ok: bool
    reply: str
    kind: str = ""  # error class when not ok: no_such_server, static_algorithm, rejected


def classify_reply(reply: str) -> tuple[bool, str]:
    """(ok, error kind) for the reply to a `set server` command; success replies are empty."""
    text = reply.strip()
    if not text:
        return True, ""
    low = text.lower()
    if "no such server" in low or "no such backend" in low or "can't find" in low:
        return False, "no_such_server"
    if "static lb algorithm" in low:
        return False, "static_algorithm"
    return False, "rejected"


def host_port(host: str, port: str) -> str:
    """host:port as a URL or Prometheus' `instance` writes it: an IPv6 host in brackets ([::1]:8000)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# the columns of a `show servers state` line: those it must have, then optional ones (defaults when absent)
_STATE_COLUMNS = ("be_name", "srv_name", "srv_addr", "srv_port", "srv_uweight", "srv_iweight", "srv_admin_state",
                  "srv_op_state")
_OPTIONAL_COLUMNS = ("srv_fqdn", "srv_check_status", "srv_agent_state")


def parse_servers_state(text: str, stat: Mapping[tuple[str, str], Mapping[str, str]] | None = None
                        ) -> list[ServerState]:
    """Parse `show servers state` output (format version 1); stat: `show stat` columns by (backend, server)
    (parse_stat_columns: hanafail, status, last_agt) to fill in, None: left unknown.

    10,000 servers are parsed every tick at scale: a line that has every column the header names is read by
    position; any other line by name (a short line lacks its last columns: an optional one is absent, a
    required one is an error)."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if not lines or lines[0].strip() != "1":
        raise HaproxyError("bad_reply", f"unexpected `show servers state` reply: {text[:120]!r}")
    header: list[str] = []
    at: tuple[int, ...] | None = None  # positions of every column, when the header names them all
    out = []
    for ln in lines[1:]:
        if ln.startswith("#"):
            header = ln.lstrip("# ").split()
            pos = {c: i for i, c in enumerate(header)}  # a repeated name: the last one, as dict(zip()) keeps
            cols = (*_STATE_COLUMNS, *_OPTIONAL_COLUMNS)
            at = tuple(pos[c] for c in cols) if all(c in pos for c in cols) else None
            continue
        fields = ln.split()
        if at is not None and len(fields) >= len(header):
            f = dict(zip(_STATE_COLUMNS + _OPTIONAL_COLUMNS, [fields[i] for i in at], strict=True))
        else:
            f = dict(zip(header, fields, strict=False))
        try:
            backend, name = f["be_name"], f["srv_name"]
            row = {} if stat is None else stat.get((backend, name), {})
            out.append(ServerState(
                backend=backend, name=name, address=host_port(f["srv_addr"], f["srv_port"]),
                weight=int(f["srv_uweight"]), initial_weight=int(f["srv_iweight"]),
                admin_state=int(f["srv_admin_state"]), op_state=int(f["srv_op_state"]),
                fqdn=None if f.get("srv_fqdn", "-") == "-" else f["srv_fqdn"],
                check_status=int(f["srv_check_status"]) if f.get("srv_check_status", "").isdigit() else None,
                agent_state=int(f["srv_agent_state"]) if f.get("srv_agent_state", "").isdigit() else None,
                hanafail=_hanafail(row), status=row.get("status"), agent_text=agent_answer(row.get("last_agt"))))
        except (KeyError, ValueError) as e:
            raise HaproxyError("bad_reply", f"cannot parse server state line {ln!r}: {e}") from e
    return out


def parse_stat_columns(csv_text: str, *names: str) -> dict[tuple[str, str], dict[str, str]]:
    """(backend, server) -> {column: value} for those of the named columns `show stat` CSV output has (an older
    HAProxy lacks some: absent, not empty), servers and BACKEND/FRONTEND rows alike; {} when it is no such reply."""
    lines = csv_text.splitlines()
    if not lines or not lines[0].startswith("# "):
        return {}
    cols = lines[0][2:].split(",")
    if not {"pxname", "svname"} <= set(cols):
        return {}
    have = [c for c in names if c in cols]
    idx = [cols.index(c) for c in ("pxname", "svname", *have)]
    out = {}
    for ln in lines[1:]:
        f = ln.split(",")
        if len(f) > max(idx):
            out[(f[idx[0]], f[idx[1]])] = {c: f[i] for c, i in zip(have, idx[2:], strict=True)}
    return out


def _states(reply: str, stat: str) -> list[ServerState]:
    """The servers of a `show servers state` reply, with the columns of the `show stat` reply sent beside it."""
    return parse_servers_state(reply, parse_stat_columns(stat, "hanafail", "status", "last_agt"))


def _no_backend(reply: str) -> bool:
    """Whether a `show servers state <backend>` reply says HAProxy has no such backend."""
    return "can't find backend" in reply.lower()


def _hanafail(row: dict[str, str]) -> int | None:
    v = row.get("hanafail", "")
    return int(v) if v.isdigit() else None


def agent_answer(last_agt: str | None) -> str | None:
    """The agent's own words from `show stat` last_agt ("via agent : down (hang: no token in 2.0s)" -> "hang: no
    token in 2.0s"); None when there are none. Printable ASCII only, at most 160 characters."""
    if not last_agt:
        return None
    text = last_agt.split(":", 1)[1].strip() if last_agt.startswith("via agent") else last_agt.strip()
    if text.startswith("down (") and text.endswith(")"):
        text = text[len("down ("):-1]
    text = "".join(c for c in text if 32 <= ord(c) < 127)[:160].strip()
    return text or None


def parse_hanafail(csv_text: str) -> dict[tuple[str, str], int]:
    """(backend, server) -> hanafail, from `show stat` CSV output; {} when the reply is not one."""
    return {k: h for k, row in parse_stat_columns(csv_text, "hanafail").items() if (h := _hanafail(row)) is not None}


def parse_backend_algos(csv_text: str) -> dict[str, str]:
    """Backend name -> balance algorithm, from `show stat` CSV output."""
    lines = csv_text.splitlines()
    if not lines or not lines[0].startswith("# "):
        raise HaproxyError("bad_reply", "unexpected `show stat` reply")
    cols = lines[0][2:].split(",")
    if "algo" not in cols:
        return {}
    if "pxname" not in cols or "svname" not in cols:
        raise HaproxyError("bad_reply", "`show stat` reply has no pxname/svname column")
    i_px, i_sv, i_algo = cols.index("pxname"), cols.index("svname"), cols.index("algo")
    out = {}
    for ln in lines[1:]:
        f = ln.split(",")
        if len(f) > max(i_px, i_sv, i_algo) and f[i_sv] == "BACKEND":
            out[f[i_px]] = f[i_algo]
    return out


class RuntimeClient:
    """One HAProxy runtime API endpoint: "unix:/path", "/path" or "host:port"."""

    # with a registry the controller sets this: the fence of a batch's write lines (None: none, a read)
    fence_for: Callable[[str, list[str]], Fence | None] | None = None

    def __init__(self, endpoint: str, timeout_s: float = 2.0, clock: Callable[[], float] = time.monotonic):
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.clock = clock
        self._claimed: dict[str, tuple[int, float]] = {}  # var -> (epoch this client set, when)

    def _remaining(self, deadline: float) -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise HaproxyError("timeout", f"HAProxy at {self.endpoint} did not finish within {self.timeout_s:g}s")
        return left

    def _connect(self, deadline: float) -> socket.socket:
        ep = self.endpoint
        s, left = None, self._remaining(deadline)
        try:
            if ep.startswith("unix:") or ep.startswith("/"):
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.settimeout(left)
                s.connect(ep.removeprefix("unix:"))
            else:
                host, _, port = ep.rpartition(":")
                s = socket.create_connection((host.strip("[]"), int(port)), timeout=left)
        except (OSError, ValueError, OverflowError) as e:  # a bad port is a ValueError or OverflowError
            if s is not None:
                s.close()
            raise HaproxyError("connect", f"cannot connect to HAProxy at {ep}: {e}") from e
        return s

    def execute(self, lines: list[str]) -> list[str]:
        """Send lines over one interactive connection; return one reply per line.

        Connect, send and read share one deadline of timeout_s: a socket timeout bounds each recv, not the
        call, so an endpoint that trickles a byte at a time would otherwise hold the tick for ever.
        """
        for ln in lines:
            if "\n" in ln or "\r" in ln or ";" in ln:
                raise HaproxyError("unsafe_name", f"refusing command with a separator: {ln!r}")
        fence = self.fence_for(self.endpoint, lines) if self.fence_for is not None and lines else None
        deadline = time.monotonic() + self.timeout_s
        sock = self._connect(deadline)
        chunks: list[bytes] = []
        try:
            after = self._fence(sock, fence, deadline, chunks) if fence is not None else ""
            sock.settimeout(self._remaining(deadline))
            payload = ("" if fence else "prompt\n") + "".join(ln + "\n" for ln in lines) + after + "quit\n"
            sock.sendall(payload.encode())  # the timeout bounds sendall as a whole
            self._read_until(sock, deadline, chunks, None)
        except TimeoutError as e:
            raise HaproxyError("timeout", f"HAProxy at {self.endpoint} did not finish within "
                               f"{self.timeout_s:g}s") from e
        except OSError as e:
            raise HaproxyError("io", f"HAProxy at {self.endpoint} failed mid-batch: {e}") from e
        finally:
            sock.close()
        raw = b"".join(chunks)
        parts = raw.split(PROMPT_SEP)
        # parts[0] answers "prompt" (fenced: then `set timeout cli`, `get var`); then one part per command, each
        # complete once the next prompt follows it; the tail after the last prompt is "" (or a reply cut short)
        skip = 3 if fence is not None else 1
        replies = [p.decode(errors="replace") for p in parts[skip:-1][:len(lines)]]
        if len(replies) != len(lines):
            raise HaproxyError("bad_reply", f"HAProxy at {self.endpoint} answered {len(replies)} of "
                               f"{len(lines)} commands (closed early?)")
        return replies

    def hold(self, fence: Fence) -> bool:
        """Make sure HAProxy has fence's epoch, claiming it when the fence allows (a leader does this every tick
        until it has, so that it can steer on it through an etcd outage, with nothing to write); True when it has
        and no claim is being waited on."""
        if fence.epoch is None:
            return False
        if self._claimed.get(fence.var, (None, 0.0))[0] == fence.epoch:
            return self.clock() - self._claimed[fence.var][1] >= CLAIM_WAIT_S
        deadline = time.monotonic() + self.timeout_s
        sock = self._connect(deadline)
        try:
            self._fence(sock, fence, deadline, [])
            self._quit(sock)
        except FencedError:
            return False
        except OSError as e:
            raise HaproxyError("io", f"HAProxy at {self.endpoint} failed reading the epoch: {e}") from e
        finally:
            sock.close()
        self._claimed[fence.var] = (fence.epoch, -math.inf)  # its own already (set by another client of this replica)
        return True

    def claim_pending(self, var: str) -> float:
        """Seconds before a batch may follow this client's claim of var (0: none pending)."""
        claimed = self._claimed.get(var)
        return 0.0 if claimed is None else max(0.0, claimed[1] + CLAIM_WAIT_S - self.clock())

    def _read_until(self, sock: socket.socket, deadline: float, chunks: list[bytes], prompts: int | None) -> None:
        """Read into chunks until the connection ends (prompts None) or holds that many prompts."""
        while prompts is None or b"".join(chunks).count(PROMPT_SEP) < prompts:
            sock.settimeout(self._remaining(deadline))
            data = sock.recv(65536)
            if not data:
                if prompts is not None:
                    raise HaproxyError("io", f"HAProxy at {self.endpoint} closed the connection before the epoch")
                return
            chunks.append(data)

    def _fence(self, sock: socket.socket, fence: Fence, deadline: float, chunks: list[bytes]) -> str:
        """Read the epoch in this connection and return when the batch may follow (with the lines to send after it:
        a restore by a claiming writer sets its epoch behind the batch); else raise FencedError (an epoch claimed:
        set, the batch to follow after CLAIM_WAIT_S)."""
        sock.settimeout(self._remaining(deadline))
        sock.sendall(f"prompt\nset timeout cli {CLI_TIMEOUT_S}\nget var {fence.var}\n".encode())
        self._read_until(sock, deadline, chunks, 3)
        read_at = self.clock()
        reply = b"".join(chunks).split(PROMPT_SEP)[2].decode(errors="replace")
        if reply.strip() and parse_var(reply) is None and "not found" not in reply.lower():
            self._quit(sock)  # an HAProxy without `get var` (before 2.4) or a socket below admin level
            raise HaproxyError("unsupported", f"HAProxy at {self.endpoint} cannot keep the fencing epoch "
                               f"(`get var`: {reply.strip()[:80]!r}); HAProxy 2.6+ and an admin-level socket needed")
        gateway = parse_var(reply)
        if fence.seen is not None:
            fence.seen(self.endpoint, gateway)
        mine, after = fence.epoch, ""
        if mine is not None and gateway == mine:
            claimed = self._claimed.get(fence.var)
            if claimed is not None and claimed[0] == mine and read_at - claimed[1] < CLAIM_WAIT_S:
                self._quit(sock)
                raise FencedError(f"epoch {mine} set {read_at - claimed[1]:.1f}s ago: the batch waits "
                                  f"{CLAIM_WAIT_S:g}s for older connections to end", gateway)
        elif gateway is None and fence.restore:  # a restarted HAProxy: nobody steers it; the snapshot's members go in
            if mine is not None and read_at < fence.claim_until:
                after = f"experimental-mode on\nset var {fence.var} int({mine})\n"
                self._claimed[fence.var] = (mine, read_at)
        elif mine is not None and read_at < fence.claim_until:
            said = self._quit(sock, f"experimental-mode on\nset var {fence.var} int({mine})\n")
            if said.replace(PROMPT_SEP.decode(), "").strip():  # both answer nothing when they took
                raise HaproxyError("unsupported", f"HAProxy at {self.endpoint} did not set the fencing epoch: "
                                   f"{said.strip()[:120]!r}")
            self._claimed[fence.var] = (mine, read_at)
            raise FencedError(f"epoch {mine} set (HAProxy had {gateway}): the batch follows in {CLAIM_WAIT_S:g}s",
                              gateway, claimed=True)
        else:
            self._quit(sock)
            raise FencedError(f"HAProxy {self.endpoint} has epoch {gateway}, this writer {mine}: not sent", gateway)
        if self.clock() - read_at > EPOCH_READ_S:  # a pause since the read: the batch goes in a later connection
            self._quit(sock)
            raise FencedError(f"the epoch was read {self.clock() - read_at:.2f}s ago (> {EPOCH_READ_S:g}s)", gateway)
        return after

    def _quit(self, sock: socket.socket, before: str = "") -> str:
        """Send before (if any) and quit; with before, wait for HAProxy to close: what it answered to before."""
        got = []
        try:
            sock.sendall((before + "quit\n").encode())
            while before and (data := sock.recv(65536)):  # the epoch is set before CLAIM_WAIT_S counts from now
                got.append(data)
        except OSError:
            pass
        return b"".join(got).decode(errors="replace")

    def show_servers_state(self, backend: str | None = None) -> list[ServerState]:
        """Every server (of one backend, or all), with its hanafail counter and status from `show stat` (same
        batch)."""
        cmd = "show servers state" + (f" {check_name(backend)}" if backend else "")
        reply, stat = self.execute([cmd, f"show stat {backend or -1} 4 -1"])
        if _no_backend(reply):
            raise HaproxyError("no_such_backend", f"HAProxy at {self.endpoint} has no backend {backend!r}")
        return _states(reply, stat)

    def show_backends_state(self, backends: Sequence[str]) -> list[ServerState]:
        """show_servers_state of each of these backends, in one batch (a sharded replica reads the backends of the
        pools it leads, not the whole table: controller/readscope.py). A backend HAProxy does not have is left out,
        as the whole table leaves it out."""
        names = [check_name(b) for b in backends]  # every name checked before anything is sent
        lines = [ln for b in names for ln in (f"show servers state {b}", f"show stat {b} 4 -1")]
        replies = self.execute(lines) if lines else []
        out: list[ServerState] = []
        for reply, stat in zip(replies[0::2], replies[1::2], strict=True):
            if not _no_backend(reply):
                out += _states(reply, stat)
        return out

    def get_weight(self, backend: str, server: str) -> tuple[int, int]:
        """(current, initial) weight of one server."""
        reply = self.execute([f"get weight {check_name(backend)}/{check_name(server)}"])[0].strip()
        try:
            cur, _, rest = reply.partition(" (initial ")
            return int(cur), int(rest.rstrip(")"))
        except ValueError as e:
            raise HaproxyError("no_such_server" if "no such" in reply.lower() else "bad_reply",
                               f"get weight {backend}/{server}: {reply!r}") from e

    def backend_algorithms(self) -> dict[str, str]:
        """Backend -> balance algorithm (from `show stat`)."""
        return parse_backend_algos(self.execute(["show stat -1 2 -1"])[0])

    def apply(self, commands: list[Command]) -> list[CommandResult]:
        """Send every command in one batch; every reply is checked. Unsafe names raise before sending."""
        lines = [c.render() for c in commands]  # validates every name first: all or nothing
        if not lines:
            return []
        replies = self.execute(lines)
        results = []
        for c, r in zip(commands, replies, strict=True):
            ok, kind = classify_reply(r)
            results.append(CommandResult(c, ok, r.strip(), kind))
        return results
