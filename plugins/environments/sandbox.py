"""A ``python`` tool for the ``tools`` environment: the model's code runs in a separate process.

Never ``eval`` or ``exec`` in the trainer: each call writes the code to a fresh temporary folder
and starts ``python -I -S`` there (isolated mode, no site-packages) through a small supervisor,
with an environment of ``PATH``, ``HOME``, ``TMPDIR`` (the call's folder) and ``LANG`` only.
Before the code runs, the child gets Linux rlimits on CPU seconds, address space, open files,
processes and the size of a file it writes; where the kernel lets an unprivileged process do it,
it also gets its own user, network, PID and mount namespaces (no capability; no network; the
trainer out of sight and reach, every process it starts killed when it ends; the machine
read-only, the home folder, the working directory and the temp folder hidden, a small tmpfs as
home). The trainer reads at most ``max_output_bytes`` of output, stops the program at
``timeout_s`` (wall clock), kills its process group and removes the folder. What this machine
enforces: `guarantees` (docs/sandbox.md says what each one means).

Every failure (an exception in the code, a limit, the timeout, too much output) raises one line
(`SandboxError`, or ``TimeoutError`` for time): the ``tools`` environment hands it to the model as
``error: ...`` and counts it in ``tool_errors`` (a ``TimeoutError`` in ``timeouts`` too).

>>> python("print(6 * 7)")
'42\\n'
>>> try:
...     python("1 / 0")
... except SandboxError as exc:
...     print(exc)
exit status 1: ZeroDivisionError: division by zero
>>> PythonSandbox(timeout_s=0.5).python("while True: pass")
Traceback (most recent call last):
...
TimeoutError: the code ran past the time limit of 0.5 s and was stopped
"""

from __future__ import annotations

import functools
import json
import math
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from rlpipe.core.base.errors import UserError
from rlpipe.plugins.environments.tools import _cut

# The supervisor, run as `python -I -S -c _SUPERVISOR CONFIG`. It takes the namespaces it may
# (user: its uid is mapped to 65534 inside, so the code's exec drops every capability; network;
# PID; mount: an empty read-only tmpfs over each `hide` path, the `keep` paths bound back, and a
# tmpfs of `disk_mb` as the home folder), says which on stderr (a JSON line), starts the code
# (under a PID namespace: through an init that reaps orphans, so the code is PID 2 and its parent
# is that init, never the trainer) and reports how the code ended (a JSON line). The code's
# stderr is its stdout: it cannot write the report.
_SUPERVISOR = r"""
import ctypes, json, os, resource, sys
cfg = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
BIND, REC, PRIVATE, REMOUNT, RDONLY = 4096, 16384, 1 << 18, 32, 1
enforced, mounted = [], []

def unshare(flag, name):
    if getattr(libc, "unshare", None) and libc.unshare(flag) == 0:
        enforced.append(name)
        return True

def write(path, text):
    with open(path, "w") as f:
        f.write(text)

def mount(src, dst, fstype=None, flags=0, data=None):
    args = [x.encode() if x else None for x in (src, dst, fstype, data)]
    if libc.mount(args[0], args[1], args[2], ctypes.c_ulong(flags), args[3]) != 0:
        raise OSError(ctypes.get_errno(), "mount " + dst)
    if not flags & (REMOUNT | PRIVATE):
        mounted.append(dst)

def readonly(path):   # a bind remount keeps the flags the kernel locked (nosuid, atime...)
    flags = os.statvfs(path).f_flag
    mount(None, path, None, REMOUNT | BIND | RDONLY | flags & 3086 | (flags & 4096) << 9)

def hide():
    mount(None, "/", None, REC | PRIVATE)
    with open("/proc/self/mountinfo") as f:   # the machine read-only (first: nothing to undo)
        for path in [line.split()[4].replace("\\040", " ") for line in f.read().splitlines()]:
            if os.access(path, os.F_OK):   # else out of the code's reach too
                readonly(path)
    mount("tmpfs", cfg["home"], "tmpfs", 0, "mode=700,size=%dm" % cfg["disk_mb"])
    enforced.append("disk")
    keep = [os.open(path, os.O_PATH) for path in cfg["keep"]]
    for path in cfg["hide"]:
        mount("tmpfs", path, "tmpfs", 0, "mode=755,size=64k")
    for path, fd in zip(cfg["keep"], keep):
        os.makedirs(path, exist_ok=True)
        mount("/proc/self/fd/%d" % fd, path, None, BIND | REC)
    for path in cfg["hide"]:
        mount(None, path, None, REMOUNT | RDONLY)
    os.chdir(cfg["home"])
    enforced.append("files")

uid, gid = os.geteuid(), os.getegid()
if unshare(0x10000000, "user"):
    try:
        write("/proc/self/setgroups", "deny")
        write("/proc/self/uid_map", "65534 %d 1" % uid)
        write("/proc/self/gid_map", "65534 %d 1" % gid)
    except OSError:
        pass
unshare(0x40000000, "network")
unshare(0x20000000, "pids")
if unshare(0x00020000, "mounts"):
    try:
        hide()
    except OSError as exc:   # undo: the code must not lose its interpreter to half a job
        for path in reversed(mounted):
            libc.umount2(path.encode(), 2)
        enforced[:] = [name for name in enforced if name not in ("disk", "files")]
        os.chdir(cfg["home"])
        os.write(2, (json.dumps({"setup": str(exc)}) + "\n").encode())
os.write(2, (json.dumps({"enforced": enforced}) + "\n").encode())

def code():
    os.dup2(1, 2)
    for name, soft, hard in cfg["limits"]:
        resource.setrlimit(getattr(resource, name), (soft, hard))
    os.execv(cfg["argv"][0], cfg["argv"])

def start(target):
    pid = os.fork()
    if pid == 0:
        try:
            target()
        finally:
            os._exit(127)
    return pid

def wait_for(pid):
    while True:
        got, status = os.waitpid(-1, 0)
        if got == pid:
            return os.waitstatus_to_exitcode(status)

def init():
    if "files" in enforced:   # a /proc of the PID namespace: the machine's processes unseen
        try:
            mount("proc", "/proc", "proc", 2 | 4 | 8)
            os.write(2, b'{"proc": true}\n')
        except OSError:
            pass
    code_status = wait_for(start(code))
    os.write(2, (json.dumps({"status": code_status}) + "\n").encode())
    os._exit(0)

if "pids" in enforced:
    os._exit(os.waitstatus_to_exitcode(os.waitpid(start(init), 0)[1]))
init()
"""


class SandboxError(RuntimeError):
    """The code failed or broke a limit; the message is one line for the model."""


class PythonSandbox:
    """Runs Python code in a separate, limited process; `python` is the tool.

    Args:
        timeout_s: wall-clock limit on one call, in seconds (keep it below the environment's
            ``timeout_s``)
        cpu_s: CPU seconds (RLIMIT_CPU); default: ``timeout_s`` rounded up
        memory_mb: address space (RLIMIT_AS), in MiB
        max_files: open files (RLIMIT_NOFILE)
        max_processes: processes and threads (RLIMIT_NPROC; ignored for root)
        max_file_mb: size of a file the code writes (RLIMIT_FSIZE), in MiB
        max_output_chars: output past this many characters is cut, with a marker
        max_output_bytes: output past this many bytes stops the program (an error)
        disk_mb: the home folder's size, in MiB (a tmpfs, where a mount namespace is allowed)
        hide: folders covered by an empty read-only folder (where a mount namespace is
            allowed); default: the home folder, the working directory and the temp folder
        site_packages: let the code import the installed packages (``python -I`` without ``-S``)
    """

    def __init__(self, timeout_s: float = 5.0, cpu_s: int | None = None, memory_mb: int = 512,
                 max_files: int = 64, max_processes: int = 64, max_file_mb: int = 16,
                 max_output_chars: int = 4000, max_output_bytes: int = 1 << 20,
                 disk_mb: int = 64, hide: list[str] | None = None, site_packages: bool = False):
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not (
                0 < timeout_s < math.inf):
            raise UserError(f"python sandbox: timeout_s must be a number > 0, got {timeout_s!r}")
        cpu_s = math.ceil(timeout_s) if cpu_s is None else cpu_s
        for name, value, low in (("cpu_s", cpu_s, 1), ("memory_mb", memory_mb, 64),
                                 ("max_files", max_files, 8), ("max_processes", max_processes, 1),
                                 ("max_file_mb", max_file_mb, 0),
                                 ("max_output_chars", max_output_chars, 1),
                                 ("max_output_bytes", max_output_bytes, 1),
                                 ("disk_mb", disk_mb, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise UserError(f"python sandbox: {name} must be an integer >= {low}, "
                                f"got {value!r}")
        self.timeout_s, self.cpu_s = float(timeout_s), cpu_s
        self.max_output_chars, self.max_output_bytes = max_output_chars, max_output_bytes
        if hide is not None and (not isinstance(hide, (list, tuple)) or not all(
                isinstance(path, str) for path in hide)):
            raise UserError(f"python sandbox: hide must be a list of folders, got {hide!r}")
        self.disk_mb, self.hide, self.site_packages = disk_mb, hide, site_packages
        base = getattr(sys, "_base_executable", sys.executable)   # outside a venv: the same
        self.argv = ([sys.executable, "-I"] if site_packages else [base, "-I", "-S"]) + [
            "-X", "utf8"]
        self.limits = [("RLIMIT_CPU", cpu_s, cpu_s + 1),
                       ("RLIMIT_AS", memory_mb << 20, memory_mb << 20),
                       ("RLIMIT_NOFILE", max_files, max_files),
                       ("RLIMIT_NPROC", max_processes, max_processes),
                       ("RLIMIT_FSIZE", max_file_mb << 20, max_file_mb << 20),
                       ("RLIMIT_CORE", 0, 0)]

    def python(self, code: str) -> str:
        """Run a Python program and return what it prints (stdout and stderr). Print the values
        you need; nothing else comes back.

        Args:
            code: the program, a complete Python script
        """
        if not isinstance(code, str):
            raise SandboxError(f"code must be a string, got {type(code).__name__}")
        output, stopped, report = self.execute(code)
        text = output.decode("utf-8", errors="replace")
        if stopped == "timeout":
            raise TimeoutError(f"the code ran past the time limit of {self.timeout_s:g} s and "
                               f"was stopped")
        if stopped == "output":
            raise SandboxError(f"the code printed more than {self.max_output_bytes} bytes and "
                               f"was stopped; print less")
        if report.get("status") == 0:
            return _cut(text, self.max_output_chars)
        raise self._failure(report, text)

    def _failure(self, report: dict, text: str) -> Exception:
        """The exception for a program that ended with the report's ``status`` (none: its
        supervisor died, killed or broken)."""
        status = report.get("status")
        if status is None:
            return SandboxError(f"the sandbox's supervisor died ({report.get('setup', 'killed')})")
        if status < 0 and -status == signal.SIGXCPU:
            return TimeoutError(f"the code used its {self.cpu_s} s of CPU time and was stopped")
        if status < 0:
            return SandboxError(f"the code was killed by {signal.Signals(-status).name}")
        last = [line.strip() for line in text.splitlines() if line.strip()][-1:]
        return SandboxError(f"exit status {status}" + "".join(f": {line}" for line in last))

    def execute(self, code: str) -> tuple[bytes, str | None, dict]:
        """``(output, stopped, report)`` of one run of ``code``: at most ``max_output_bytes``
        (and a chunk) of output; ``"timeout"``, ``"output"`` or None (it ended by itself); the
        supervisor's report (``enforced``: the namespaces it took; ``status``: the program's
        exit code, minus the signal that killed it). Every process is killed and the folder
        removed before it returns."""
        folder = tempfile.mkdtemp(prefix="rlpipe-python-")
        try:
            home = os.path.join(folder, "home")
            os.mkdir(home)
            script = os.path.join(folder, "main.py")
            with open(script, "w", encoding="utf-8") as f:
                f.write(code)
            hide, keep = self._mounts(folder)
            config = {"limits": self.limits, "argv": [*self.argv, script], "home": home,
                      "disk_mb": self.disk_mb, "hide": hide, "keep": keep}
            env = {"PATH": os.defpath, "HOME": home, "TMPDIR": home, "LANG": "C.UTF-8"}
            proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", _SUPERVISOR,
                                     json.dumps(config)], cwd=home, env=env,
                                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, start_new_session=True)
            try:
                output, stopped = self._read(proc)
            finally:
                _kill_group(proc)
            report = _report(proc.stderr)
            proc.stdout.close()
            return output, stopped, report
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def _mounts(self, folder: str) -> tuple[list[str], list[str]]:
        """The folders to cover and the folders under them to bind back (the interpreter, the
        call's folder). A folder that holds the system (``/``, ``/usr``, ...) is never covered."""
        hide = [os.path.realpath(os.path.expanduser(path)) for path in (
            self.hide if self.hide is not None else ["~", os.getcwd(), tempfile.gettempdir()])]
        hide = sorted({path for path in hide if os.path.isdir(path)
                       and not any(_under(system, path) for system in _SYSTEM)})
        hide = [path for path in hide if not any(_under(path, top) for top in hide if top != path)]
        keep = sorted({os.path.realpath(path) for path in (
            sys.base_prefix, os.path.dirname(self.argv[0]), folder,
            *([sys.prefix] if self.site_packages else []))})
        keep = [path for path in keep if any(_under(path, top) for top in hide)
                and not any(_under(path, top) for top in keep if top != path)]
        return hide, keep

    def _read(self, proc: subprocess.Popen) -> tuple[bytes, str | None]:
        """The program's output, read as it comes (never more than ``max_output_bytes`` and a
        chunk), until it ends, the time is up or the output is too much."""
        deadline = time.monotonic() + self.timeout_s
        fd = proc.stdout.fileno()
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        chunks, size, eof = [], 0, False
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return b"".join(chunks), "timeout"
            if not eof and poller.poll(min(left, 0.05) * 1000):
                data = os.read(fd, 1 << 16)
                eof = not data
                chunks.append(data)
                size += len(data)
                if size > self.max_output_bytes:
                    return b"".join(chunks), "output"
            elif proc.poll() is not None:
                return b"".join(chunks), None
            elif eof:
                time.sleep(min(left, 0.01))   # output closed; the program still runs


_SYSTEM = ("/bin", "/dev", "/etc", "/lib", "/lib64", "/proc", "/sbin", "/sys", "/usr")


def _under(path: str, top: str) -> bool:
    """``path`` is ``top`` or inside it.

    >>> _under("/usr/lib", "/usr"), _under("/usr", "/"), _under("/usrx", "/usr")
    (True, True, False)
    """
    return path == top or path.startswith(top.rstrip("/") + "/")


def _report(pipe) -> dict:
    """The supervisor's JSON lines, read without waiting (its writers are dead by now)."""
    os.set_blocking(pipe.fileno(), False)
    try:
        data = pipe.read() or b""
    finally:
        pipe.close()
    report = {}
    for line in data.decode(errors="replace").splitlines():
        try:
            report.update(json.loads(line))
        except (ValueError, TypeError):   # the supervisor's own traceback
            report["setup"] = line.strip() or report.get("setup", "")
    return report


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill every process of the call's session (under a PID namespace: its init, and with it
    every process the code started) and reap the supervisor."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


@functools.cache
def guarantees() -> dict:
    """What the sandbox enforces on this machine (probed once): ``rlimits`` (CPU, memory, open
    files, file size), ``processes`` (RLIMIT_NPROC: not for root), ``user`` (a user namespace:
    the code holds no capability and cannot read the trainer's ``/proc/PID/environ``), and with
    it: ``network`` (no network), ``pids`` (the trainer out of reach; every process the code
    starts killed with the call), ``files`` (the machine read-only; the home folder, the working
    directory and the temp folder hidden), ``disk`` (the home folder a tmpfs of ``disk_mb``),
    ``proc`` (a ``/proc`` that shows the call's processes only).

    >>> sorted(guarantees())
    ['disk', 'files', 'network', 'pids', 'proc', 'processes', 'rlimits', 'user']
    """
    report = PythonSandbox().execute("pass")[2]
    enforced = report.get("enforced", []) + ["proc"] * report.get("proc", False)
    user = "user" in enforced   # without it a root trainer's code could undo the rest
    found = {name: user and name in enforced for name in ("network", "pids", "files", "disk",
                                                          "proc")}
    return {"rlimits": True, "processes": os.geteuid() != 0, "user": user, **found}


python = PythonSandbox().python
