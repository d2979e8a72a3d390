"""Run untrusted Python (a model's tool call) in a throw-away sandbox.

`run_python(code, limits, stdin)` runs `code` with the host's interpreter (`python -I -S
-u`: no site-packages, no PYTHON* variables) as an asyncio subprocess (many run at once),
returning its exit status, output and the limit that ended it, if any. docs/sandbox.md is
the threat model.

Design choices:
- Namespaces and a chroot, no container runtime. The launcher (`_launcher`, run by
  `python -c` under `unshare --net --pid --mount --ipc --uts --fork --kill-child`) is PID
  1 of fresh namespaces. As root it builds a tmpfs root (read-only binds of /usr, the lib
  dirs and the interpreter's prefix, four /dev nodes, /code.py, a size-capped tmpfs at
  /scratch), chroots there, forks the code with rlimits, no_new_privs and a fresh
  unprivileged uid, reaps orphans until the code's main process exits and reports its
  status on a pipe the code cannot write. Its exit makes the kernel kill all that is left.
- chroot suffices: the code has no capability to chroot or mount again, no /proc (no
  other root to walk into), no descriptor opened outside, and the kernel refuses new user
  namespaces to a chrooted process.
- A random uid per run, not `nobody`: RLIMIT_NPROC counts a uid's processes system-wide,
  so with a shared uid one sandbox's fork bomb would starve the others.
- The scratch dir is a tmpfs in the namespace: bounded, never on the host's disk, freed
  by the kernel even if this process dies.
- One output budget for stdout and stderr, read in 64 KiB chunks; at the cap the process
  group is killed, so the parent holds at most the cap plus asyncio's buffers.
- Without namespaces (`sandbox_available()` says why) run_python refuses unless
  `allow_without_isolation=True`: then the code runs as the caller with the same rlimits,
  environment, timeout and output cap, seeing the host's files and network.
"""

import asyncio
import contextlib
import functools
import inspect
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import BinaryIO

MiB = 2**20

_CHUNK_BYTES = 64 * 1024
_SIGNAL_NAMES = {s.value: s.name for s in signal.Signals}  # most real-time ones have none
# The real interpreter behind sys.executable: a virtualenv's packages stay out.
_PYTHON = os.path.realpath(sys.executable)
# Far above distribution and container (subuid) ranges, so no host account shares it.
_UID_RANGE = (1 << 20, 1 << 30)
_UNSHARE_FLAGS = ("--net", "--pid", "--mount", "--ipc", "--uts", "--fork", "--kill-child")
# The least address space in which the interpreter starts and imports a few modules.
_MIN_MEMORY_BYTES = 64 * MiB


class SandboxError(RuntimeError):
    """The sandbox could not run the code (the code failing is a result, not this)."""


class SandboxUnavailable(SandboxError):
    """Namespaces cannot be made here and the caller did not allow running without them."""


@dataclass(frozen=True)
class SandboxLimits:
    """What one run may use; the per-process limits bind each process separately."""

    cpu_s: float = 5.0
    """CPU seconds per process (RLIMIT_CPU, rounded up to whole seconds): SIGXCPU, then SIGKILL."""
    memory_bytes: int = 512 * MiB
    """Address space per process (RLIMIT_AS): a larger allocation raises MemoryError."""
    file_bytes: int = 16 * MiB
    """Largest file the code may write (RLIMIT_FSIZE): writing past it fails with EFBIG."""
    scratch_bytes: int = 64 * MiB
    """Size of the scratch tmpfs (cwd, /tmp, /dev/shm; host memory): past it ENOSPC."""
    processes: int = 16
    """Processes and threads the code may have at once, its main process included."""
    open_files: int = 256
    """Open file descriptors per process (RLIMIT_NOFILE)."""
    wall_s: float = 10.0
    """Wall-clock seconds until the code has exited and its output ended; then all is killed."""
    output_bytes: int = 64 * 1024
    """stdout and stderr bytes together; past it both are cut and everything is killed."""

    def __post_init__(self) -> None:
        least = {"open_files": 3, "output_bytes": 0, "memory_bytes": _MIN_MEMORY_BYTES}
        for name, value in vars(self).items():
            if value < least.get(name, 0) or (name not in least and value <= 0):
                bound = f">= {least[name]}" if name in least else "> 0"
                raise ValueError(
                    f"SandboxLimits.{name} must be {bound}, got {value}; pass a larger {name}"
                )


@dataclass(frozen=True)
class SandboxResult:
    """What the code did."""

    exit_code: int | None
    """The code's exit status; None when a signal or a limit ended it (see killed_by)."""
    stdout: str
    """What it printed (UTF-8, undecodable bytes replaced), cut at output_bytes."""
    stderr: str
    """Its error output, tracebacks included, cut at output_bytes together with stdout."""
    timed_out: bool
    """wall_s ran out and the sandbox was killed."""
    truncated: bool
    """The output reached output_bytes and the sandbox was killed."""
    wall_s: float
    """Seconds from start to end, setup and cleanup included."""
    killed_by: str | None
    """What ended it besides its own exit: 'wall_s', 'cpu_s', 'output_bytes' or a signal name."""
    cpu_s: float | None
    """CPU seconds of the code's main process; None when it was killed before reporting."""
    isolated: bool
    """Whether it ran in namespaces (False only with allow_without_isolation=True)."""


@functools.cache
def sandbox_available() -> str | None:
    """None when this host can isolate the code, else why not (checked once per process)."""
    if sys.platform != "linux":
        return f"namespaces need Linux, this is {sys.platform}"
    if os.geteuid() != 0:
        return f"the mounts and the uid switch need root, this process runs as uid {os.geteuid()}"
    unshare = shutil.which("unshare")
    if unshare is None:
        return "the unshare command (util-linux) is not on PATH"
    probe = [unshare, *_UNSHARE_FLAGS, "--", _PYTHON, "-I", "-S", "-c", ""]
    done = subprocess.run(probe, capture_output=True, text=True)
    if done.returncode != 0:
        return f"`unshare {' '.join(_UNSHARE_FLAGS)}` failed: {done.stderr.strip()}"
    return None


def _read_only_paths() -> list[str]:
    """The host dirs the interpreter needs, bound read-only at their own paths."""
    tops = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/usr")
    prefixes = [os.path.realpath(p) for p in (sys.base_prefix, sys.base_exec_prefix)]
    paths = [p for p in tops if os.path.isdir(p)] + prefixes + [os.path.dirname(_PYTHON)]
    return sorted(set(paths))  # a parent sorts (and is bound) before what is under it


async def run_python(
    code: str,
    limits: SandboxLimits | None = None,
    stdin: str = "",
    *,
    allow_without_isolation: bool = False,
) -> SandboxResult:
    """Run `code` (Python source, as the script /code.py) on `stdin` in a fresh sandbox.

    Args:
        limits: what it may use; SandboxLimits() when None.
        allow_without_isolation: where sandbox_available() gives a reason, run anyway with
            limits only: the code can then read host files and use the network.

    Raises:
        SandboxUnavailable: no isolation here and allow_without_isolation is False.
        SandboxError: the sandbox itself failed to start the code.
    """
    limits = limits or SandboxLimits()
    reason = sandbox_available()
    if reason is not None and not allow_without_isolation:
        raise SandboxUnavailable(
            f"cannot isolate untrusted code here: {reason}. Run as root on Linux with "
            "unshare (util-linux), or pass allow_without_isolation=True to run it with "
            "limits only (it can then read host files and use the network)"
        )
    started = time.monotonic()
    with contextlib.ExitStack() as cleanup:
        work_dir = tempfile.mkdtemp(prefix="rlserve-sandbox-")
        cleanup.callback(shutil.rmtree, work_dir, ignore_errors=True)
        # Not asyncio's pipes: 3.11's wait() waits for them, which a leftover process holds.
        ends = [os.pipe() for _ in range(3)]  # stdout, stderr, the launcher's status
        reads = [cleanup.enter_context(open(r, "rb", buffering=0)) for r, _ in ends]
        writes = [cleanup.enter_context(open(w, "wb", buffering=0)) for _, w in ends]
        argv = _prepare(work_dir, code, stdin, limits, reason is None, writes[2].fileno())
        with open(os.path.join(work_dir, "stdin"), "rb") as stdin_file:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=stdin_file,
                stdout=writes[0],
                stderr=writes[1],
                env={},
                pass_fds=(writes[2].fileno(),),
                start_new_session=True,  # one process group to kill
            )
        for write in writes:
            write.close()  # the launcher has its copies: EOF comes when it and the code end
        stdout, stderr, killed_by = await _communicate(proc, reads[:2], limits)
        os.set_blocking(reads[2].fileno(), False)  # a killed launcher may not be gone yet
        status = {}
        for line in (reads[2].read() or b"").splitlines():
            status.update(json.loads(line))
    if "error" in status:
        raise SandboxError(f"the sandbox could not start the code: {status['error']}")
    if killed_by is None and "signal" in status:
        signum, cpu_s = status["signal"], status["cpu_s"]
        # A SIGKILL past the CPU limit is its hard limit, for code that ignored SIGXCPU.
        cpu_out = signum == signal.SIGXCPU or (signum == signal.SIGKILL and cpu_s >= limits.cpu_s)
        killed_by = "cpu_s" if cpu_out else _SIGNAL_NAMES.get(signum, f"signal {signum}")
    elif killed_by is None and "exit_code" not in status:
        raise SandboxError(
            f"the sandbox launcher exited with {proc.returncode} without the code's status; "
            f"its stderr: {stderr[-2000:].decode(errors='replace')}"
        )
    return SandboxResult(
        exit_code=status.get("exit_code"),
        stdout=stdout.decode(errors="replace"),
        stderr=stderr.decode(errors="replace"),
        timed_out=killed_by == "wall_s",
        truncated=killed_by == "output_bytes",
        wall_s=time.monotonic() - started,
        killed_by=killed_by,
        cpu_s=status.get("cpu_s"),
        isolated=reason is None,
    )


def _prepare(
    work_dir: str, code: str, stdin: str, limits: SandboxLimits, isolated: bool, status_fd: int
) -> list[str]:
    """Write code and stdin (a file: nothing to feed) to `work_dir`; return the command."""
    for name, text in (("code.py", code), ("stdin", stdin)):
        with open(os.path.join(work_dir, name), "w", encoding="utf-8") as file:
            file.write(text)
    scratch = "/scratch" if isolated else os.path.join(work_dir, "scratch")
    os.mkdir(os.path.join(work_dir, "root" if isolated else "scratch"))
    cpu_s = math.ceil(limits.cpu_s)
    config = {
        "root": os.path.join(work_dir, "root") if isolated else "",
        "read_only": _read_only_paths() if isolated else [],
        "scratch": scratch,
        "scratch_bytes": limits.scratch_bytes,
        "code_path": os.path.join(work_dir, "code.py"),
        "python": _PYTHON,
        # Without isolation the code stays the caller: another uid may not reach _PYTHON.
        "uid": random.randrange(*_UID_RANGE) if isolated else None,
        "rlimits": {
            "RLIMIT_CPU": [cpu_s, cpu_s + 1],  # the hard limit kills code that ignores SIGXCPU
            "RLIMIT_AS": [limits.memory_bytes] * 2,
            "RLIMIT_FSIZE": [limits.file_bytes] * 2,
            "RLIMIT_NPROC": [limits.processes] * 2,
            "RLIMIT_NOFILE": [limits.open_files] * 2,
            "RLIMIT_CORE": [0, 0],
        },
        "env": {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": scratch, "TMPDIR": scratch},
        "status_fd": status_fd,
    }
    source = inspect.getsource(_launcher) + "\n_launcher()\n"
    launcher = [_PYTHON, "-I", "-S", "-c", source, json.dumps(config)]
    if not isolated:
        return launcher
    return [shutil.which("unshare") or "unshare", *_UNSHARE_FLAGS, "--", *launcher]


async def _communicate(
    proc: asyncio.subprocess.Process, pipes: list[BinaryIO], limits: SandboxLimits
) -> tuple[bytes, bytes, str | None]:
    """Collect stdout and stderr until the code exits or a limit ends it (which it returns)."""
    remaining, killed_by = limits.output_bytes, None
    kept, transports, tasks = (bytearray(), bytearray()), [], []
    loop = asyncio.get_running_loop()

    async def collect(stream: asyncio.StreamReader, into: bytearray) -> None:
        nonlocal remaining, killed_by
        while chunk := await stream.read(_CHUNK_BYTES):
            into += chunk[:remaining]
            if len(chunk) > remaining:
                remaining, killed_by = 0, "output_bytes"
                _kill_group(proc)
                return
            remaining -= len(chunk)

    try:
        for pipe, into in zip(pipes, kept, strict=True):
            # asyncio pauses a pipe with 2 x limit bytes unread: the parent holds no more.
            stream = asyncio.StreamReader(limit=_CHUNK_BYTES)
            protocol = asyncio.StreamReaderProtocol(stream)
            transports.append((await loop.connect_read_pipe(lambda p=protocol: p, pipe))[0])
            tasks.append(asyncio.create_task(collect(stream, into)))
        async with asyncio.timeout(limits.wall_s):
            await proc.wait()
            _kill_group(proc)  # a run without isolation may leave children in the group
            await asyncio.gather(*tasks)
    except TimeoutError:
        killed_by = killed_by or "wall_s"
    finally:
        for task in tasks:
            task.cancel()
        for transport in transports:
            transport.close()
        if proc.returncode is None:
            _kill_group(proc)
            await proc.wait()
    return bytes(kept[0]), bytes(kept[1]), killed_by


def _kill_group(proc: asyncio.subprocess.Process) -> None:
    # In a PID namespace, its PID 1 dying kills the rest, whatever group they moved to.
    with contextlib.suppress(ProcessLookupError):  # all gone already
        os.killpg(proc.pid, signal.SIGKILL)


def _launcher() -> None:
    """PID 1 of the sandbox, run as `python -I -S -c <this source> CONFIG` (so no module
    global): builds the root and chroots (if isolated), forks the code, reaps until it
    exits, and writes its exit code or signal, or what failed, to the status pipe."""
    import ctypes
    import json
    import os
    import resource
    import sys

    ms_rdonly, ms_nosuid, ms_nodev, ms_remount, ms_bind = 1, 2, 4, 32, 4096
    ms_rec, ms_private, pr_set_no_new_privs = 1 << 14, 1 << 18, 38
    config = json.loads(sys.argv[1])
    status_fd, root, scratch, uid = (config[k] for k in ("status_fd", "root", "scratch", "uid"))
    os.set_inheritable(status_fd, False)  # closed at exec: the code cannot forge its status
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]
    libc.prctl.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4

    def report(**status: object) -> None:
        os.write(status_fd, json.dumps(status).encode() + b"\n")

    def check(result: int, what: str) -> None:
        if result != 0:
            raise OSError(ctypes.get_errno(), f"{what}: {os.strerror(ctypes.get_errno())}")

    def mount(source: str | None, target: str, fstype: str | None, flags: int, data="") -> None:
        encoded = [s.encode() if s else None for s in (source, target, fstype)]
        check(libc.mount(*encoded, flags, data.encode()), f"mount {target}")

    def bind_read_only(path: str, flags: int) -> None:
        mount(path, root + path, None, ms_bind)
        # A bind mount takes ro/nosuid/nodev only when remounted.
        mount(None, root + path, None, ms_remount | ms_bind | ms_rdonly | flags)

    def build_root() -> None:
        os.umask(0o022)
        mount(None, "/", None, ms_rec | ms_private)  # no mount of ours reaches the host's
        mount("tmpfs", root, "tmpfs", ms_nosuid | ms_nodev, "mode=0755")
        for path in config["read_only"]:
            os.makedirs(root + path, exist_ok=True)
            bind_read_only(path, ms_nosuid | ms_nodev)
        os.mkdir(root + "/dev")
        for device in ("/dev/null", "/dev/zero", "/dev/random", "/dev/urandom"):
            open(root + device, "x").close()
            bind_read_only(device, ms_nosuid)
        os.mkdir(root + scratch)
        size = f"size={config['scratch_bytes']},mode=0700,uid={uid},gid={uid}"
        mount("tmpfs", root + scratch, "tmpfs", ms_nosuid | ms_nodev, size)
        for alias in ("/tmp", "/dev/shm"):
            os.symlink(scratch, root + alias)
        with open(config["code_path"], "rb") as src, open(root + "/code.py", "xb") as dst:
            dst.write(src.read())
        mount(None, root, None, ms_remount | ms_rdonly | ms_nosuid | ms_nodev)
        check(libc.sethostname(b"sandbox", 7), "sethostname")
        os.chroot(root)

    def start_code() -> None:
        for name, values in config["rlimits"].items():
            resource.setrlimit(getattr(resource, name), tuple(values))
        if uid is not None:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
        check(libc.prctl(pr_set_no_new_privs, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
        os.umask(0o077)
        python, code = config["python"], "/code.py" if root else config["code_path"]
        os.execve(python, [python, "-I", "-S", "-u", code], config["env"])

    try:
        if root:
            build_root()
        os.chdir(scratch)
        code_pid = os.fork()
        if code_pid == 0:
            try:
                start_code()
            except BaseException as error:
                report(error=f"starting the code: {error!r}")
            os._exit(127)
        while True:  # as PID 1 it inherits every orphan: reap them too
            pid, wait_status, usage = os.wait4(-1, 0)
            if pid == code_pid:
                break
    except Exception as error:
        report(error=f"{type(error).__name__}: {error}")
        sys.exit(1)
    exit_code = os.waitstatus_to_exitcode(wait_status)
    outcome = {"exit_code": exit_code} if exit_code >= 0 else {"signal": -exit_code}
    report(**outcome, cpu_s=usage.ru_utime + usage.ru_stime)
