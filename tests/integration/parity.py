"""Launch parity_worker.py under torchrun and read back the losses (and what ran),
one run per launch (`losses`) or many (`run_cases`). Every native-engine run also
checks the memory estimator: each rank's model-state bytes must equal, exactly,
those of the tensors it really allocated."""

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

WORKER = Path(__file__).with_name("parity_worker.py")


def check_state_bytes(result: dict) -> None:
    from lmforge.memory.states import native_states
    from lmforge.spec import JobSpec

    if all(measured is None for measured in result["states"]):
        return  # DeepSpeed: compared with its own estimators in tests/unit
    spec = JobSpec.model_validate(result["spec"])
    for rank, measured in enumerate(result["states"]):
        estimated = native_states(spec, rank)
        if spec.parallel.cpu_offload:
            assert estimated.host == sum(measured.values()), (rank, measured, estimated)
        else:
            assert {"params": estimated.params, "grads": estimated.grads, "optimizer": estimated.optimizer} == measured, (rank, spec.parallel)


def losses(tmp_path, nproc, *overrides, extra=(), describe=False):
    key = hashlib.sha1(repr((overrides, tuple(extra))).encode()).hexdigest()[:12]
    out = tmp_path / f"{nproc}-{key}.json"
    cmd = [*_torchrun(nproc), "--out", str(out)]
    for item in overrides:
        cmd += ["--set", item]
    _launch(cmd + list(extra), timeout_s=180)
    result = json.loads(out.read_text())
    check_state_bytes(result)
    return (result["losses"], result["engine"]) if describe else result["losses"]


def run_cases(tmp_path, nproc, cases: dict[str, dict]) -> dict[str, dict]:
    """Several runs in one torchrun launch (the start-up of torch in every rank is
    most of a tiny run's time): {name: {"overrides": [...], "save": ..., "load": ...}}
    -> {name: result}, each state-checked. A failing case fails the launch."""
    listed = [case | {"out": str(tmp_path / f"{name}.json")} for name, case in cases.items()]
    path = tmp_path / f"cases-{nproc}.json"
    path.write_text(json.dumps(listed))
    _launch([*_torchrun(nproc), "--cases", str(path)], timeout_s=120 + 60 * len(cases))
    results = {name: json.loads(Path(case["out"]).read_text()) for name, case in zip(cases, listed)}
    for result in results.values():
        check_state_bytes(result)
    return results


def _torchrun(nproc: int) -> list[str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port", str(port), str(WORKER)]


def _launch(cmd: list[str], timeout_s: float) -> None:
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and every rank it started
        raise
    assert proc.returncode == 0, stderr[-3000:]
