"""Where the suite's time goes: after every run, its wall time and the slowest
tests, each with the machine's CPU time while it ran (a test that takes long but
leaves the cores idle is waiting, not computing).

Each phase (setup, call, teardown) is measured where it runs, an xdist worker
included, and summed per test where the reports meet. `--timings-json PATH`
also writes every test's figures.
"""

from __future__ import annotations

import json
import os
import time

import pytest

SLOWEST = 15
_CPU_KEY = "machine_cpu_s"
_started = pytest.StashKey[float]()


def machine_cpu_seconds() -> float:
    """CPU time all cores of this machine have spent busy since boot."""
    with open("/proc/stat") as stat:
        fields = [int(v) for v in stat.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle and iowait
    return (sum(fields) - idle) / os.sysconf("SC_CLK_TCK")


def pytest_addoption(parser):
    parser.addoption("--timings-json", metavar="PATH", help="write each test's wall and machine CPU seconds here")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    item.stash[_started] = machine_cpu_seconds()
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    item.stash[_started] = machine_cpu_seconds()
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item):
    item.stash[_started] = machine_cpu_seconds()
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if _started in item.stash:
        report.user_properties.append((_CPU_KEY, round(machine_cpu_seconds() - item.stash[_started], 2)))
    return report


class Tally:
    """Per test: wall seconds, machine CPU seconds, the worker that ran it."""

    def __init__(self):
        self.began = time.time()
        self.tests: dict[str, dict] = {}

    @pytest.hookimpl
    def pytest_runtest_logreport(self, report):
        entry = self.tests.setdefault(report.nodeid, {"wall_s": 0.0, "cpu_s": 0.0, "worker": ""})
        entry["wall_s"] += report.duration
        entry["cpu_s"] += dict(report.user_properties).get(_CPU_KEY, 0.0)
        node = getattr(report, "node", None)
        if node is not None:
            entry["worker"] = node.gateway.id

    @pytest.hookimpl(trylast=True)
    def pytest_terminal_summary(self, terminalreporter, config):
        wall = time.time() - self.began
        cores = os.cpu_count() or 1
        write = terminalreporter.write_line
        terminalreporter.section(f"suite time: {wall:.0f} s wall for {len(self.tests)} tests on {cores} cores")
        write(f"{SLOWEST} slowest (setup + call + teardown; cpu: the whole machine's busy CPU seconds meanwhile, of {cores} per second)")
        slowest = sorted(self.tests.items(), key=lambda kv: -kv[1]["wall_s"])[:SLOWEST]
        for nodeid, t in slowest:
            # /proc/stat counts in 10 ms ticks: a share over a shorter test is noise.
            share = f"{t['cpu_s'] / (t['wall_s'] * cores):4.0%}" if t["wall_s"] >= 1 else "   -"
            write(f"{t['wall_s']:8.1f}s wall {t['cpu_s']:8.1f}s cpu {share} {t['worker']:>4} {nodeid}")
        path = config.getoption("--timings-json")
        if path:
            with open(path, "w") as out:
                json.dump({"wall_s": round(wall, 1), "tests": self.tests}, out, indent=1)


def pytest_configure(config):
    if not hasattr(config, "workerinput"):  # on the controller (or a run without xdist) only
        config.pluginmanager.register(Tally(), "lmforge-suite-timing")
