"""A model whose states are 8x the memory a process may use trains under a cgroup v1 cap."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tiertrain.models import param_count

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from cgroup_child import config  # noqa: E402

CAP = 896 << 20
LAYERS = 68
STATE_BYTES_PER_PARAM = 16  # params, grads, exp_avg, exp_avg_sq (fp32 master = params here)


@pytest.fixture
def memory_cgroup():
    root = Path("/sys/fs/cgroup/memory")
    if not (root / "cgroup.procs").exists() or not os.access(root, os.W_OK):
        pytest.skip("the cgroup v1 memory controller is not writable here (needs root)")
    group = root / f"tiertrain-test-{os.getpid()}"
    try:
        group.mkdir()
        (group / "memory.limit_in_bytes").write_text(str(CAP))
    except OSError as exc:
        pytest.skip(f"cannot create a memory cgroup: {exc}")
    yield group
    group.rmdir()


def test_model_states_8x_the_memory_cap_train_with_optimizer_states_on_disk(tmp_path, memory_cgroup):
    states = param_count(config(LAYERS)) * STATE_BYTES_PER_PARAM
    assert states >= 8 * CAP
    if shutil.disk_usage(tmp_path).free < 9 << 30:
        pytest.skip("needs 9 GiB of free disk for the disk tier")
    cmd = f'echo $$ > {memory_cgroup}/cgroup.procs && exec "{sys.executable}" "{HERE / "cgroup_child.py"}" ' \
          f'"{tmp_path / "disk"}" {LAYERS}'
    r = subprocess.run(["sh", "-c", cmd], capture_output=True, text=True, timeout=540)
    assert r.returncode == 0, f"exit {r.returncode} (-9: killed for memory)\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(result["losses"]) == 2 and result["losses"][1] < result["losses"][0]
    assert int((memory_cgroup / "memory.max_usage_in_bytes").read_text()) <= CAP
    assert result["peaks"]["disk"] >= 0.7 * states  # master and moments really lived on disk
    assert not list((tmp_path / "disk").iterdir())  # and the disk tier cleaned up after itself
