"""`grayguard exporter`: the per-node sidecar (NVML GPU health and a vLLM micro-probe on /metrics)."""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import threading
from urllib.parse import urlsplit

import pynvml

from grayguard import etcdconn
from grayguard.config import ConfigError
from grayguard.engines import DEFAULT_ENGINE, ENGINES
from grayguard.exporters.podinfo import NAMESPACE_ENV, POD_ENV
from grayguard.exporters.prober import ProbeConfig
from grayguard.exporters.registration import RegistrationConfig
from grayguard.exporters.server import AgentListenError, Exporter
from grayguard.reflexes import DEFAULT as REFLEXES
from grayguard.registry import DEFAULT_PREFIX, node_key

log = logging.getLogger(__name__)

HELP = "run the per-node sidecar: GPU health from NVML and a vLLM micro-probe, on /metrics"
DESCRIPTION = """\
Per-node sidecar for one vLLM server. It exports, on /metrics (Prometheus text format):

  * GPU health read through NVML: clocks and their maxima, clock-event (throttle) reasons,
    temperatures, power, PCIe link generation/width and replays, ECC and row remapping, XID
    errors, utilization and memory. Unsupported fields are left out, never exported as 0.
    Without NVML (no driver) grayguard_exporter_nvml_up is 0 and the probes keep running.
  * A micro-probe: every --probe.interval a one-token streamed completion with a random prefix
    (no prefix-cache hit) and the header X-LLM-Probe: true. Its time to first token and its
    result (ok, slow, timeout, connect_error, http_error, cuda_error, bad_response, starting).
  * The live fast path, also on /metrics/fast (scrape it every second): vLLM's inter-token latency,
    TTFT and tokens/s over the last --live.window, read from its /metrics at every probe, its queues,
    and the median TTFT of the last probes.

  * HAProxy's agent check on --agent.listen-address: every connection gets one line, "down #why"
    when the last probe saw garbage text, a CUDA error or a hang (no token generated while requests
    ran), "up" otherwise (docs/exporters.md). Off with --no-agent or --no-probe.
  * With --registry.url: the node's membership in etcd. After pre-checks (GPU healthy, the advertised port
    reachable, the model loaded, the API key accepted) it writes <prefix>/nodes/<pool>/<node> on its own
    lease, kept alive every --registry.heartbeat with an adaptive TTL; on SIGTERM it says "leaving", then
    revokes the lease (docs/exporters.md, "Registry"). --registry.url once per member of the etcd cluster;
    TLS with --registry.ca-file, --registry.cert-file and --registry.key-file; an etcd user with --registry.user
    and --registry.password-file (docs/operations.md, "etcd security").

  * /healthz: 503 when its probe round, its fast-path reads or its registry round have completed nothing for
    their stall limit (12 s, 32 s with the defaults); /readyz: 503 until the first probe round and the first
    fast-path read have completed (docs/exporters.md, "Health probes").

  * With --pod.name and --pod.namespace (by default $POD_NAME and $POD_NAMESPACE): grayguard_node_pod_info, which
    joins dcgm-exporter's GPUs to this node when the rules take GPU evidence from dcgm-exporter instead of this
    sidecar's NVML collector (rules.gpu_source: dcgm, run with --no-collector.nvml; docs/dcgm.md).

A scrape never waits on vLLM: probes run in the background and a scrape reads their last result.
No node label is added: Prometheus' scrape config sets `instance` and `pool`.

Durations take Prometheus units: 300ms, 2s, 1m30s (a bare number is seconds).

example:
  grayguard exporter --vllm.url http://127.0.0.1:8000 --web.listen-address 127.0.0.1:9400
"""
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)")


def parse_duration(text: str) -> float:
    """Seconds in a Prometheus-style duration ("300ms", "2s", "1m30s") or a bare number of seconds."""
    text = text.strip()
    try:
        return float(text)
    except ValueError:
        pass
    parts = _DURATION.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (e.g. 300ms, 2s, 1m)")
    return sum(float(n) * _UNITS[u] for n, u in parts)


def parse_listen_address(text: str) -> tuple[str, int]:
    """(host, port) from "host:port", "[::1]:port" or ":port" (all interfaces)."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"not a listen address: {text!r} (e.g. 127.0.0.1:9400)")
    host = host.strip("[]")
    return host or "0.0.0.0", int(port)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Register the exporter's flags on p."""
    a = p.add_argument
    a("--vllm.url", dest="vllm_url", default="http://127.0.0.1:8000", metavar="URL",
      help="base URL of the vLLM server this sidecar sits beside (default %(default)s)")
    a("--engine", dest="engine", choices=ENGINES, default=DEFAULT_ENGINE,
      help="the inference engine at --vllm.url: its API for the probe and its /metrics names for the live fast path "
      "and the traffic counters (default %(default)s; docs/engines.md)")
    a("--web.listen-address", dest="listen", type=parse_listen_address, default="127.0.0.1:9400",
      metavar="HOST:PORT", help="where to serve /metrics (default %(default)s; ':9400' = all interfaces)")
    g = p.add_argument_group("micro-probe")
    g.add_argument("--probe.interval", dest="probe_interval", type=parse_duration, default="1s",
                   metavar="DURATION", help="time between probes, +- jitter (default %(default)s). The controller "
                   "counts each probe once, however many ticks read it (grayguard_probe_last_sent_timestamp_seconds "
                   "names it): a longer interval makes a run of slow probes take that much longer")
    g.add_argument("--probe.jitter", dest="probe_jitter", type=float, default=0.2, metavar="FRACTION",
                   help="random +- fraction of the interval, so a fleet's probes do not align (default 0.2)")
    g.add_argument("--probe.slow-threshold", dest="probe_slow", type=parse_duration, default="300ms",
                   metavar="DURATION", help="a first chunk later than this is 'slow' (default %(default)s); "
                   "the controller counts a probe slow only when this says so and it is also slower than its peers' "
                   "probes, so set it to a few times a healthy node's probe under load")
    g.add_argument("--probe.deadline", dest="probe_deadline", type=parse_duration, default="2s",
                   metavar="DURATION", help="no first chunk by then is 'timeout'; the connection is closed "
                   "(default %(default)s)")
    g.add_argument("--probe.model", dest="probe_model", metavar="NAME",
                   help="model to request (default: the first one /v1/models lists)")
    g.add_argument("--probe.prompt", dest="probe_prompt", default=ProbeConfig.prompt, metavar="TEXT",
                   help="prompt, sent behind a random prefix (default %(default)r)")
    g.add_argument("--probe.api-key-env", dest="probe_key_env", default="VLLM_API_KEY", metavar="VAR",
                   help="environment variable with the key of a vLLM run with --api-key (default %(default)s)")
    g.add_argument("--probe.api-key-file", dest="probe_key_file", metavar="PATH",
                   help="file with that key, re-read at every probe (wins over --probe.api-key-env)")
    g.add_argument("--probe.startup-grace", dest="probe_grace", type=parse_duration, default="30m",
                   metavar="DURATION", help="until vLLM is first ready (it refuses connections, /health is "
                   "not 200 or /v1/models lacks the model: a model loading), failures count as 'starting', "
                   "at most this long (default %(default)s; 0: never)")
    g.add_argument("--no-probe", dest="probe", action="store_false", help="do not probe vLLM")
    lv = p.add_argument_group("live fast path (/metrics/fast)")
    lv.add_argument("--live.window", dest="live_window", type=parse_duration, default="5s", metavar="DURATION",
                    help="W: live inter-token latency, TTFT and tokens/s are deltas of vLLM's /metrics (read at every "
                    "probe) over about this span; the probe TTFT median takes probes of the last 2 W "
                    "(default %(default)s)")
    ag = p.add_argument_group("agent check (HAProxy)")
    port = REFLEXES.agent_port  # HAProxy's agent-port in the shipped config (grayguard/reflexes.py)
    ag.add_argument("--agent.listen-address", dest="agent_listen", type=parse_listen_address,
                    default=f"127.0.0.1:{port}", metavar="HOST:PORT",
                    help=f"where HAProxy's agent check gets 'up' or 'down #why' (default %(default)s; ':{port}' = "
                    "all interfaces). HAProxy connects to the server's address (or its agent-addr) at its "
                    "agent-port: that port must match, and HAProxy must reach this address")
    ag.add_argument("--no-agent", dest="agent", action="store_false",
                    help="do not answer HAProxy's agent check (also off with --no-probe)")
    n = p.add_argument_group("NVML collector")
    n.add_argument("--no-collector.nvml", dest="nvml", action="store_false", help="do not read GPUs via NVML")
    n.add_argument("--collector.nvml.timeout", dest="nvml_timeout", type=parse_duration, default="1s",
                   metavar="DURATION", help="longest a scrape waits for NVML (default %(default)s)")
    n.add_argument("--no-collector.nvml.xid", dest="xid", action="store_false",
                   help="do not listen for XID error events")
    n.add_argument("--collector.ecc-aggregate", dest="ecc_aggregate", action="store_true",
                   help="also serve the lifetime ECC counts, grayguard_gpu_ecc_errors{counter_type=\"aggregate\"} "
                   "(default off: the volatile counts since boot are served; on Ampere and later the remapped rows "
                   "are the memory's health record, and no rule or alert reads the lifetime counts)"),
    k = p.add_argument_group("pod (rules.gpu_source: dcgm joins dcgm-exporter's GPUs to this node by it; docs/dcgm.md)")
    k.add_argument("--pod.name", dest="pod_name", default=os.environ.get(POD_ENV), metavar="NAME",
                   help=f"this pod's name, for grayguard_node_pod_info (default ${POD_ENV}: %(default)s)")
    k.add_argument("--pod.namespace", dest="pod_namespace", default=os.environ.get(NAMESPACE_ENV), metavar="NAME",
                   help=f"this pod's namespace (default ${NAMESPACE_ENV}: %(default)s); without both, no pod info")
    _add_registry_arguments(p)  # --log.level and --log.format: grayguard/cli.py gives every subcommand them


def _add_registry_arguments(p: argparse.ArgumentParser) -> None:
    r = p.add_argument_group("registry (membership in etcd; off without --registry.url)")
    a = r.add_argument
    etcdconn.add_flags(r)  # --registry.url (repeatable), TLS files, the etcd user: as the actuator's
    a("--registry.pool", dest="registry_pool", metavar="NAME", help="the pool (HAProxy backend) this node serves")
    a("--registry.node", dest="registry_node", metavar="NAME", help="this node's name (HAProxy server name)")
    a("--registry.advertise", dest="registry_advertise", metavar="HOST:PORT",
      help="vLLM's address as HAProxy should reach it, e.g. 10.0.0.13:8000")
    a("--registry.exporter-address", dest="registry_exporter", metavar="HOST:PORT",
      help="this exporter's address for the record (default: the advertised host, --web.listen-address's port)")
    a("--registry.prefix", dest="registry_prefix", default=DEFAULT_PREFIX, metavar="PREFIX",
      help="key prefix (default %(default)s)")
    a("--registry.heartbeat", dest="registry_heartbeat", type=parse_duration, default="2s", metavar="DURATION",
      help="time between lease keep-alives and between pre-check retries; until two intervals are measured the "
      "lease's TTL is 3 x max(heartbeat, --registry.timeout) + --registry.timeout, within ttl-min..ttl-max "
      "(default %(default)s)")
    a("--registry.ttl-min", dest="registry_ttl_min", type=parse_duration, default="5s", metavar="DURATION",
      help="lower bound of the adaptive lease TTL, mean + 2 stddev of the last 5 heartbeat intervals "
      "(default %(default)s)")
    a("--registry.ttl-max", dest="registry_ttl_max", type=parse_duration, default="60s", metavar="DURATION",
      help="upper bound of the adaptive TTL (default %(default)s)")
    a("--registry.leave-grace", dest="registry_leave_grace", type=parse_duration, default="1s", metavar="DURATION",
      help="on SIGTERM, how long the 'leaving' record stands before the lease is revoked (default %(default)s)")
    a("--registry.timeout", dest="registry_timeout", type=parse_duration, default="2s", metavar="DURATION",
      help="longest wait for one etcd or pre-check call (default %(default)s)")
    a("--registry.max-concurrency", dest="registry_max_concurrency", type=int, metavar="N",
      help="requests the node runs at once (vLLM --max-num-seqs), for the record (default: unknown)")


def _registry_error(args: argparse.Namespace) -> str | None:
    """The first invalid --registry.* setting, or None (also when registration is off)."""
    if not args.registry_url:
        return None
    try:
        etcdconn.settings_from_flags(args)  # the URLs, TLS files and password, loaded once
    except ConfigError as e:
        return str(e)
    if not args.registry_pool or not args.registry_node or not args.registry_advertise:
        return "--registry.url needs --registry.pool, --registry.node and --registry.advertise"
    try:
        node_key(args.registry_prefix, args.registry_pool, args.registry_node)
    except ValueError as e:
        return f"--registry.prefix, --registry.pool or --registry.node: {e}"
    for flag, value in (("advertise", args.registry_advertise), ("exporter-address", args.registry_exporter)):
        if value is not None and not _is_address(value):
            return f"--registry.{flag}: {value!r} is not host:port (e.g. 10.0.0.13:8000)"
    if not 0 < args.registry_heartbeat < args.registry_ttl_min <= args.registry_ttl_max:
        return "need 0 < --registry.heartbeat < --registry.ttl-min <= --registry.ttl-max"
    if args.registry_ttl_min < 1:
        return "--registry.ttl-min must be at least 1s (etcd leases count whole seconds)"
    if args.registry_leave_grace < 0 or args.registry_timeout <= 0:
        return "--registry.leave-grace must be >= 0 and --registry.timeout positive"
    if args.registry_max_concurrency is not None and args.registry_max_concurrency < 1:
        return "--registry.max-concurrency must be at least 1"
    return None


def _is_address(text: str) -> bool:
    host, sep, port = text.rpartition(":")
    return bool(sep and host and port.isdigit() and 1 <= int(port) <= 65535)


def registration_config(args: argparse.Namespace) -> RegistrationConfig | None:
    """The RegistrationConfig the --registry.* flags describe, None without --registry.url."""
    if not args.registry_url:
        return None
    return RegistrationConfig(
        url=args.registry_url[0], pool=args.registry_pool, node=args.registry_node, advertise=args.registry_advertise,
        etcd=etcdconn.settings_from_flags(args), exporter=args.registry_exporter, prefix=args.registry_prefix,
        heartbeat=args.registry_heartbeat, ttl_min=args.registry_ttl_min, ttl_max=args.registry_ttl_max,
        leave_grace=args.registry_leave_grace,
        timeout=args.registry_timeout, max_concurrency=args.registry_max_concurrency, model=args.probe_model,
        api_key_file=args.probe_key_file, api_key_env=args.probe_key_env or None,
        engine=getattr(args, "engine", DEFAULT_ENGINE))


def config_error(args: argparse.Namespace) -> str | None:
    """The first invalid setting, named by its flag, or None."""
    url = urlsplit(args.vllm_url)
    if url.scheme not in ("http", "https") or not url.netloc:
        return f"--vllm.url: {args.vllm_url!r} is not an http(s) URL"
    if args.probe_interval <= 0:
        return "--probe.interval must be positive"
    if not 0 <= args.probe_jitter < 1:
        return "--probe.jitter must be in [0, 1)"
    if args.probe_deadline <= 0:
        return "--probe.deadline must be positive"
    if not 0 < args.probe_slow < args.probe_deadline:
        return "--probe.slow-threshold must be positive and below --probe.deadline"
    if args.live_window <= 0:
        return "--live.window must be positive"
    if args.nvml_timeout <= 0:
        return "--collector.nvml.timeout must be positive"
    if args.agent and args.probe and _same_port(args.agent_listen, args.listen):
        return "--agent.listen-address must differ from --web.listen-address"
    return _registry_error(args)


def _same_port(a: tuple[str, int], b: tuple[str, int]) -> bool:
    """True when two listen addresses would collide (same port, same host or one of them all interfaces)."""
    anywhere = ("0.0.0.0", "::", "")
    return a[1] == b[1] != 0 and (a[0] == b[0] or a[0] in anywhere or b[0] in anywhere)


def build_exporter(args: argparse.Namespace, nvml: object = pynvml) -> Exporter:
    """The Exporter the flags describe (not started)."""
    host, port = args.listen
    probe = ProbeConfig(interval=args.probe_interval, jitter=args.probe_jitter, slow_threshold=args.probe_slow,
                        deadline=args.probe_deadline, model=args.probe_model, prompt=args.probe_prompt,
                        api_key_env=args.probe_key_env or None, api_key_file=args.probe_key_file,
                        startup_grace=args.probe_grace, live_window=args.live_window,
                        engine=getattr(args, "engine", DEFAULT_ENGINE)) if args.probe else None
    if args.agent and probe is None:
        log.info("agent check off: --no-probe (the agent answers from the probe)")
    return Exporter(args.vllm_url, host=host, port=port, nvml=nvml if args.nvml else None, probe=probe,
                    nvml_read_timeout=args.nvml_timeout, xid_events=args.xid,
                    ecc_aggregate=getattr(args, "ecc_aggregate", False),
                    agent=args.agent_listen if args.agent and probe is not None else None,
                    registration=registration_config(args),
                    pod=(getattr(args, "pod_namespace", None), getattr(args, "pod_name", None)))


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT; 2 on a bad flag, 1 when a listen address cannot be bound."""
    error = config_error(args)
    if error:
        log.error("bad configuration: %s", error)
        return 2
    exporter = build_exporter(args)
    try:
        exporter.start()
    except AgentListenError as e:
        log.error("--agent.listen-address %s:%d: cannot listen: %s", *args.agent_listen, e)
        exporter.stop()
        return 1
    except OSError as e:
        log.error("--web.listen-address %s:%d: cannot listen: %s", *args.listen, e)
        exporter.stop()
        return 1
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda signum, frame: stop.set())
                for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        while not stop.wait(1.0):
            pass
        log.info("signal received, shutting down")
    finally:
        exporter.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0
