""".ci/with-deadline: CI's guard against a hung run. Past its deadline it prints the Python stacks
of every process in the command's tree, kills them all and exits 124; otherwise it passes the
command's exit code through."""

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

WITH_DEADLINE = Path(__file__).resolve().parent.parent / ".ci" / "with-deadline"

# a parent and its forked child, each asleep for ever in a function named after it
SLEEPERS = textwrap.dedent("""\
    import os, time

    def child_sleeps_forever():
        while True:
            time.sleep(3600)

    def parent_sleeps_forever():
        while True:
            time.sleep(3600)

    child = os.fork()
    if child == 0:
        child_sleeps_forever()
    print("pids", os.getpid(), child, flush=True)
    parent_sleeps_forever()
""")


def running(pid: int) -> bool:
    """Still a live process (a zombie has died: only its parent has not collected it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")


def session_members(sid: int) -> list[int]:
    members = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                fields = (proc / "stat").read_text().rpartition(")")[2].split()
            except OSError:
                continue
            if int(fields[3]) == sid and running(int(proc.name)):
                members.append(int(proc.name))
    return members


@pytest.mark.parametrize("stacks_by", ["py-spy", "faulthandler"])
def test_a_hung_command_is_dumped_killed_and_exits_124(stacks_by):
    # PY_SPY=none: the fallback, SIGABRT to each process, whose faulthandler prints its stacks
    env = dict(os.environ, PY_SPY="none") if stacks_by == "faulthandler" else dict(os.environ)
    env.pop("PYTHONFAULTHANDLER", None)  # the script sets it for the command
    t0 = time.monotonic()
    proc = subprocess.run([str(WITH_DEADLINE), "3", sys.executable, "-c", SLEEPERS],
                          capture_output=True, text=True, env=env, timeout=60)
    elapsed = time.monotonic() - t0
    out = proc.stdout + proc.stderr
    assert proc.returncode == 124, out
    # killed at its deadline, not before. (Not an upper bound on the time taken: dumping the stacks
    # takes what the machine's load makes it take; a command left running would hold the
    # run to its timeout above, 60 s, and fail it there.)
    assert elapsed >= 3, (elapsed, out)
    # both processes' stacks, down to the function each sleeps in
    assert "parent_sleeps_forever" in out and "child_sleeps_forever" in out, out
    if stacks_by == "faulthandler":
        assert "Fatal Python error: Aborted" in out, out
    # nothing of the command's tree is left: the parent led its own session (setsid)
    parent, child = (int(p) for p in proc.stdout.split("pids", 1)[1].split()[:2])
    assert not running(parent) and not running(child), out
    assert session_members(parent) == [], out


def test_a_command_within_its_deadline_keeps_its_exit_code():
    proc = subprocess.run([str(WITH_DEADLINE), "30", sys.executable, "-c", "import sys; sys.exit(7)"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 7, proc.stderr
    assert "with-deadline" not in proc.stderr


def test_a_command_that_leaves_a_process_behind_fails_and_the_process_is_killed():
    # the parent starts a sleeper in the background and exits 0 at once
    script = "import subprocess; p = subprocess.Popen(['sleep', '300']); print('pid', p.pid, flush=True)"
    proc = subprocess.run([str(WITH_DEADLINE), "60", sys.executable, "-c", script],
                          capture_output=True, text=True, timeout=120)
    sleeper = int(proc.stdout.split("pid", 1)[1])
    assert proc.returncode == 3, proc.stderr
    assert "left processes behind" in proc.stderr and "sleep 300" in proc.stderr
    assert not running(sleeper)


def test_a_process_that_ends_within_the_grace_is_no_leftover():
    script = "import subprocess; subprocess.Popen(['sleep', '1'])"
    proc = subprocess.run([str(WITH_DEADLINE), "60", sys.executable, "-c", script],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "with-deadline" not in proc.stderr
