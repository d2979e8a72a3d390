"""Escape tests for the Python sandbox: each one does what untrusted code would try, and
where it matters a control shows the same attempt succeeds outside the sandbox, so a
missing protection fails the test. docs/sandbox.md maps each claim to its test."""

import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from rlserve.environment import sandbox
from rlserve.environment.sandbox import (
    MiB,
    SandboxLimits,
    SandboxResult,
    SandboxUnavailable,
    run_python,
    sandbox_available,
)

needs_isolation = pytest.mark.skipif(
    sandbox_available() is not None, reason=f"no isolation here: {sandbox_available()}"
)

FAST = SandboxLimits(cpu_s=2, wall_s=5)
REPO = Path(__file__).resolve().parents[3]

# Tries to read each path named on stdin; says READ or the error it got.
READ_PROBE = """
import sys
for path in sys.stdin.read().split():
    try:
        with open(path, "rb") as file:
            file.read(16)
        print(path, "READ")
    except OSError as error:
        print(path, "BLOCKED", type(error).__name__)
"""

# Connects to the "FAMILY address" on stdin; prints CONNECTED or the error.
CONNECT_PROBE = """
import ast, socket, sys
family, address = sys.stdin.read().split(" ", 1)
client = socket.socket(getattr(socket, family))
client.settimeout(2)
try:
    client.connect(ast.literal_eval(address))
    print("CONNECTED")
except OSError as error:
    print("BLOCKED", type(error).__name__, error.errno)
"""


def run(code: str, limits: SandboxLimits = FAST, stdin: str = "", **options) -> SandboxResult:
    return asyncio.run(run_python(code, limits, stdin, **options))


def run_outside(code: str, stdin: str = "") -> str:
    """The control: the same code as a plain child of the test, with the host's view."""
    done = subprocess.run(
        [sys.executable, "-I", "-S", "-c", code], input=stdin, capture_output=True, text=True
    )
    return done.stdout


def without_isolation(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sandbox, "sandbox_available", lambda: "simulated: no namespaces")


def processes_of(uid: int) -> list[int]:
    """PIDs of live processes whose real uid is `uid` (psutil when installed, else /proc)."""
    try:
        import psutil
    except ImportError:
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                status = Path(f"/proc/{pid}/status").read_text()
            except OSError:
                continue  # exited meanwhile
            uids = next(line for line in status.splitlines() if line.startswith("Uid:"))
            if int(uids.split()[1]) == uid:
                found.append(int(pid))
        return found
    return [p.pid for p in psutil.process_iter(["uids"]) if p.info["uids"].real == uid]


def assert_all_gone(uid: int) -> None:
    """No process of `uid` is left. SIGKILL is asynchronous: the kernel may take a few
    milliseconds to finish off the processes of a namespace whose PID 1 was killed."""
    deadline = time.monotonic() + 2
    while processes_of(uid) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert processes_of(uid) == []


@needs_isolation
def test_prints_reads_stdin_and_exits_zero():
    result = run("import sys\nprint('hello', sum(map(int, sys.stdin.read().split())))", stdin="3 4")
    assert result.exit_code == 0, result.stderr
    assert (result.stdout, result.stderr) == ("hello 7\n", "")
    assert result.isolated and result.killed_by is None
    assert not result.timed_out and not result.truncated


@needs_isolation
def test_an_exception_gives_a_nonzero_exit_and_the_traceback():
    result = run("x = 1\nprint(x / 0)")
    assert result.exit_code == 1 and result.killed_by is None
    assert 'File "/code.py", line 2' in result.stderr
    assert "ZeroDivisionError: division by zero" in result.stderr


FORK_BOMB = """
import os, time
print(os.getuid(), flush=True)
refused = False
while True:
    try:
        if os.fork() == 0:
            os.setsid()  # leave the process group, as a daemon would
    except OSError:
        if not refused:
            print("fork refused", flush=True)
            refused = True
        time.sleep(0.01)
"""

MULTIPROCESSING_BOMB = """
import multiprocessing, os, time

def bomb():
    while True:
        try:
            multiprocessing.Process(target=bomb).start()
        except OSError:
            print("fork refused", flush=True)
            time.sleep(0.05)

if __name__ == "__main__":
    print(os.getuid(), flush=True)
    multiprocessing.set_start_method("fork")
    bomb()
"""


@needs_isolation
@pytest.mark.parametrize("code", [FORK_BOMB, MULTIPROCESSING_BOMB], ids=["fork", "multiprocessing"])
def test_a_fork_bomb_is_contained_and_leaves_no_process(code):
    limits = SandboxLimits(cpu_s=5, wall_s=2, processes=16)
    result = run(code, limits)
    assert result.killed_by == "wall_s" and result.timed_out
    assert result.wall_s < limits.wall_s + 2
    uid = int(result.stdout.split()[0])
    assert uid != 0 and "fork refused" in result.stdout  # RLIMIT_NPROC stopped it
    assert_all_gone(uid)


@needs_isolation
def test_an_infinite_loop_hits_the_cpu_limit():
    result = run("while True:\n    pass", SandboxLimits(cpu_s=1, wall_s=20))
    assert result.killed_by == "cpu_s" and result.exit_code is None and not result.timed_out
    # cpu_s is the kernel's sampled user + system time: a tick short of the limit at most.
    assert result.cpu_s > 0.9


@needs_isolation
def test_code_that_ignores_sigxcpu_is_killed_a_second_later():
    code = "import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True:\n    pass"
    result = run(code, SandboxLimits(cpu_s=1, wall_s=20))
    assert result.killed_by == "cpu_s" and result.cpu_s > 1.9


@needs_isolation
def test_sleeping_forever_hits_the_wall_timeout_and_keeps_earlier_output():
    limits = SandboxLimits(wall_s=1)
    result = run("import time\nprint('started', flush=True)\ntime.sleep(60)", limits)
    assert result.timed_out and result.killed_by == "wall_s" and result.exit_code is None
    assert result.stdout == "started\n"
    assert result.wall_s < limits.wall_s + 2


@needs_isolation
def test_allocating_2_gib_fails_under_the_memory_limit():
    result = run("buffer = bytearray(2 * 2**30)", SandboxLimits(memory_bytes=512 * MiB))
    assert result.exit_code == 1 and "MemoryError" in result.stderr
    # A mapping reserves address space without touching memory, so the control is cheap:
    # refused under the limit, granted under a larger one.
    code = "import mmap\nmmap.mmap(-1, 2 * 2**30)\nprint('mapped')"
    result = run(code, SandboxLimits(memory_bytes=512 * MiB))
    assert result.exit_code == 1 and "Cannot allocate memory" in result.stderr
    assert run(code, SandboxLimits(memory_bytes=3 * 2**30)).stdout == "mapped\n"


@needs_isolation
def test_huge_output_is_truncated_at_the_cap_and_returns_quickly():
    code = "import sys\nwhile True:\n    sys.stdout.write('x' * 100_000_000)"
    result = run(code, SandboxLimits(output_bytes=64 * 1024, wall_s=10))
    assert result.truncated and result.killed_by == "output_bytes"
    assert result.stdout == "x" * 64 * 1024
    assert result.wall_s < 5


@needs_isolation
def test_the_output_cap_counts_stdout_and_stderr_together():
    code = "import sys\nwhile True:\n    print('o' * 999)\n    print('e' * 999, file=sys.stderr)"
    result = run(code, SandboxLimits(output_bytes=100_000, wall_s=10))
    assert result.truncated and len(result.stdout) + len(result.stderr) == 100_000
    assert result.stdout and result.stderr


@pytest.fixture
def host_secret() -> Path:
    """A world-readable file outside the sandbox, so only isolation can keep it hidden."""
    directory = Path(tempfile.mkdtemp(prefix="rlserve-sandbox-test-"))
    directory.chmod(0o755)
    secret = directory / "secret.txt"
    secret.write_text("RLSERVE-HOST-SECRET")
    secret.chmod(0o644)
    yield secret
    secret.unlink()
    directory.rmdir()


@needs_isolation
def test_files_outside_the_sandbox_cannot_be_read(host_secret):
    root_files = (
        [p for p in Path("/root").iterdir() if p.is_file()] if os.access("/root", 0) else []
    )
    paths = [
        str(host_secret),
        "/etc/shadow",
        "/etc/passwd",
        "/proc/1/environ",
        "/proc/self/environ",
        str(REPO / "pyproject.toml"),
        __file__,
        *map(str, root_files[:3]),
    ]
    # Control: the host reads them (a container's PID 1 may refuse even root its environ).
    readable = [
        line.split()[0]
        for line in run_outside(READ_PROBE, " ".join(paths)).splitlines()
        if line.endswith(" READ")
    ]
    assert {str(host_secret), "/etc/shadow", __file__} <= set(readable)
    inside = run(READ_PROBE, stdin=" ".join(paths))
    assert inside.stdout.count("BLOCKED") == len(paths), inside.stdout


@needs_isolation
def test_the_root_holds_only_the_interpreter_and_the_scratch_dir():
    code = "import json, os\nprint(json.dumps([sorted(os.listdir(d)) for d in ('/', '/dev')]))"
    root, dev = json.loads(run(code).stdout)
    system = {"bin", "sbin", "lib", "lib32", "lib64", "libx32", "usr"}
    prefix_top = Path(os.path.realpath(sys.base_prefix)).parts[1]
    assert set(root) <= system | {prefix_top, "dev", "tmp", "scratch", "code.py"}
    assert {"etc", "proc", "sys", "home", "var", "work"}.isdisjoint(root)
    assert {"etc", "proc", "work"} <= set(os.listdir("/"))  # control: the host has them
    assert dev == ["null", "random", "shm", "urandom", "zero"]


@needs_isolation
def test_writes_outside_the_scratch_dir_fail():
    host_dir = Path(tempfile.mkdtemp(prefix="rlserve-sandbox-test-"))
    host_dir.chmod(0o777)  # so a refusal comes from the sandbox, not from permissions
    name = f"rlserve-sandbox-{uuid.uuid4().hex}"
    code = f"""
import os
for path in ("/tmp/{name}", "{host_dir}/{name}", "/usr/{name}", "/code.py", "/{name}"):
    try:
        with open(path, "w") as file:
            file.write("x")
        print(path, "WRITTEN")
    except OSError as error:
        print(path, "BLOCKED", type(error).__name__)
print(sorted(os.listdir(".")))
"""
    try:
        result = run(code)
        assert result.stdout.count("BLOCKED") == 4, result.stdout
        assert f"/tmp/{name} WRITTEN" in result.stdout  # /tmp is the scratch dir
        assert f"['{name}']" in result.stdout
        assert not (Path("/tmp") / name).exists() and list(host_dir.iterdir()) == []
    finally:
        host_dir.rmdir()


@needs_isolation
def test_a_file_over_file_bytes_and_a_full_scratch_dir_fail():
    code = """
import errno
def write(name, size):
    try:
        with open(name, "wb") as file:
            file.write(b"x" * size)
        return "ok"
    except OSError as error:
        return errno.errorcode[error.errno]
print(write("small", 512 * 1024), write("big", 2 * 2**20))
print([write(f"part{i}", 2**20) for i in range(6)])
"""
    result = run(code, SandboxLimits(file_bytes=2**20, scratch_bytes=4 * 2**20))
    first, second = result.stdout.splitlines()
    assert first == "ok EFBIG"
    assert "ENOSPC" in second and second.count("ok") <= 4


@pytest.fixture
def tcp_server():
    server = socket.create_server(("127.0.0.1", 0))
    yield f"AF_INET ('127.0.0.1', {server.getsockname()[1]})"
    server.close()


@pytest.fixture
def abstract_unix_server():
    """An abstract-namespace socket: no file to hide, only a network namespace scopes it."""
    server = socket.socket(socket.AF_UNIX)
    server.bind(f"\0rlserve-sandbox-test-{uuid.uuid4().hex}")
    server.listen()
    yield f"AF_UNIX {server.getsockname()!r}"
    server.close()


@needs_isolation
@pytest.mark.parametrize("server", ["tcp_server", "abstract_unix_server"])
def test_host_servers_cannot_be_reached(server, request):
    address = request.getfixturevalue(server)
    assert run_outside(CONNECT_PROBE, address) == "CONNECTED\n"  # control
    result = run(CONNECT_PROBE, stdin=address)
    assert result.stdout.startswith("BLOCKED"), result.stdout


@needs_isolation
def test_no_dns_no_external_connection_and_only_a_loopback_interface():
    code = """
import socket
print(socket.if_nameindex())
udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for attempt in (lambda: socket.getaddrinfo("example.com", 443),
                lambda: socket.create_connection(("1.1.1.1", 53), timeout=2),
                lambda: udp.sendto(b"x", ("8.8.8.8", 53))):
    try:
        attempt()
        print("REACHED")
    except OSError as error:
        print("BLOCKED", type(error).__name__)
"""
    interfaces, *attempts = run(code).stdout.splitlines()
    assert interfaces == "[(1, 'lo')]"  # its own network namespace: no host interface
    assert len(attempts) == 3 and all(line.startswith("BLOCKED") for line in attempts)


@needs_isolation
def test_the_environment_has_none_of_the_parents_variables(monkeypatch):
    token = uuid.uuid4().hex
    monkeypatch.setenv("RLSERVE_TEST_TOKEN", token)
    monkeypatch.setenv("RAY_TEST_SECRET", token)
    result = run("import json, os\nprint(json.dumps(dict(os.environ)))")
    assert set(json.loads(result.stdout)) == {"PATH", "LANG", "HOME", "TMPDIR"}
    assert token not in result.stdout + result.stderr


@needs_isolation
def test_the_scratch_dir_is_fresh_and_removed_afterwards_even_after_a_timeout(
    monkeypatch, tmp_path
):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    write = "import os, time\nprint(os.getcwd(), os.listdir('.'))\nopen('left', 'w').write('x')\n"
    assert run(write).stdout == "/scratch []\n"
    assert run(write).stdout == "/scratch []\n"  # the previous run's file is gone
    assert list(tmp_path.iterdir()) == []
    result = run(write + "time.sleep(60)", SandboxLimits(wall_s=1))
    assert result.timed_out and list(tmp_path.iterdir()) == []
    # Control: this is where the host side of the scratch dir lives (visible without isolation).
    without_isolation(monkeypatch)
    result = run(write, allow_without_isolation=True)
    assert result.stdout.startswith(str(tmp_path)) and list(tmp_path.iterdir()) == []


@needs_isolation
def test_a_cancelled_run_is_killed_and_cleaned_up(monkeypatch, tmp_path):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    uid = 1_234_567  # the run's uid, to find its processes
    monkeypatch.setattr(sandbox.random, "randrange", lambda *_: uid)

    async def scenario() -> None:
        task = asyncio.create_task(run_python("import os, time\nos.fork()\ntime.sleep(60)"))
        deadline = time.monotonic() + 5
        while len(processes_of(uid)) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert len(processes_of(uid)) == 2  # the code and its child run
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())
    assert list(tmp_path.iterdir()) == []
    assert_all_gone(uid)


@needs_isolation
def test_the_code_has_no_privileges_and_cannot_undo_the_sandbox():
    code = """
import ctypes, os, signal
libc = ctypes.CDLL(None, use_errno=True)
print(os.getpid(), os.getuid(), os.geteuid(), os.getgid(), os.getgroups())
def libc_call(name, *args):
    if getattr(libc, name)(*args) != 0:
        raise OSError(ctypes.get_errno(), name)
for name, attempt in [
    ("setuid", lambda: os.setuid(0)),
    ("chroot", lambda: os.chroot("/scratch")),
    ("unshare-user", lambda: libc_call("unshare", 0x10000000)),
    ("unshare-mount", lambda: libc_call("unshare", 0x20000)),
    ("mount", lambda: libc_call("mount", b"none", b"/scratch", b"tmpfs", 0, None)),
    ("mknod", lambda: os.mknod("/scratch/mem", 0o600 | 0o020000, os.makedev(1, 1))),
    ("kill-init", lambda: os.kill(1, signal.SIGKILL)),
]:
    try:
        attempt()
        print(name, "ALLOWED")
    except OSError as error:
        print(name, "BLOCKED", error.errno)
"""
    ids, *attempts = run(code).stdout.splitlines()
    pid, uid, euid, gid, groups = ids.split(" ", 4)
    assert pid == "2"  # its own PID namespace, under the launcher
    assert uid == euid == gid != "0" and groups == "[]"
    assert len(attempts) == 7 and all(" BLOCKED " in line for line in attempts), attempts


@needs_isolation
def test_eight_concurrent_runs_complete_without_blocking_the_event_loop():
    # Each forks 10 children that live at once: 88 processes, over any one run's
    # 16-process limit, so this also checks that every run has its own uid.
    code = """
import os, sys, time
n = int(sys.stdin.read())
children = []
for _ in range(10):
    pid = os.fork()
    if pid == 0:
        time.sleep(1)
        os._exit(0)
    children.append(pid)
print(n * n, all(os.waitpid(pid, 0)[1] == 0 for pid in children))
"""
    gaps_s = []

    async def scenario() -> list[SandboxResult]:
        async def tick() -> None:
            last = time.monotonic()
            while True:
                await asyncio.sleep(0.01)
                gaps_s.append(time.monotonic() - last)
                last = time.monotonic()

        ticker = asyncio.create_task(tick())
        limits = SandboxLimits(processes=16, wall_s=20)
        results = await asyncio.gather(*(run_python(code, limits, str(n)) for n in range(8)))
        ticker.cancel()
        return results

    results = asyncio.run(scenario())
    assert [r.stdout for r in results] == [f"{n * n} True\n" for n in range(8)]
    assert max(gaps_s) < 0.9  # a call that blocked the loop would stall it for over 1 s


def test_without_isolation_it_refuses_unless_explicitly_allowed(monkeypatch, host_secret):
    without_isolation(monkeypatch)
    with pytest.raises(SandboxUnavailable, match=r"simulated: no namespaces.*allow_without_iso"):
        run("print('never runs')")
    result = run(READ_PROBE, stdin=str(host_secret), allow_without_isolation=True)
    # What the refusal protects against: without isolation host files are readable.
    assert not result.isolated and result.stdout == f"{host_secret} READ\n"


def test_without_isolation_a_leftover_process_cannot_outlast_the_wall_timeout(monkeypatch):
    without_isolation(monkeypatch)
    # The child leaves the process group (no namespace kills it) holding stdout open.
    code = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(5)"
    result = run(code, SandboxLimits(wall_s=1), allow_without_isolation=True)
    assert result.exit_code == 0 and result.timed_out and result.wall_s < 4


def test_limits_name_the_field_and_the_fix():
    with pytest.raises(ValueError, match=r"SandboxLimits.cpu_s must be > 0, got 0; pass a larger"):
        SandboxLimits(cpu_s=0)
    with pytest.raises(ValueError, match=rf"memory_bytes must be >= {64 * MiB}, got {MiB}; pass"):
        SandboxLimits(memory_bytes=MiB)
