"""The whole system on one machine, for the demo, the tests and the benchmarks: one supervisor for local
processes, and launchers for haproxy, Prometheus, Alertmanager, the webhook pager and the simulated fleet."""
