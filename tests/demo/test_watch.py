"""grayguard.demo.watch: changes of HAProxy weights and controller states, timestamped by a fast poll."""

from types import SimpleNamespace

import pytest

from grayguard.demo.watch import Watcher


class FakeStack:
    def __init__(self):
        self.weights = {"n1": (100, False), "n2": (100, False)}
        self.controller = SimpleNamespace(states={"chat": {"n1": SimpleNamespace(state="healthy")}})
        self.fail = False

    def haproxy_weights(self):
        if self.fail:
            raise OSError("socket gone")
        return dict(self.weights)


def test_a_mark_only_when_something_changed():
    st, now = FakeStack(), [100.0]
    w = Watcher(st, t0=70.0, clock=lambda: now[0])
    first = w.poll()
    assert first == {"t": 30.0, "nodes": {"n1": {"weight": 100, "drained": False, "state": "healthy"},
                                          "n2": {"weight": 100, "drained": False}}}
    now[0] = 100.1
    assert w.poll() is None  # nothing moved
    st.weights["n1"] = (0, True)
    now[0] = 100.2
    assert w.poll()["nodes"]["n1"] == {"weight": 0, "drained": True, "state": "healthy"}
    st.controller.states["chat"]["n1"] = SimpleNamespace(state="quarantined")
    now[0] = 100.3
    assert w.poll() == {"t": 30.3, "nodes": {"n1": {"weight": 0, "drained": True, "state": "quarantined"},
                                            "n2": {"weight": 100, "drained": False}}}
    assert [m["t"] for m in w.marks] == [30.0, 30.2, 30.3]


def test_a_failed_read_is_survived_and_no_controller_is_fine():
    st = FakeStack()
    st.fail, st.controller = True, None
    w = Watcher(st, t0=0.0, clock=lambda: 1.0)
    assert w.poll() is None and w.marks == []
    st.fail = False
    assert w.poll()["nodes"]["n1"] == {"weight": 100, "drained": False}


def test_the_thread_polls_until_stopped():
    st = FakeStack()
    w = Watcher(st, t0=0.0, interval=0.01)
    w.start()
    w.stop()
    assert w._thread is not None and not w._thread.is_alive() and len(w.marks) == 1


def test_stop_is_safe_when_an_interruption_landed_inside_start(monkeypatch):
    """SIGTERM raises in the main thread, possibly inside start() before the thread runs (a fresh-clone CI run: the
    demo's clean-up then raised RuntimeError over the SIGTERM and exited 1, not 143)."""
    import threading

    def interrupted(self):
        raise KeyboardInterrupt  # grayguard.terminate.Terminated is one

    monkeypatch.setattr(threading.Thread, "start", interrupted)
    w = Watcher(FakeStack(), t0=0.0)
    with pytest.raises(KeyboardInterrupt):
        w.start()
    w.stop()  # no RuntimeError("cannot join thread before it is started")
    assert w._thread is not None and w._thread.ident is None
