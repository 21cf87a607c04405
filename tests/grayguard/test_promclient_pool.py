"""The Prometheus client's connection pool holds a whole tick's concurrent queries."""

from grayguard.config import PrometheusConfig
from grayguard.controller.decide import OPTIONAL
from grayguard.promclient import POOL_CONNECTIONS, PrometheusClient


def test_the_pool_holds_every_query_a_tick_sends_at_once():
    c = PrometheusClient(PrometheusConfig(url="http://127.0.0.1:9090"))
    adapter = c.session.get_adapter("http://127.0.0.1:9090/api/v1/query")
    assert adapter._pool_maxsize == POOL_CONNECTIONS >= len(OPTIONAL) + 2  # + latency and rate
