"""How a pod's CPU limit reaches the kernel: written to its cgroups directly (`cgroup`, the
fast path), or asked of Kubernetes as an in-place resize (`resize`, slower but visible in
the pod's spec). The monitor drives either through `CpuActuator`."""
