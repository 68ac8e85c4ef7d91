"""Local mode, the embedded default: workloads on this machine, registered in a state dir."""
