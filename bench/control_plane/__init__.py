"""Control-plane latency benchmark (policies, snapshot, routing, multicast planner)."""
