# Each target bootstraps .venv from nothing, so a fresh clone needs only python3 >= 3.11.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv test-parts lint test e2e image demo bench sim-table bench-real fuzz soak proto clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check src tests bench fuzz deploy/image
	$(BIN)/ruff format --check src tests bench fuzz deploy/image
	$(BIN)/mypy
	@if command -v gofmt >/dev/null; then test -z "$$(gofmt -l e2e/node)" \
		|| { echo "gofmt would change:"; gofmt -l e2e/node; exit 1; }; fi

# What tests run that no pip package carries: qemu, a generic kernel and busybox for the cgroup
# v2 VM. Installed from Debian when root and missing; without them those tests skip, saying why.
# Gemini is the user's to install: its tests run where KUSCALE_GEMINI_BIN names its folder.
TEST_PACKAGES := qemu-system-x86 linux-image-amd64 busybox-static
test-parts:
	@if [ "$$(id -u)" = 0 ] && ! { command -v qemu-system-x86_64 && command -v busybox \
		&& ls /boot/vmlinuz-* | grep -v cloud; } >/dev/null 2>&1; then \
		echo "installing $(TEST_PACKAGES) from Debian for the cgroup v2 VM"; \
		{ apt-get update -q -o DPkg::Lock::Timeout=600 && DEBIAN_FRONTEND=noninteractive \
			apt-get install -y -q -o DPkg::Lock::Timeout=600 $(TEST_PACKAGES); } >/dev/null \
			|| echo "could not install them: their tests skip"; \
	fi

test: lint test-parts
	$(BIN)/pytest -q

# A real node (etcd, kube-apiserver, kube-scheduler and the kubelet built from the Kubernetes Go
# modules in e2e/node; containerd, runc and the CNI plugins from Debian) brought up, the
# end-to-end tests run on it, and everything torn down. `make test` runs them as well; without
# Go or the module proxy they skip, saying why.
e2e: $(STAMP)
	$(BIN)/pytest -q tests/e2e

# The agent's image as an OCI archive, from Debian's packages and kuscale's pinned dependencies
# (root, apt-get and dpkg-deb; no registry, no container engine), cached under a hash of its
# inputs; prints the archive's path. Load it with `ctr -n k8s.io images import`, `podman load`
# or `docker load`. With a registry, the Dockerfile builds the same content.
image: $(STAMP)
	$(BIN)/python deploy/image/build_image.py

demo: $(STAMP)
	$(BIN)/kuscale demo --duration 30 --json demo-summary.json --plot demo.png

bench: $(STAMP)
	$(BIN)/python bench/bench_tick.py

# Every shipped scenario on both GPU layers: what a binding budget is judged by, vs the bound.
sim-table: $(STAMP)
	$(BIN)/python bench/sim_table.py

# Real nginx, wrk and stress-ng on real cgroups (root; installs them from Debian if missing).
bench-real: $(STAMP)
	$(BIN)/python bench/bench_real.py --json bench-real.json

# FUZZ_INPUTS generated inputs (default 1,000,000) over every outside input kuscale reads.
FUZZ_INPUTS ?= 1000000
fuzz: $(STAMP)
	cd fuzz && FUZZ_INPUTS=$(FUZZ_INPUTS) ../$(BIN)/python run.py

# 1000 pods with churn on a fixture tree for SOAK_SECONDS (default 600) of ticks at full speed.
soak: $(STAMP)
	$(BIN)/python bench/soak.py

# The kubelet APIs' Python modules are generated from their .proto files and committed.
proto: $(STAMP)
	$(BIN)/python -m grpc_tools.protoc -I src --python_out=src --grpc_python_out=src \
		--pyi_out=src src/kuscale/deviceplugin/api.proto src/kuscale/kubernetes/podresources.proto

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache demo-summary.json demo.png
