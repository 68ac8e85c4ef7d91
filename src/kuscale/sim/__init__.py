"""A simulated node behind the same backend interfaces as the kernel and the GPU layer."""
