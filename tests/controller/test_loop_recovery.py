import json
import urllib.request

import responses

from grayguard.controller.haproxy import RuntimeClient
from tests.support.ctl_helpers import make_controller, prom_answers, servers, tick_settled

ADDRS = [f"127.0.0.1:{9100 + i}" for i in range(4)]


def test_quarantine_canary_slow_start_and_back_through_real_haproxy(haproxy_factory):
    hap = haproxy_factory({"vllm_chat": servers(4)})
    t = [1000.0]
    sick = [True]
    calls = []

    def canary(url):  # TTFT: the sick node answers 6x slower than its peers
        calls.append(url)
        return 0.6 if url.endswith(":9100") and sick[0] else 0.1

    ctl = make_controller([hap.endpoint], clock=lambda: t[0], canary=canary,
                          extra={"recovery": {"min_quarantine_s": 10, "canary_interval_s": 10,
                                              "slow_start_initial": 0.1, "slow_start_step_per_min": 0.6}})
    c = RuntimeClient(hap.endpoint)
    seen = []

    def step(lat0):
        lat = {a: 0.02 for a in ADDRS}
        if lat0 is not None:
            lat[ADDRS[0]] = lat0
        else:
            del lat[ADDRS[0]]  # drained: no traffic, no series
        with responses.RequestsMock() as rsps:
            prom_answers(rsps, lat, now=t[0])
            tick_settled(ctl)  # the canaries it started have answered before the next tick, as a fleet's do
        s = ctl.states["chat"]["node0"]
        w = {x.name: (x.weight, x.drain) for x in c.show_servers_state("vllm_chat")}["node0"]
        seen.append((s.state, w))
        t[0] += 5

    for _ in range(3):
        step(0.12)
    assert seen[-1] == ("quarantined", (0, True))
    for _ in range(6):  # drained: canaries go to the node and to reference peers; it is still slow
        step(None)
    assert seen[-1][0] == "canary" and any(u.endswith(":9100") for u in calls)
    assert len({u for u in calls if not u.endswith(":9100")}) >= 1  # reference canaries to peers
    sick[0] = False
    for _ in range(8):
        step(None if seen[-1][0] == "canary" else 0.02)
    states = [s for s, _ in seen]
    assert "slow_start" in states
    ss = [w for s, w in seen if s == "slow_start"]
    assert ss[0] == (10, False)  # 10 % of base, back to ready
    for _ in range(20):
        step(0.02)
    assert seen[-1] == ("healthy", (100, False))
    # /status tells the story
    from grayguard.controller.httpserver import serve
    srv = serve("127.0.0.1:0", ctl.metrics.registry, ctl.status)
    try:
        port = srv.server_address[1]
        doc = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=5))
        node0 = next(n for n in doc["pools"][0]["nodes"] if n["node"] == "node0")
        assert node0["state"] == "healthy" and node0["weight"] == 100
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert ('grayguard_node_transitions_total{from_state="canary",node="node0",pool="chat",'
                'to_state="slow_start"} 1.0') in metrics
        assert 'grayguard_canaries_total{node="node0",pool="chat",result="measured"}' in metrics
    finally:
        srv.shutdown()
