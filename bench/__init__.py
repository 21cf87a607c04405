"""The virtual-time benchmark: scenario engine, HAProxy balancer models, policies, suites, `grayguard bench`."""
