"""The sandboxed ``python`` tool (issue 55): hostile code, each case a real child process.

What a case asserts follows what this machine enforces (`guarantees`, probed once): where a
guarantee holds the attack fails, where it does not the test checks that the report says so and
that the damage stays bounded (every process killed, the folder removed). No case may stall or
kill the test process: each sandbox has a 1-2 s limit and every test kills what it left.
"""

import json
import os
import signal
import socket
import sys
import tempfile
import time

import pytest

from rlpipe.core.base.errors import UserError
from rlpipe.plugins.environments.sandbox import PythonSandbox, SandboxError, guarantees, python
from rlpipe.plugins.environments.tools import ToolsEnvironment

FAST = PythonSandbox(timeout_s=1.0)
WHERE = "import os; print(os.getcwd(), flush=True)\n"   # first line: the call's folder
SEEN: list[str] = []                                      # the folders of this module's calls


def run(sandbox, code):
    """``(output, stopped, report)`` of ``code`` run after `WHERE`; the folder is remembered for
    the teardown and checked to be gone."""
    output, stopped, report = sandbox.execute(WHERE + code)
    folder = os.path.dirname(output.decode(errors="replace").split("\n", 1)[0])
    assert os.path.basename(folder).startswith("rlpipe-python-"), output[:200]
    SEEN.append(folder)
    assert not os.path.exists(folder), "the call's folder was not removed"
    return output, stopped, report


def survivors(folder):
    """The pids of live processes whose working directory is inside ``folder``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.readlink(f"/proc/{pid}/cwd").startswith(folder):
                found.append(int(pid))
        except OSError:   # gone, a zombie, or not ours
            pass
    return found


def no_survivors(folder, within_s=2.0):
    deadline = time.monotonic() + within_s
    while survivors(folder) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not survivors(folder)


@pytest.fixture(autouse=True)
def kill_leftovers():
    """Whatever a case leaves running (a daemon where no PID namespace holds it) is killed."""
    yield
    for folder in SEEN:
        for pid in survivors(folder):
            os.kill(pid, signal.SIGKILL)


def test_output_comes_back_and_the_folder_goes():
    assert python("print(6 * 7)") == "42\n"
    output, stopped, report = run(FAST, "print('done')")
    assert output.endswith(b"done\n") and stopped is None and report["status"] == 0


def test_an_endless_loop_ends_at_the_timeout_or_its_cpu_seconds():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="time limit of 1 s"):
        FAST.python("while True: pass")
    assert time.monotonic() - start < 1.0 + 0.9   # the limit and one poll, a spawn, a kill
    with pytest.raises(TimeoutError, match="its 1 s of CPU time"):
        PythonSandbox(timeout_s=20.0, cpu_s=1).python("while True: pass")


def test_a_call_that_never_returns_ends_at_the_timeout():
    start = time.monotonic()
    output, stopped, _ = run(FAST, "import time; time.sleep(10 ** 9)")
    assert stopped == "timeout" and time.monotonic() - start < 1.9
    with pytest.raises(TimeoutError):
        FAST.python("import os; os.close(1); os.close(2)\nwhile True: pass")   # output shut first


def test_a_fork_bomb_is_refused_or_killed_with_the_call():
    # 2**6 = 64 processes at most, each asleep: bounded even where RLIMIT_NPROC does not hold
    bomb = ("import time\nfor _ in range(6):\n    try:\n        os.fork()\n"
            "    except OSError:\n        print('refused', flush=True)\n        break\n"
            "print('p', flush=True)\ntime.sleep(60)\n")
    output, stopped, _ = run(PythonSandbox(timeout_s=2.0, max_processes=8), bomb)
    assert stopped == "timeout"
    if guarantees()["processes"]:
        assert b"refused" in output and output.count(b"p\n") < 64
    else:   # root: RLIMIT_NPROC does not bind; the bomb ran in full and must be dead now
        assert output.count(b"p\n") == 64
    assert no_survivors(SEEN[-1])


def test_a_daemon_that_leaves_the_process_group():
    daemon = ("import time\nr, w = os.pipe()\nif os.fork() == 0:\n    os.setsid()\n"
              "    os.write(w, b'x')\n    time.sleep(60)\nos.read(r, 1)\n")   # exit once it left
    run(FAST, daemon)
    # a PID namespace kills it with the call; without one it escapes the group kill (docs say so)
    assert no_survivors(SEEN[-1]) == guarantees()["pids"]


def test_ten_gigabytes_of_output_are_cut_fast():
    cap = 1 << 16
    sandbox = PythonSandbox(timeout_s=2.0, max_output_bytes=cap)
    start = time.monotonic()
    output, stopped, _ = run(sandbox, "import sys\nfor _ in range(10 ** 4):\n"
                                      "    sys.stdout.write('x' * 10 ** 6)\n")
    assert stopped == "output" and len(output) <= cap + (1 << 16)   # one read past the cap
    assert time.monotonic() - start < 2.0
    with pytest.raises(SandboxError, match=f"more than {cap} bytes and was stopped"):
        sandbox.python("while True: print('x' * 10 ** 6)")
    text = PythonSandbox(max_output_chars=100).python("print('y' * 10000)")
    assert text == "y" * 100 + "\n[... 9901 more characters cut]"   # 10000 + newline - 100


@pytest.mark.parametrize("code, message", [
    ("print('x' * 10 ** 10)", "MemoryError"),
    ("files = [open(os.devnull) for _ in range(100)]", "Too many open files"),
    ("open('big', 'wb').write(b'x' * (2 << 20))", "File too large"),
    ("import sys; sys.exit(3)", "exit status 3$"),
])
def test_each_limit_is_one_line_for_the_model(code, message):
    sandbox = PythonSandbox(timeout_s=2.0, max_files=16, max_file_mb=1)
    with pytest.raises(SandboxError, match=message):
        sandbox.python("import os\n" + code)


def test_home_is_the_call_folder_and_nothing_is_inherited(monkeypatch):
    monkeypatch.setenv("RLPIPE_SECRET", "hunter2")
    code = "print(json.dumps([os.path.expanduser('~'), os.listdir(os.path.expanduser('~')), " \
           "dict(os.environ)]))"
    output, _, _ = run(FAST, "import json\n" + code)
    home, listing, env = json.loads(output.decode().splitlines()[1])
    assert home == os.path.join(SEEN[-1], "home") and listing == []
    assert home != os.path.expanduser("~") and "RLPIPE_SECRET" not in env
    assert sorted(env) == ["HOME", "LANG", "PATH", "TMPDIR"]


def test_the_run_files_are_hidden_where_a_mount_namespace_is_allowed(tmp_path):
    secret = tmp_path / "run" / "weights.txt"
    secret.parent.mkdir()
    secret.write_text("weights")
    sandbox = PythonSandbox(timeout_s=1.0, hide=[str(tmp_path)])
    code = f"print(os.listdir({str(tmp_path)!r}), os.path.exists({str(secret)!r}))"
    if guarantees()["files"]:
        assert sandbox.python("import os\n" + code) == "[] False\n"
        cwd = os.path.realpath(os.getcwd())   # hidden by default, as the home folder is
        listing = FAST.python(f"import os; p = {cwd!r}\n"
                              f"print(sorted(os.listdir(p)) if os.path.exists(p) else 'gone')")
        kept = {os.path.relpath(path, cwd).split(os.sep)[0]   # the interpreter's way in, if any
                for path in FAST._mounts("/nonexistent")[1] if path.startswith(cwd + os.sep)}
        if cwd.startswith(os.path.realpath(tempfile.gettempdir()) + os.sep):
            assert listing == "gone\n"   # under the temp folder, itself hidden: not there at all
        else:
            assert listing == f"{sorted(kept)}\n"   # the working directory: empty but for that
    else:   # no mount namespace: what the trainer's user may read, the code may read (docs)
        assert sandbox.python("import os\n" + code) == "['run'] True\n"


def test_the_machine_is_read_only_and_home_is_a_small_tmpfs():
    sandbox = PythonSandbox(timeout_s=2.0, disk_mb=1, max_file_mb=4)
    system = f"open({os.path.join(sys.base_prefix, 'rlpipe-sandbox-probe')!r}, 'w')"
    if guarantees()["files"]:
        with pytest.raises(SandboxError, match="Read-only file system"):
            sandbox.python(system)
    big = "open('a', 'wb').write(b'x' * (2 << 20)); print('written')"
    if guarantees()["disk"]:
        with pytest.raises(SandboxError, match="No space left on device"):
            sandbox.python(big)
    else:   # the folder is on the trainer's disk: per-file limit only (docs)
        assert sandbox.python(big) == "written\n"
    assert not os.path.exists(os.path.join(sys.base_prefix, "rlpipe-sandbox-probe"))


def test_proc_and_capabilities():
    status = FAST.python("print(open('/proc/self/status').read())")
    cap_eff = next(line.split()[1] for line in status.splitlines() if line.startswith("CapEff"))
    if guarantees()["user"]:
        assert int(cap_eff, 16) == 0
    pids = FAST.python("import os; print(sorted(int(p) for p in os.listdir('/proc') "
                       "if p.isdigit()))")
    assert (pids == "[1, 2]\n") == guarantees()["proc"]


def test_the_trainer_environment_is_unreadable_under_a_user_namespace():
    # /proc/PID/environ (HF_TOKEN, WANDB_API_KEY, ...) needs ptrace rights over the trainer
    code = f"print(len(open('/proc/{os.getpid()}/environ').read()) > 0)"
    if guarantees()["user"]:
        with pytest.raises(SandboxError, match="PermissionError|FileNotFoundError"):
            FAST.python(code)   # not ours to read; with a /proc of its own, not even there
    else:   # same user, no namespace: readable (docs say so)
        assert FAST.python(code) == "True\n"


def test_a_socket_reaches_nothing_where_the_network_is_blocked():
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), 1)\nprint('in')"
        if guarantees()["network"]:
            with pytest.raises(SandboxError, match="OSError|ConnectionRefused"):
                FAST.python(code)
        else:   # no network namespace here: the host's loopback answers
            assert FAST.python(code) == "in\n"


def test_killing_the_parent_leaves_the_trainer_alive():
    result = None
    try:
        result = FAST.python("import os, time; os.kill(os.getppid(), 9)\n"
                             "time.sleep(0.2); print('alive')")
    except SandboxError as exc:   # no PID namespace: the parent is the supervisor, now dead
        assert not guarantees()["pids"] and "supervisor" in str(exc)
    if guarantees()["pids"]:   # the parent is the namespace's init: SIGKILL from inside is ignored
        assert result == "alive\n"
    if guarantees()["pids"]:
        with pytest.raises(SandboxError, match="ProcessLookupError"):
            FAST.python(f"import os; os.kill({os.getpid()}, 15)")
    else:   # the trainer's pid would be reachable: the report must say so
        assert FAST.python("import os; print(os.getpid())") != "2\n"
    assert os.getpid() and sys.stdout   # still here


def test_through_the_tools_environment():
    env = ToolsEnvironment([FAST.python], timeout_s=10.0)
    assert env.declared.tools[0]["function"]["parameters"]["required"] == ["code"]
    calls = "".join(f"<tool_call>{json.dumps({'name': 'python', 'arguments': {'code': c}})}"
                    f"</tool_call>" for c in ("print(2 ** 10)", "while True: pass", "1/0"))
    messages, reward, done, info = env.step(calls)
    assert [m["content"] for m in messages] == [
        "1024\n",
        "error: TimeoutError: the code ran past the time limit of 1 s and was stopped",
        "error: SandboxError: exit status 1: ZeroDivisionError: division by zero"]
    assert info == {"tool_calls": 3, "tool_errors": 2, "timeouts": 1} and not done


def test_the_yaml_reference_and_bad_limits():
    env = ToolsEnvironment(["rlpipe.plugins.environments.sandbox:python"])
    assert env.declared.tools[0]["function"]["name"] == "python"
    with pytest.raises(UserError, match="^python sandbox: timeout_s must be a number > 0"):
        PythonSandbox(timeout_s=0)
    with pytest.raises(UserError, match="^python sandbox: memory_mb must be an integer >= 64"):
        PythonSandbox(memory_mb=True)
    with pytest.raises(SandboxError, match="code must be a string"):
        python(["print(1)"])
