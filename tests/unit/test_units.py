"""The systemd units and scripts/install-system.sh: what the installer lays out, that it keeps an operator's
files, that systemd accepts the installed units (``systemd-analyze verify``), that their sandbox rates OK
(``systemd-analyze security --offline``, at most 4.0), and what the instance unit's command line becomes.

Needs no running systemd: everything runs against a temporary --prefix. The checks that need
``systemd-analyze`` are skipped only where it is missing.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import socket
import stat
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
INSTALLER = REPO / "scripts" / "install-system.sh"
VENV = REPO / ".venv"
UNITS = ["llumnix-manager.service", "llumnix-proxy.service", "llumnix-instance@.service"]
# What systemd-analyze gets: the template as instances (verify and security need one).
CHECKED = ["llumnix-manager.service", "llumnix-proxy.service", "llumnix-instance@0.service", "llumnix-instance@7.service"]
MAX_EXPOSURE = 4.0  # "OK" and better in systemd-analyze security's scale (0 safest, 10 unsafe)

needs_analyze = pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")


def install(prefix: Path, venv: Path = VENV, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(INSTALLER), "--prefix", str(prefix), "--venv", str(venv), *extra],
                          capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def prefix(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("root")
    r = install(root)
    assert r.returncode == 0, r.stderr
    return root


def unit_dir(prefix: Path) -> Path:
    return prefix / "etc/systemd/system"


def settings(path: Path) -> dict[str, list[str]]:
    """KEY -> values of a unit file (comments dropped, continuation lines joined)."""
    text = re.sub(r"\\\n", " ", path.read_text())
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith(("#", ";", "[")):
            key, _, value = line.partition("=")
            out.setdefault(key, []).append(value)
    return out


def test_installer_lays_out_files(prefix):
    for unit in UNITS:
        installed = (unit_dir(prefix) / unit).read_text()
        source = (REPO / "scripts/systemd" / unit).read_text()
        assert "/opt/llumnix/.venv" not in installed
        assert installed == source.replace("/opt/llumnix/.venv/bin/", f"{VENV}/bin/"), unit
        for start in settings(unit_dir(prefix) / unit)["ExecStart"]:
            binary = re.search(r"(/\S+/bin/llumnix-[a-z]+)", start).group(1)
            assert os.access(binary, os.X_OK), binary
    assert (prefix / "usr/lib/sysusers.d/llumnix.conf").read_text() == \
        (REPO / "scripts/systemd/llumnix.sysusers.conf").read_text()
    assert (prefix / "usr/share/polkit-1/rules.d/50-llumnix.rules").is_file()
    pages = sorted(p.name for p in (REPO / "man").iterdir() if re.search(r"\.[0-9]$", p.name))
    assert pages
    for page in pages:
        assert (prefix / f"usr/share/man/man{page[-1]}" / page).read_bytes() == (REPO / "man" / page).read_bytes()
    example = (REPO / "llumnix.toml.example").read_text()
    assert (prefix / "etc/llumnix/llumnix.toml.example").read_text() == example
    assert (prefix / "etc/llumnix/llumnix.toml").read_text() == example
    default = prefix / "etc/default/llumnix"
    assert default.read_text() == (REPO / "scripts/systemd/llumnix.default").read_text()
    assert stat.S_IMODE(default.stat().st_mode) == 0o600  # it may hold HF_TOKEN
    completion = (prefix / "usr/share/bash-completion/completions/llumnixctl").read_text()
    assert "complete " in completion and "llumnixctl" in completion
    r = subprocess.run(["bash", "-n", str(prefix / "usr/share/bash-completion/completions/llumnixctl")])
    assert r.returncode == 0


def test_installer_keeps_operator_files_and_is_idempotent(prefix):
    config = prefix / "etc/llumnix/llumnix.toml"
    default = prefix / "etc/default/llumnix"
    ours_config, ours_default = config.read_text(), default.read_text()
    try:
        config.write_text("# the operator's\n[manager]\naddress = \"tcp://10.0.0.1:7100\"\n")
        default.write_text("HF_TOKEN=secret\n")
        r = install(prefix)
        assert r.returncode == 0, r.stderr
        assert config.read_text().startswith("# the operator's")
        assert default.read_text() == "HF_TOKEN=secret\n"
        lines = r.stdout.splitlines()
        assert any(line.startswith("kept") and str(config) in line for line in lines), r.stdout
        assert any(line.startswith("kept") and str(default) in line for line in lines), r.stdout
        # A second run changes nothing it installed.
        for unit in UNITS:
            assert any(line.startswith("unchanged") and line.endswith(unit) for line in lines), r.stdout
        assert not any(line.startswith(("installed", "updated")) for line in lines), r.stdout
        # Outside / it runs nothing, and says what to run on the target.
        assert "systemd-sysusers /usr/lib/sysusers.d/llumnix.conf" in r.stdout
        assert "systemctl daemon-reload" in r.stdout
    finally:
        config.write_text(ours_config)
        default.write_text(ours_default)


def test_installer_arguments(tmp_path):
    r = subprocess.run(["bash", str(INSTALLER), "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "--prefix DIR" in r.stdout and "--venv PATH" in r.stdout
    r = subprocess.run(["bash", str(INSTALLER), "--bogus"], capture_output=True, text=True)
    assert r.returncode == 2 and "unknown argument" in r.stderr
    r = install(tmp_path, Path("relative/venv"))
    assert r.returncode == 2 and "absolute" in r.stderr
    r = subprocess.run(["bash", str(INSTALLER), "--prefix", str(tmp_path), "--venv", "/opt/my venv"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and not (tmp_path / "etc").exists()


def test_units_settings():
    """What the task of each unit needs, and the hardening that would break the instance kept off it."""
    for unit in UNITS:
        s = settings(REPO / "scripts/systemd" / unit)
        for key, value in [("Type", "notify"), ("NotifyAccess", "main"), ("User", "llumnix"), ("Group", "llumnix"),
                           ("NoNewPrivileges", "yes"), ("ProtectSystem", "strict"), ("ProtectHome", "yes"),
                           ("PrivateTmp", "yes"), ("StateDirectory", "llumnix"), ("LimitNOFILE", "65536"),
                           ("EnvironmentFile", "-/etc/default/llumnix"), ("KillSignal", "SIGTERM"),
                           ("UMask", "0027"), ("SystemCallFilter", "@system-service")]:
            assert value in s.get(key, []), (unit, key)
        assert "ProcSubset" not in s, unit  # prometheus_client's process_* metrics read /proc/stat
    inst = settings(REPO / "scripts/systemd/llumnix-instance@.service")
    env = " ".join(inst["Environment"])
    assert "CUDA_VISIBLE_DEVICES=%i" in env and "CUDA_DEVICE_ORDER=PCI_BUS_ID" in env
    assert "HF_HOME=/var/cache/llumnix/huggingface" in env and "HOME=/var/lib/llumnix" in env
    assert inst["WatchdogSec"] == ["120"] and inst["TimeoutStartSec"] == ["30min"]
    for off in ("MemoryDenyWriteExecute", "PrivateDevices", "PrivateUsers"):  # JIT; the GPUs; group video
        assert off not in inst
    assert inst["DevicePolicy"] == ["closed"] and "char-nvidia* rw" in inst["DeviceAllow"]


def test_instance_command_line(prefix, tmp_path):
    """ExecStart of llumnix-instance@3 as systemd and then sh expand it: GPU 3's ports, the config, the extra
    arguments from /etc/default/llumnix."""
    unit = unit_dir(prefix) / "llumnix-instance@.service"
    (start,) = settings(unit)["ExecStart"]
    host = socket.gethostname()
    start = start.replace("%i", "3").replace("%H", host).replace("$$", "$")  # the specifiers systemd fills in
    argv = shlex.split(start)
    assert argv[:2] == ["/bin/sh", "-c"] and len(argv) == 3
    fake = tmp_path / "llumnix-instance"
    fake.write_text("#!/bin/sh\nexec python3 -c 'import json, sys; print(json.dumps(sys.argv[1:]))' \"$@\"\n")
    fake.chmod(0o755)
    script = argv[2].replace(f"{VENV}/bin/llumnix-instance", str(fake))
    env = dict(os.environ, LLUMNIX_CONFIG="/etc/llumnix/llumnix.toml",
               LLUMNIX_INSTANCE_ARGS="--set instance.backend=vllm --log-level debug")
    r = subprocess.run(["/bin/sh", "-c", script], capture_output=True, text=True, env=env, timeout=10)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == [
        "--config", "/etc/llumnix/llumnix.toml", "--id", f"{host}-3", "--request-address", "tcp://0.0.0.0:7203",
        "--metrics-port", "7303", "--set", f"instance.advertise_address=tcp://{host}:7203",
        "--set", "instance.backend=vllm", "--log-level", "debug"]


@needs_analyze
@pytest.mark.parametrize("unit", CHECKED)
def test_systemd_accepts_unit(prefix, unit):
    """``systemd-analyze verify`` on the installed file: no PID 1 needed; --man=no, since the man: links
    point at pages that are not installed on this system."""
    r = subprocess.run(["systemd-analyze", "verify", "--man=no", "--generators=no", str(unit_dir(prefix) / unit)],
                       capture_output=True, text=True, timeout=30, env=dict(os.environ, SYSTEMD_LOG_LEVEL="info"))
    output = (r.stdout + r.stderr).strip()
    assert r.returncode == 0, output
    # Unknown keys and bad values are only warnings ("...service:12: Unknown key ..."): none may appear.
    assert "llumnix" not in output, output


@needs_analyze
@pytest.mark.parametrize("unit", CHECKED)
def test_unit_sandbox_rates_ok(prefix, unit):
    r = subprocess.run(["systemd-analyze", "security", "--offline=yes", f"--threshold={int(MAX_EXPOSURE * 10)}",
                        "--no-pager", str(unit_dir(prefix) / unit)], capture_output=True, text=True, timeout=30)
    m = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", r.stdout)
    assert m, r.stdout + r.stderr
    assert float(m.group(1)) <= MAX_EXPOSURE, r.stdout
    assert r.returncode == 0, r.stdout + r.stderr  # --threshold: non-zero above it


@pytest.mark.skipif(shutil.which("systemd-sysusers") is None, reason="systemd-sysusers is not installed")
def test_sysusers_creates_the_user(prefix):
    r = subprocess.run(["systemd-sysusers", f"--root={prefix}", str(prefix / "usr/lib/sysusers.d/llumnix.conf")],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    entry = next(line for line in (prefix / "etc/passwd").read_text().splitlines() if line.startswith("llumnix:"))
    name, _, uid, gid, _, home, shell = entry.split(":")
    assert int(uid) < 1000 and home == "/var/lib/llumnix" and shell.endswith("nologin")
    assert any(line.startswith(f"llumnix:x:{gid}:") for line in (prefix / "etc/group").read_text().splitlines())


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed (to run the polkit rule)")
def test_polkit_rule_allows_only_instance_units(prefix):
    rule = prefix / "usr/share/polkit-1/rules.d/50-llumnix.rules"
    js = """
const fs = require('fs'); let rule;
global.polkit = {Result: {YES: 'yes'}, addRule: f => { rule = f; }};
eval(fs.readFileSync(process.argv[1], 'utf8'));
const ask = (user, unit, verb, id = 'org.freedesktop.systemd1.manage-units') =>
  rule({id, lookup: k => ({unit, verb})[k]}, {user}) || 'no';
console.log(JSON.stringify([
  ask('llumnix', 'llumnix-instance@3.service', 'start'), ask('llumnix', 'llumnix-instance@12.service', 'stop'),
  ask('llumnix', 'llumnix-manager.service', 'stop'), ask('llumnix', 'sshd.service', 'start'),
  ask('llumnix', 'llumnix-instance@3.service', 'enable'), ask('alice', 'llumnix-instance@3.service', 'start'),
  ask('llumnix', 'llumnix-instance@3.service', 'start', 'org.freedesktop.systemd1.manage-unit-files')]));
"""
    r = subprocess.run(["node", "-e", js, str(rule)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == ["yes", "yes", "no", "no", "no", "no", "no"]
