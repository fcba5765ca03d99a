"""Fixtures for the guest-side tests of bunshin.ko: the device, victim
processes, and a reference-count check after every test."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import uapi

HERE = Path(__file__).resolve().parent
KHUGEPAGED = Path("/sys/kernel/mm/transparent_hugepage/khugepaged/scan_sleep_millisecs")


@pytest.fixture(scope="session")
def dev():
    d = uapi.Device()
    assert set(held_refs().values()) == {0}, "references held before any test"
    yield d
    d.close()


def held_refs():
    return {kind: gets - puts for kind, (gets, puts) in uapi.refs().items()}


@pytest.fixture(autouse=True)
def refs_balanced():
    """No test may end holding a reference it did not start with; compared
    per test so a leak is blamed on the test that caused it."""
    before = held_refs()
    yield
    assert held_refs() == before, f"references leaked: {uapi.refs()}"


@pytest.fixture(scope="session", autouse=True)
def quiet_khugepaged():
    """khugepaged may collapse a stopped victim's pages between the kernel walk
    and the pagemap walk; keep it asleep for the session."""
    old = KHUGEPAGED.read_text()
    KHUGEPAGED.write_text("3600000")
    yield
    KHUGEPAGED.write_text(old)


class Victims:
    """A victim.py process (and its forks), killed with its family at exit."""

    def __init__(self, *args, ready=1):
        self.proc = subprocess.Popen([sys.executable, str(HERE / "victim.py"), *map(str, args)],
                                     stdout=subprocess.PIPE, start_new_session=True)
        self.pids = [self.expect("ready") for _ in range(ready)]

    def expect(self, word):
        line = self.proc.stdout.readline().decode()
        assert line.startswith(word + " "), f"victim said {line!r}, expected {word}"
        return int(line.split()[1])

    def rewrite_half(self, pids):
        for pid in pids:
            os.kill(pid, signal.SIGUSR1)
        assert sorted(self.expect("rewrote") for _ in pids) == sorted(pids)

    def stop(self):
        for pid in self.pids:
            os.kill(pid, signal.SIGSTOP)
        for pid in self.pids:
            while Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
                time.sleep(0.01)

    def cont(self):
        for pid in self.pids:
            os.kill(pid, signal.SIGCONT)

    def close(self):
        self.cont()
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            state = self.describe()
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            raise AssertionError("victims ignored SIGTERM:\n" + state) from None
        finally:
            self.proc.stdout.close()

    def describe(self):
        """State and kernel stack of each victim, for a family that hangs."""
        out = []
        for pid in self.pids:
            for name in ("status", "stack", "wchan"):
                try:
                    text = Path(f"/proc/{pid}/{name}").read_text()
                except OSError as e:
                    text = str(e)
                if name == "status":
                    text = "".join(l for l in text.splitlines(True) if l.startswith(("State", "SigBlk", "SigPnd", "ShdPnd")))
                out.append(f"{pid} {name}: {text.strip()}")
        return "\n".join(out)


@pytest.fixture
def victims():
    started = []

    def start(*args, ready=1):
        v = Victims(*args, ready=ready)
        started.append(v)
        return v
    yield start
    for v in started:
        v.close()


DENSE = Path("/sys/module/bunshin/parameters/share_dense")


@pytest.fixture(params=["dense", "xarray"])
def store(request):
    """Run a counting test with each of the module's two pfn stores (share_stats.c)."""
    old = DENSE.read_text().strip()
    DENSE.write_text("Y" if request.param == "dense" else "N")
    yield request.param
    DENSE.write_text(old)


def _errno_in(call: str, drop: str, argv: list[str]) -> int | None:
    fd = os.open(uapi.DEVICE, os.O_RDWR)  # opened by root, inherited by the child
    try:
        code = (f"import os, sys; sys.path.insert(0, {str(HERE)!r}); import uapi\n{drop}"
                f"d = uapi.Device.__new__(uapi.Device); d.fd = {fd}\n"
                f"try:\n    d.{call}\nexcept OSError as e:\n    print(e.errno)\n")
        r = subprocess.run([*argv, sys.executable, "-c", code], pass_fds=(fd,), capture_output=True,
                           text=True, timeout=60)
        out = r.stdout.strip()
        assert out.isdigit() or (not out and r.returncode == 0), r.stderr
        return int(out) if out else None
    finally:
        os.close(fd)


def errno_as_nobody(call: str) -> int | None:
    """Run ``d.<call>`` (e.g. ``"reparent(12, 34)"``) on /dev/bunshin opened by root but used
    by a process that has dropped to uid/gid 65534; the errno it got, None if it succeeded."""
    return _errno_in(call, "os.setgid(65534); os.setuid(65534)\n", [])


def errno_without_cap(call: str, cap: str) -> int | None:
    """As errno_as_nobody, from a root process without capability ``cap`` (setpriv's name,
    e.g. ``"sys_admin"``) and with every other."""
    return _errno_in(call, "", ["setpriv", "--bounding-set", f"-{cap}", "--inh-caps", f"-{cap}", "--"])
