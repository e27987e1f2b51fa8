"""Start a multi-process job for the tests: torchrun's variables, without torchrun's start-up cost.

    python tests/multiproc.py N SCRIPT [ARGS...]      (tests build the line with command(n, script, *args))
    python tests/multiproc.py 0 SCRIPT [ARGS...]      (one process, as `python SCRIPT ARGS` runs it)

torchrun starts N fresh interpreters, and each imports torch and the project: about 1.3 s of CPU per rank,
much of a tiny 8-process test's time on two cores. This imports them once, then forks N ranks; each runs
SCRIPT as its __main__ with the variables torchrun sets (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT), so the code under test joins the job as under torchrun without its agent, or
under srun: rank 0 hosts the rendezvous store. As torchrun does, the first rank that fails ends the others
(SIGTERM, then SIGKILL after GRACE_S) and the job exits 1. A rank dies with the launcher (Linux's
parent-death signal). The tests of torchrun's own part (its agent, restarts, signals, failures) start
torchrun itself.

Even one import a job is most of a small job's time (about 2.5 s of a 5 s test), so the test session keeps
one warm server (`--serve NAME`, started by conftest.py, named by MULTIPROC_SERVER) that has imported them
once. A job then asks it: the server forks a launcher that takes over the job's stdin, stdout and stderr
(passed over the socket), its variables, folder, command line, resource limits and umask, and runs the job
exactly as above; the job's exit code comes back. A job runs here instead when its variables would have
changed what the import did (TORCH_LOGS, MKL_..., PYTHON..., TMPDIR; OMP_NUM_THREADS is set after the fork),
when its script sits beside another copy of the project's files, or when no server answers. Killing the
job's process ends its ranks either way. N = 0 is a plain `python SCRIPT ARGS` (no rank variables, the
script's own exit code), which the server starts in a fork too; without it, this process becomes that one.
"""

import contextlib
import ctypes
import json
import os
import resource
import runpy
import select
import signal
import socket
import struct
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GRACE_S = 30.0  # torchrun's own wait between SIGTERM and SIGKILL
SERVER = "MULTIPROC_SERVER"  # the warm server's socket name, if the session runs one
# variables read once, at import or at the first use, and kept: torch's, the C libraries', Python's own,
# and the temporary folder (tempfile keeps the first answer)
READ_AT_IMPORT = ("TORCH", "PYTORCH", "OMP_", "KMP_", "GOMP_", "MKL", "ATEN_", "CUDA", "CUBLAS", "NCCL",
                  "PYTHON", "LD_", "MALLOC", "GLIBC", "TMP", "TEMP", "LANG", "LC_")


def command(n: int, script, *args) -> list[str]:
    """The command line that runs `script` (a path) as a job of n processes (0: one, without the job)."""
    return [sys.executable, str(Path(__file__).resolve()), str(n), str(script), *map(str, args)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def end_with_parent(sig=signal.SIGKILL):
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(1, sig)  # PR_SET_PDEATHSIG


def run_rank(rank: int, n: int, port: int, script: str, args: list[str], threads: int | None):
    """In a forked child: become rank `rank` and run the script; never returns."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(n), LOCAL_WORLD_SIZE=str(n),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    run_script(script, args, threads)


def run_script(script: str, args: list[str], threads: int | None):
    """In a forked child: run the script as its __main__, exiting with its code; never returns. threads:
    torch's thread count, set here, while this is the process's one thread (torch 2.11's thread pool, made
    before a fork, is remade in the child by the first thread that asks, and a second may see none)."""
    end_with_parent()
    if threads:
        import torch
        torch.set_num_threads(threads)
    sys.argv = [script, *args]
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def wait_all(pids: list[int], abandoned=lambda: False) -> int:
    """Every rank's end; at the first failure the others are stopped as torchrun stops them, and all of
    them at once if whoever started the job is gone (`abandoned()`)."""
    left, failed, deadline = set(pids), False, None
    while left:
        for pid in list(left):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                left.discard(pid)
                if os.waitstatus_to_exitcode(status) != 0 and not failed:
                    failed, deadline = True, time.monotonic() + GRACE_S
                    for other in left:
                        os.kill(other, signal.SIGTERM)
        if (deadline is not None and time.monotonic() > deadline) or (left and abandoned()):
            for other in left:
                os.kill(other, signal.SIGKILL)
            failed, deadline = True, None
        time.sleep(0.02)
    return int(failed)


def wait_one(pid: int, abandoned) -> int:
    """A plain process's exit code (negative: the signal that ended it)."""
    while not (ended := os.waitpid(pid, os.WNOHANG))[0]:
        if abandoned():
            os.kill(pid, signal.SIGKILL)
        time.sleep(0.02)
    return os.waitstatus_to_exitcode(ended[1])


def launch(n: int, script: str, args: list[str], abandoned=lambda: False, threads: int | None = None) -> int:
    """Fork the n ranks of one job (0: the plain process) from this process, which has imported the
    project, and wait for them."""
    if n == 0:
        pid = os.fork()
        if pid == 0:
            run_script(script, args, threads)
        return wait_one(pid, abandoned)
    port, pids = free_port(), []
    for rank in range(n):
        pid = os.fork()
        if pid == 0:
            run_rank(rank, n, port, script, args, threads)
        pids.append(pid)
    return wait_all(pids, abandoned)


# ----------------------------------------------------------------------------------------------------
# The warm server and its clients

def send(conn: socket.socket, message: dict, fds=()):
    body = json.dumps(message).encode()
    socket.send_fds(conn, [struct.pack("!Q", len(body))], list(fds))
    conn.sendall(body)


def receive(conn: socket.socket) -> tuple[dict, list[int]]:
    head, fds, _, _ = socket.recv_fds(conn, 8, 3)
    size, body = struct.unpack("!Q", head)[0], b""
    while len(body) < size:
        body += conn.recv(size - len(body)) or sys.exit("multiproc: the client left mid-request")
    return json.loads(body), fds


def ask_server(argv: list[str]) -> int | None:
    """Run this job in the warm server's fork: its exit code, or None when it must run here."""
    try:
        conn = socket.socket(socket.AF_UNIX)
        conn.connect(address(os.environ[SERVER]))
    except (KeyError, OSError):
        return None
    with conn:
        send(conn, {"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ), "limits": limits()},
             fds=(0, 1, 2))
        answer = conn.recv(64).decode()  # blocks until the job ends
    if answer == "":  # the job may have run in part: not run again here
        print("multiproc: the warm server ended without the job's exit code", file=sys.stderr)
        return 1
    return None if answer == "here" else int(answer)


def limits() -> dict:
    """This process's resource limits (a test may lower one, such as the largest file it may write) and
    umask, which the job's launcher takes on."""
    mask = os.umask(0o022)
    os.umask(mask)
    names = [name for name in dir(resource) if name.startswith("RLIMIT_")]
    return {"umask": mask, **{name: resource.getrlimit(getattr(resource, name)) for name in names}}


def take_limits(wanted: dict) -> bool:
    """Take on a client's limits (limits()); False where one cannot be (a hard limit above this one's)."""
    os.umask(wanted.pop("umask"))
    try:
        for name, (soft, hard) in wanted.items():
            if resource.getrlimit(getattr(resource, name)) != (soft, hard):
                resource.setrlimit(getattr(resource, name), (soft, hard))
    except (ValueError, OSError):
        return False
    return True


def served_alike(request: dict) -> bool:
    """Whether this server's import stands for the job's own: the same variables that torch (and Python)
    read at import, and no other copy of the project's files beside the script."""
    env, ours = request["env"], os.environ
    changed = {k for k in set(env) | set(ours) if env.get(k) != ours.get(k)} - {"OMP_NUM_THREADS"}
    folder = Path(request["cwd"], request["argv"][1]).resolve().parent
    beside = folder != REPO and any((folder / p.name).is_file() for p in REPO.glob("*.py"))
    return not beside and not any(k.startswith(READ_AT_IMPORT) for k in changed)


def serve_one(conn: socket.socket) -> int:
    """In the server's fork: become the job's launcher (its files, variables, folder, limits) and report its
    exit code."""
    request, fds = receive(conn)
    if not served_alike(request) or not take_limits(request["limits"]):
        conn.sendall(b"here")
        return 0
    for fd, target in zip(fds, (0, 1, 2)):
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    threads = os.environ.get("OMP_NUM_THREADS")  # read by libgomp when the server imported torch: set again
    n, script, *args = request["argv"]
    sys.path[:0] = [str(Path(script).resolve().parent), str(REPO)]
    try:
        code = launch(int(n), script, args, lambda: bool(select.select([conn], [], [], 0)[0]),
                      int(threads) if threads else None)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    with contextlib.suppress(OSError):
        conn.sendall(str(code).encode())
    return code


def address(name: str) -> str:
    """A socket in Linux's abstract namespace: no file to clean up, no path-length limit."""
    return "\0" + name


def serve(name: str):
    """Import once, then fork a launcher for each job that asks; ends with the process that started it."""
    end_with_parent(signal.SIGTERM)
    sys.path.insert(0, str(REPO))
    import train  # noqa: F401  (torch and the project's modules, imported once for every job)
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(address(name))
    listener.listen(16)
    while True:
        conn, _ = listener.accept()
        if os.fork() == 0:
            listener.close()
            os._exit(serve_one(conn))
        conn.close()
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass


def main() -> int:
    if sys.argv[1] == "--serve":
        serve(sys.argv[2])
    code = ask_server(sys.argv[1:])
    if code is not None:
        if code < 0:  # ended by a signal: end by it too
            signal.signal(-code, signal.SIG_DFL)
            os.kill(os.getpid(), -code)
        return code
    n, script, args = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
    if n == 0:
        os.execv(sys.executable, [sys.executable, script, *args])
    sys.path[:0] = [str(Path(script).resolve().parent), str(REPO)]
    import train  # noqa: F401  (torch and the project's modules, which every rank would import for itself;
    #                            not the script: it runs in each rank as its __main__)
    return launch(n, script, args)


if __name__ == "__main__":
    sys.exit(main())
