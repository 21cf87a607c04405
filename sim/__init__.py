"""Simulated vLLM fleet with gray-failure injection, and an open-loop load generator (docs/simulator.md)."""
