"""Layer rules that import-linter cannot see (it counts imports inside functions too):
the job file, the controller, the CLI and the judge start without torch, so `lmforge --help`,
a spec check and a replacement controller take a second, not four."""

import subprocess
import sys

import pytest

LIGHT = ["lmforge.spec", "lmforge.cluster.controller", "lmforge.cli", "lmforge.models.model_dir", "lmforge.jobs", "lmforge.evaluation.judge"]


@pytest.mark.parametrize("module", LIGHT)
def test_importing_loads_no_torch(module):
    code = f"import sys, {module}; heavy = sorted(m for m in ('torch', 'deepspeed', 'transformers') if m in sys.modules); print(','.join(heavy))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "", f"{module} imports {result.stdout.strip()}"
