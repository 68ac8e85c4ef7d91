# The agent's image: `docker build -t kuscale .`; the DaemonSet in deploy/kubernetes runs it.
FROM python:3.11-slim
WORKDIR /src
COPY pyproject.toml README.md ./
COPY src ./src
RUN pip install --no-cache-dir '.[nvml]' && rm -rf /src
WORKDIR /
ENTRYPOINT ["kuscale"]
