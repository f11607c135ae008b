"""The operator commands stand apart from the lab: llumnixctl's main, admin, operate and common modules load
no module of llumnixctl/lab or llumnixctl/experiments (those commands are added when asked for), and the man
page generator reads llumnixctl through its Typer app object only."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAB = ("llumnixctl.lab", "llumnixctl.experiments")


def _loaded_after(code: str) -> list[str]:
    probe = f"import sys\n{code}\nprint(' '.join(m for m in sys.modules if m.startswith({LAB!r})))"
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert res.returncode == 0, res.stderr
    return res.stdout.split()


def test_operator_modules_load_no_lab_module():
    assert _loaded_after("import llumnixctl.main, llumnixctl.admin, llumnixctl.operate, llumnixctl.common") == []


def test_an_operator_command_runs_without_the_lab_and_a_lab_command_loads_it():
    run = ("from typer.testing import CliRunner\nfrom llumnixctl.main import app\n"
           "res = CliRunner().invoke(app, [{}], prog_name='llumnixctl')\nassert res.exit_code == 0, res.output")
    assert _loaded_after(run.format("'status', '--help'")) == []
    assert "llumnixctl.experiments.bench.cli" in _loaded_after(run.format("'bench', '--help'"))


def test_the_man_page_generator_takes_only_the_app_object_from_main():
    tree = ast.parse((ROOT / "llumnixctl/lab/manpages.py").read_text())
    taken = [(node.module, alias.name) for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
             for alias in node.names if node.module and node.module.startswith("llumnixctl.main")]
    assert taken == [("llumnixctl.main", "app")], taken
    assert not any(isinstance(node, ast.Import) and any(a.name == "llumnixctl.main" for a in node.names)
                   for node in ast.walk(tree))


def test_the_manager_proxy_and_operator_cli_load_no_torch():
    """Only instances hold KV: the manager (restarted in seconds on failover), the proxies and llumnixctl start
    without torch (it took the manager from 46 to 238 MB of RSS and ~1.2 s more per start when a spec parser
    pulled it in)."""
    probe = ("import sys\nimport daemons.manager.daemon, daemons.proxy.app, llumnixctl.main, llumnixctl.operate\n"
             "print(' '.join(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'vllm'))))")
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == []


def test_a_daemons_version_is_answered_without_loading_the_daemon():
    """``llumnix-instance --version`` prints at once: neither torch nor the daemon's modules are imported."""
    probe = ("import sys\nsys.argv = ['llumnix-instance', '--version']\nfrom daemons import cli\ncli.instance()\n"
             "print('loaded:', ' '.join(m for m in ('torch', 'daemons.instance.daemon') if m in sys.modules))")
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0].startswith("llumnix-instance ") and lines[1].strip() == "loaded:"
