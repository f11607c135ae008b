"""A run directory's record of a local cluster: ``cluster.json``, its processes (by pid and start time) and
where it is by default. What the operator commands read to find a local cluster's manager and keys; starting
and stopping such a cluster is the lab's (llumnixctl/lab/localcluster.py)."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

STATE_FILE = "cluster.json"


def default_run_dir() -> Path:
    env = os.environ.get("LLUMNIX_RUN_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "llumnix"


def boot_start(pid: int) -> float | None:
    """When process ``pid`` started, in seconds since boot (Linux), or None. Unlike psutil's create_time,
    which adds the boot time as the wall clock now puts it, it does not move when the clock is set (a virtual
    machine's clock is stepped after its host paused it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        return int(stat[stat.rfind(")") + 2:].split()[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


@dataclass
class Proc:
    name: str
    pid: int
    create_time: float
    log: str
    argv: list[str]
    started: float = 0.0  # boot_start(pid) when known (0: compare create_time)

    def process(self) -> psutil.Process | None:
        """The live process, only if it is still the one we started."""
        try:
            p = psutil.Process(self.pid)
            started = boot_start(self.pid) if self.started else None
            same = (abs(started - self.started) < 0.05 if started is not None
                    else abs(p.create_time() - self.create_time) < 0.01)
            if same and p.status() != psutil.STATUS_ZOMBIE:
                return p
        except psutil.Error:
            pass
        return None


@dataclass
class ClusterState:
    manager_address: str
    url: str
    backend: str
    config: str | None
    procs: list[Proc] = field(default_factory=list)
    args: list[str] = field(default_factory=list)  # the settings every daemon of this cluster got
    run_dir: str | None = None  # where its cluster.json is (set by up and load; not saved)
    urls: list[str] = field(default_factory=list)  # every proxy's URL, the first one's (= url) first

    def __post_init__(self) -> None:
        if not self.urls:  # a state file from before several proxies: its one proxy
            self.urls = [self.url]

    def save(self, run_dir: Path) -> None:
        data = asdict(self)
        del data["run_dir"]
        tmp = run_dir / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(data, indent=2))
        tmp.replace(run_dir / STATE_FILE)

    @classmethod
    def load(cls, run_dir: Path) -> "ClusterState | None":
        path = run_dir / STATE_FILE
        if not path.exists():
            return None
        data = json.loads(path.read_text())
        data["procs"] = [Proc(**p) for p in data["procs"]]
        data["run_dir"] = str(run_dir)
        return cls(**data)

    def live(self) -> list[Proc]:
        return [p for p in self.procs if p.process() is not None]
