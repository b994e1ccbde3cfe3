"""Swarm load harness: N light endpoints that speak the real protocol against a real hub and broker.

``mesh-sim swarm --endpoints N --transport mqtt|zmq`` (sim/cli.py). ``core``: one endpoint's
protocol state, sans-IO; ``worker``: one process holding thousands of them on real connections;
``harness``: broker, hub, bulk enrollment, the measured phases; ``stats``: pure report helpers;
``report``: the JSON files and the curves. Results: bench/results/swarm-*.json, docs/benchmarks.md.
"""
