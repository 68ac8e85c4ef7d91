"""Bad input on the command line and in files: one clear line and exit status 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kuscale.cli import main

KUSCALE = [sys.executable, "-m", "kuscale"]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*KUSCALE, *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        stdin=subprocess.DEVNULL,
    )


@pytest.mark.parametrize("tokens", ["abc", "0", "-5", "1.5", ""])
def test_tokens_must_be_a_positive_integer(tmp_path: Path, tokens: str) -> None:
    result = run("launch", "--state-dir", str(tmp_path), "--tokens", tokens, "--", "true")
    assert result.returncode == 2
    assert "positive integer" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("name", ["Bad_Name", "-lead", "a" * 254, "../up", "a..b", "x\n"])
def test_names_must_be_dns_subdomains(tmp_path: Path, name: str) -> None:
    result = run(
        "launch", "--state-dir", str(tmp_path), "--tokens", "10", f"--name={name}", "--", "true"
    )
    assert result.returncode == 2
    assert "DNS-1123" in result.stderr


def test_a_state_dir_that_is_a_file_is_refused(tmp_path: Path) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    result = run("launch", "--state-dir", str(not_a_dir), "--tokens", "10", "--", "true")
    assert result.returncode == 2
    assert "state dir" in result.stderr


def test_an_unknown_command_is_refused_before_any_cgroup_is_made(tmp_path: Path) -> None:
    result = run(
        "launch",
        "--state-dir",
        str(tmp_path),
        "--tokens",
        "10",
        "--name",
        "nope",
        "--",
        "no-such-command-xyz",
    )
    assert result.returncode == 2
    assert "not found" in result.stderr
    assert not (tmp_path / "pods" / "nope.json").exists()


def test_status_without_an_agent_says_how_to_start_one(tmp_path: Path) -> None:
    result = run("status", "--state-dir", str(tmp_path))
    assert result.returncode == 2
    assert "kuscale agent --local" in result.stderr


def test_a_garbled_status_file_is_an_error_not_a_traceback(tmp_path: Path) -> None:
    (tmp_path / "status.json").write_text("{not json")
    result = run("status", "--state-dir", str(tmp_path))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[agent]\nperiod = -1\n", "agent.period"),
        ("[agent]\nspeed = 3\n", "unknown key"),
        ("[resources.cpu]\nprice = 0\n", "resources.cpu.price"),
        ("[resources.gpu]\nmin = 50\nmax = 20\n", "above resources.gpu.max"),
        ("[resources.tpu]\nprice = 1\n", "resources.tpu"),
        ('[policy]\nstatic_v = "ten"\n', "policy.static_v"),
        ("not toml at all [", "not valid TOML"),
        ("[resources.cpu]\nprice = -1\n", "resources.cpu.price"),
        ("[resources.cpu]\novercommit = 0\n", "resources.cpu.overcommit"),
        ("[policy]\ngrowth = 1.0\n", "policy.growth"),
        ("[policy]\nfast_growth = 0.5\n", "policy.fast_growth"),
        ("[policy]\ndamping = 1.5\n", "policy.damping"),
        ('[agent]\npolicy = "greedy"\n', "agent.policy"),
        ('[agent]\nkernel_shares = "yes"\n', "agent.kernel_shares"),
        ('[gpu_layer]\nkind = "mig"\n', "gpu_layer.kind"),
        ("[gpu_layer]\ngpus = 0\n", "gpu_layer.gpus"),
        ('[gpu_layer]\nroot = "relative/vgpu"\n', "gpu_layer.root"),
        ('[gpu_layer]\ncontainer_dir = "/run/../etc"\n', "gpu_layer.container_dir"),
        ('[gpu_layer]\npod_manager = "10.0.0.1"\n', "gpu_layer.pod_manager"),
        ('[gpu_layer]\npod_manager = "host:99999"\n', "gpu_layer.pod_manager"),
        ('[gpu_layer]\nenv = { "BAD-NAME" = "x" }\n', "gpu_layer.env"),
        ("[gpu_layer]\nenv = { A = 1 }\n", "gpu_layer.env"),
        ('[gpu_layer]\ngemini_request = "all"\n', "gpu_layer.gemini_request"),
        ('[gpu_layer]\nusage = "dcgm"\n', "gpu_layer.usage"),
        ('[gpu_layer]\ngemini_files = ["..", "GPU-1"]\n', "gpu_layer.gemini_files"),
        ('[gpu_layer]\ngemini_files = ["a/b"]\n', "gpu_layer.gemini_files"),
        ("[gpu_layer]\ngemini_memory = -1\n", "gpu_layer.gemini_memory"),
        ('[gpu_layer]\ngemini_dir = "kubeshare"\n', "gpu_layer.gemini_dir"),
    ],
)
def test_bad_config_files_are_refused_at_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, message: str
) -> None:
    config = tmp_path / "kuscale.toml"
    config.write_text(text)
    code = main(["agent", "--local", "--state-dir", str(tmp_path / "s"), "--config", str(config)])
    assert code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("period", ["0", "-1", "nan", "inf", "soon"])
def test_bad_periods_are_refused(tmp_path: Path, period: str) -> None:
    result = run("agent", "--local", "--state-dir", str(tmp_path), "--period", period)
    assert result.returncode == 2


def test_a_bad_workload_schedule_is_refused() -> None:
    result = run("workload", "--cpu", "0:50,then:100", "--duration", "1")
    assert result.returncode == 2
    assert "SECONDS:PERCENT" in result.stderr


def test_a_command_that_needs_the_sim_extra_says_so_where_it_is_missing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The agent's image installs kuscale without `[sim]`: `kuscale sim` there must say what
    is missing, not end in a traceback."""
    for name in [m for m in sys.modules if m.split(".")[0] in ("scipy", "kuscale")]:
        if name.startswith(("scipy", "kuscale.sim", "kuscale.plotting")):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "scipy", None)
    assert main(["sim", "--scenario", "arrivals"]) == 2
    assert "pip install 'kuscale[sim]'" in capsys.readouterr().err
