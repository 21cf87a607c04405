"""Loaded by every process of a real-fleet vLLM (this folder is first on its PYTHONPATH; localstack/vllmfleet.py).

vLLM's shared-memory message queue (vllm/distributed/device_communicators/shm_broadcast.py, SpinCondition) keeps
its reader busy-looping for 1 s after every message before it sleeps on a socket. On a GPU that costs one host core
a node; on this CPU build it is the same core the model runs on: one probe a second kept half a core busy per node,
and an idle 4-node fleet ran a 2-core machine at 100 %. GRAYGUARD_VLLM_BUSY_LOOP_S (default 0.005) shortens the
spin; per-token latency is unchanged (docs/simulator.md, "The real fleet"). Nothing is changed when the module
or the class is not where this vLLM version keeps it: the fleet then runs hotter, and says so in its log.
"""

import importlib.abc
import importlib.util
import os
import sys

_TARGET = "vllm.distributed.device_communicators.shm_broadcast"


def _patch(module) -> None:
    cls = getattr(module, "SpinCondition", None)
    init = getattr(cls, "__init__", None)
    if init is None or getattr(init, "_grayguard", False):
        print(f"grayguard: {_TARGET}.SpinCondition not found: the busy loop is vLLM's own", file=sys.stderr)
        return
    spin_s = float(os.environ.get("GRAYGUARD_VLLM_BUSY_LOOP_S", "0.005"))

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if getattr(self, "is_reader", False):
            self.busy_loop_s = min(self.busy_loop_s, spin_s)

    __init__._grayguard = True
    cls.__init__ = __init__


class _Finder(importlib.abc.MetaPathFinder):
    """Patches the module right after it is executed, whoever imports it first."""

    def find_spec(self, name, path, target=None):
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _Finder())
