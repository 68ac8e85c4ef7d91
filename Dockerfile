# The agent's image, for operators with a registry and a container engine:
#   docker build -t REGISTRY/kuscale:0.1.0 . && docker push REGISTRY/kuscale:0.1.0
# The same content as `make image` (which needs neither and is what the tests run): Debian
# bookworm's Python 3.11 and libstdc++, kuscale with the agent's pinned dependencies and the
# NVML extra (no `[sim]`: no scipy, no matplotlib), the agent's modules compiled to bytecode.
FROM debian:bookworm-slim AS build
RUN apt-get update && apt-get install -y --no-install-recommends python3-pip \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md ./
COPY src ./src
RUN pip install --break-system-packages --no-cache-dir --no-compile \
        --target /opt/kuscale/lib '.[nvml]' \
    && rm -rf /opt/kuscale/lib/bin

FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends \
        python3.11-minimal libpython3.11-stdlib libstdc++6 \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/kuscale /opt/kuscale
COPY deploy/image/kuscale /usr/local/bin/kuscale
COPY deploy/image/compile_imported.py /tmp/
ENV PATH=/usr/local/bin:/usr/bin:/bin PYTHONPATH=/opt/kuscale/lib PYTHONDONTWRITEBYTECODE=1 \
    MALLOC_ARENA_MAX=2
RUN python3.11 /tmp/compile_imported.py && rm /tmp/compile_imported.py \
    && kuscale --help > /dev/null
ENTRYPOINT ["/usr/local/bin/kuscale"]
