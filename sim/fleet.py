"""A fleet of simulated vLLM nodes in one asyncio loop, with scheduled faults; `FleetThread` runs it
in a background thread for synchronous callers (the demo, tests)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from grayguard.sim.faults import Fault, FaultError, ScheduledFault, make_fault
from grayguard.sim.model import SPEED_CLASSES, ModelParams
from grayguard.sim.node import DEFAULT_MODEL, FaultCallback, SimNode

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class NodeInfo:
    """Where a started node listens."""

    name: str
    host: str
    port: int
    speed_class: str

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def address(self) -> str:
        """host:port, the form an HAProxy server line and a Prometheus target use."""
        return f"{self.host}:{self.port}"

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "host": self.host, "port": self.port, "url": self.url,
                "speed_class": self.speed_class}


def resolve_speed_classes(n: int, names: Sequence[str],
                          speed_classes: str | Sequence[str] | Mapping[str, str] | None) -> list[str]:
    """One class per node from: None (all h100), a class, a list (cycled), or {node: class}."""
    if speed_classes is None:
        out = ["h100"] * n
    elif isinstance(speed_classes, str):
        out = [speed_classes] * n
    elif isinstance(speed_classes, Mapping):
        unknown = set(speed_classes) - set(names)
        if unknown:
            raise ValueError(f"speed_classes names unknown nodes: {sorted(unknown)}")
        out = [speed_classes.get(name, "h100") for name in names]
    else:
        if not speed_classes:
            raise ValueError("speed_classes is empty")
        out = [speed_classes[i % len(speed_classes)] for i in range(n)]
    for c in out:
        if c not in SPEED_CLASSES:
            raise ValueError(f"unknown speed class {c!r}; known: {', '.join(SPEED_CLASSES)}")
    return out


class Fleet:
    """N simulated vLLM nodes named node1..nodeN, each on its own port and metrics registry."""

    def __init__(self, n: int = 8, *, seed: int = 0, host: str = "127.0.0.1", base_port: int = 0,
                 speed_classes: str | Sequence[str] | Mapping[str, str] | None = None,
                 params: ModelParams | None = None, model_name: str = DEFAULT_MODEL,
                 schedule: Iterable[ScheduledFault | Mapping[str, Any]] = (),
                 on_fault_change: FaultCallback | None = None, names: Sequence[str] | None = None) -> None:
        if n < 1:
            raise ValueError("a fleet needs at least one node")
        names = list(names) if names is not None else [f"node{i + 1}" for i in range(n)]
        if len(names) != n or len(set(names)) != n:
            raise ValueError("names must be n distinct names")
        classes = resolve_speed_classes(n, names, speed_classes)
        self.host, self.base_port = host, base_port
        self.on_fault_change = on_fault_change
        self.nodes: dict[str, SimNode] = {
            name: SimNode(name, params=params, speed=SPEED_CLASSES[cls], speed_class=cls,
                          seed=seed * 1000 + i, model_name=model_name, on_fault_change=self._fault_changed)
            for i, (name, cls) in enumerate(zip(names, classes, strict=True))}
        self.schedule = [s if isinstance(s, ScheduledFault) else ScheduledFault.from_dict(s) for s in schedule]
        for item in self.schedule:
            if item.node not in self.nodes:
                raise FaultError(f"scheduled fault names unknown node {item.node!r}")
        self._timers: list[asyncio.TimerHandle] = []
        self.started_at: float | None = None  # loop time of start(); scheduled at_s counts from here

    def _fault_changed(self, node: str, fault: Fault | None) -> None:
        if self.on_fault_change is not None:
            self.on_fault_change(node, fault)

    def info(self) -> list[NodeInfo]:
        """The nodes and where they listen (ports are known after start)."""
        return [NodeInfo(n.name, n.host, n.port, n.speed_class) for n in self.nodes.values()]

    async def start(self) -> list[NodeInfo]:
        """Bind every node (base_port + i, or free ports when base_port is 0) and arm the schedule."""
        loop = asyncio.get_running_loop()
        try:
            for i, node in enumerate(self.nodes.values()):
                await node.start(self.host, self.base_port + i if self.base_port else 0)
        except BaseException:
            await self.stop()
            raise
        self.started_at = loop.time()
        for item in self.schedule:
            self._timers.append(loop.call_at(self.started_at + item.at_s, self._apply, item, True))
            if item.until_s is not None:
                self._timers.append(loop.call_at(self.started_at + item.until_s, self._apply, item, False))
        return self.info()

    def _apply(self, item: ScheduledFault, begin: bool) -> None:
        node = self.nodes[item.node]
        if begin:
            node.set_fault(item.fault, **item.params)
        elif node.faults.active is not None and node.faults.active.name == item.fault:
            node.clear_fault()  # only if this fault is still the one active

    async def stop(self) -> None:
        """Cancel the schedule, end open requests and close every listener."""
        for t in self._timers:
            t.cancel()
        self._timers.clear()
        await asyncio.gather(*(node.stop() for node in self.nodes.values()))

    def node(self, name: str) -> SimNode:
        """A node by name (KeyError names the known ones)."""
        try:
            return self.nodes[name]
        except KeyError:
            raise KeyError(f"no node {name!r}; nodes: {', '.join(self.nodes)}") from None

    def set_fault(self, node: str, fault: str, **params: Any) -> Fault:
        """Activate `fault` on `node` now; call from the fleet's loop (FleetThread does that for you)."""
        return self.node(node).set_fault(fault, **params)

    def clear_fault(self, node: str) -> Fault | None:
        """Clear `node`'s fault now; call from the fleet's loop."""
        return self.node(node).clear_fault()

    def fault_status(self) -> dict[str, dict[str, Any]]:
        """Every node's fault state (see SimNode.fault_status)."""
        return {name: node.fault_status() for name, node in self.nodes.items()}


class FleetThread:
    """Runs a Fleet in a daemon thread with its own event loop; every method is thread-safe.

    `loop` is exposed so that more coroutines (e.g. the load generator) can share it:
    `ft.run(run_load(cfg))`.
    """

    def __init__(self, fleet: Fleet | None = None, **fleet_kwargs: Any) -> None:
        self.fleet = fleet if fleet is not None else Fleet(**fleet_kwargs)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._main, name="grayguard-fleet", daemon=True)
        self._nodes: list[NodeInfo] = []

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def start(self, timeout: float = 10.0) -> list[NodeInfo]:
        """Start the thread and the fleet; returns the nodes."""
        self._thread.start()
        try:
            self._nodes = self.run(self.fleet.start(), timeout)
        except BaseException:
            self._shutdown()
            raise
        return self._nodes

    def run(self, coro: Any, timeout: float | None = None) -> Any:
        """Run a coroutine in the fleet's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def submit(self, coro: Any) -> concurrent.futures.Future:
        """Schedule a coroutine in the fleet's loop without waiting."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, fn: Callable[..., T], *args: Any, timeout: float = 10.0, **kwargs: Any) -> T:
        """Call a plain function inside the fleet's loop and return its result."""
        async def _call() -> T:
            return fn(*args, **kwargs)
        return self.run(_call(), timeout)

    def set_fault(self, node: str, fault: str, **params: Any) -> Fault:
        """Thread-safe Fleet.set_fault."""
        make_fault(fault, params)  # validate here so the caller's thread sees the FaultError
        return self.call(self.fleet.set_fault, node, fault, **params)

    def clear_fault(self, node: str) -> Fault | None:
        """Thread-safe Fleet.clear_fault."""
        return self.call(self.fleet.clear_fault, node)

    def fault_status(self) -> dict[str, dict[str, Any]]:
        """Thread-safe Fleet.fault_status."""
        return self.call(self.fleet.fault_status)

    @property
    def nodes(self) -> list[NodeInfo]:
        return self._nodes

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the fleet, the loop and the thread (idempotent)."""
        if self._thread.is_alive() and not self.loop.is_closed():
            try:
                self.run(self.fleet.stop(), timeout)
            except Exception:
                log.exception("fleet stop failed")
        self._shutdown()

    def _shutdown(self) -> None:
        if self.loop.is_closed():
            return
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(5.0)
        if not self._thread.is_alive():
            self.loop.close()

    def __enter__(self) -> FleetThread:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
