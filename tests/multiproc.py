"""Start a multi-process job for the tests: torchrun's variables, without torchrun's start-up cost.

    python tests/multiproc.py N SCRIPT [ARGS...]      (tests build the line with command(n, script, *args))

torchrun starts N fresh interpreters, and each imports torch and the project: about 1.3 s of CPU per rank,
much of a tiny 8-process test's time on two cores. This imports them once, then forks N ranks; each runs
SCRIPT as its __main__ with the variables torchrun sets (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT), so the code under test joins the job as under torchrun without its agent, or
under srun: rank 0 hosts the rendezvous store. As torchrun does, the first rank that fails ends the others (SIGTERM, then SIGKILL after GRACE_S) and the job exits 1.
A rank dies with the launcher (Linux's parent-death signal). The tests of torchrun's own part (its agent,
restarts, signals, failures) start torchrun itself.
"""

import ctypes
import os
import runpy
import signal
import socket
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GRACE_S = 30.0  # torchrun's own wait between SIGTERM and SIGKILL


def command(n: int, script, *args) -> list[str]:
    """The command line that runs `script` (a path) as a job of n processes."""
    return [sys.executable, str(Path(__file__).resolve()), str(n), str(script), *map(str, args)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_rank(rank: int, n: int, port: int, script: str, args: list[str]):
    """In a forked child: become rank `rank` and run the script; never returns."""
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: end with the launcher
    except (OSError, AttributeError):
        pass
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(n), LOCAL_WORLD_SIZE=str(n),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
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


def wait_all(pids: list[int]) -> int:
    """Every rank's end; at the first failure the others are stopped as torchrun stops them."""
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
        if deadline is not None and time.monotonic() > deadline:
            for other in left:
                os.kill(other, signal.SIGKILL)
            deadline = None
        time.sleep(0.02)
    return int(failed)


def main() -> int:
    n, script, args = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
    sys.path[:0] = [str(Path(script).resolve().parent), str(REPO)]
    import train  # noqa: F401  (torch and the project's modules, which every rank would import for itself;
    #                            not the script: it runs in each rank as its __main__)
    port, pids = free_port(), []
    for rank in range(n):
        pid = os.fork()
        if pid == 0:
            run_rank(rank, n, port, script, args)
        pids.append(pid)
    return wait_all(pids)


if __name__ == "__main__":
    sys.exit(main())
