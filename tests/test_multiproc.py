"""The tests' own launcher (multiproc.py): a job served by the session's warm server runs as it would run
alone, with its own variables, folder, arguments, limits and exit code, and ends with its caller."""
import contextlib
import os
import resource
import socket
import subprocess
import time
from pathlib import Path

import pytest

import multiproc

REPORT = """
import os, resource, sys
import torch
parent = int(open(f"/proc/{os.getppid()}/stat").read().split(") ")[1].split()[1])  # the launcher's parent
report = [os.environ.get("RANK"), os.environ.get("ASKED"), os.getcwd(), sys.argv[1:], torch.get_num_threads(),
          resource.getrlimit(resource.RLIMIT_FSIZE)[0], parent]
os.write(1, (" ".join(map(str, report)) + "\\n").encode())  # one write: the ranks' lines never interleave
sys.exit(int(sys.argv[1]) if os.environ.get("RANK", "1") == "1" else 0)
"""


@pytest.fixture
def warm(multiproc_server):
    """The server's pid, once it listens (it has imported torch and the project)."""
    for _ in range(600):
        with socket.socket(socket.AF_UNIX) as s, contextlib.suppress(OSError):
            s.connect(multiproc.address(os.environ[multiproc.SERVER]))
            return multiproc_server.pid
        time.sleep(0.1)
    pytest.fail("the warm server never listened")


def run(tmp_path, n, code, **env):
    script = tmp_path / "report.py"
    script.write_text(REPORT)
    hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
    small = lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (10**6, hard))  # in the caller alone
    p = subprocess.run(multiproc.command(n, script, code), capture_output=True, text=True, cwd=tmp_path,
                       env={**os.environ, "ASKED": "yes", "OMP_NUM_THREADS": "1", **env}, preexec_fn=small,
                       timeout=120)
    return p.returncode, sorted(line.split() for line in p.stdout.splitlines())


@pytest.mark.parametrize("n", [0, 2])
def test_a_served_job_runs_as_its_own_process_would(tmp_path, warm, n):
    rc, lines = run(tmp_path, n, 3)
    ranks = ["None"] if n == 0 else ["0", "1"]
    assert rc == (3 if n == 0 else 1)  # a plain process's own code; a job's 1, as torchrun's
    assert [line[0] for line in lines] == ranks
    for line in lines:
        assert line[1:6] == ["yes", str(tmp_path), "['3']", "1", "1000000"]
        assert line[6] == str(warm)  # forked by the server, not started here


def test_a_job_whose_variables_torch_reads_at_import_runs_here(tmp_path, warm):
    rc, lines = run(tmp_path, 2, 0, TORCH_LOGS="-all")
    assert rc == 0 and [line[0] for line in lines] == ["0", "1"]
    assert all(line[6] != str(warm) for line in lines)


def test_a_killed_served_job_ends_its_ranks(tmp_path, warm):
    script = tmp_path / "sleep.py"
    # one write each (atomic on a pipe): two ranks' prints may interleave their text and newline
    script.write_text("import os, time\nos.write(1, f'{os.getpid()}\\n'.encode())\ntime.sleep(600)\n")
    p = subprocess.Popen(multiproc.command(2, script), stdout=subprocess.PIPE, text=True)
    pids = [int(p.stdout.readline()) for _ in range(2)]
    p.kill()
    p.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(Path(f"/proc/{pid}").exists() for pid in pids):
        time.sleep(0.1)
    assert not any(Path(f"/proc/{pid}").exists() for pid in pids)
