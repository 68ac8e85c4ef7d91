"""The Kubernetes side of the agent. Only the kubelet's well-known paths live here, so the
CLI can name them as defaults without importing gRPC or the Kubernetes client."""

from pathlib import Path

DEVICE_PLUGIN_DIR = Path("/var/lib/kubelet/device-plugins")
POD_RESOURCES_SOCKET = Path("/var/lib/kubelet/pod-resources/kubelet.sock")
