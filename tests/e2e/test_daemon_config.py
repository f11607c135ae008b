"""Each daemon refuses a bad config file at start with one line that names the key and the file (the
loading itself: tests/unit/test_config.py)."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("module", ["daemons.manager", "daemons.instance", "daemons.proxy.app"])
def test_daemon_refuses_bad_config_with_one_line(tmp_path, module):
    p = tmp_path / "bad.toml"
    p.write_text("[proxy]\nprot = 1\n")
    res = subprocess.run([sys.executable, "-m", module, "--config", str(p)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2
    assert "unknown key proxy.prot" in res.stderr and str(p) in res.stderr
    assert "Traceback" not in res.stderr
