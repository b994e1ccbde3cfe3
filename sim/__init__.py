"""Network-outage simulator: discrete-event scale simulation (``sim.des``) and real-process fault emulation."""
