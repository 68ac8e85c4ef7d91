"""A GPU emulator: one shared GPU, time-sliced between clients, serving the vGPU layout."""
