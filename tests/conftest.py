"""Shared test set-up: import path, the data files, and caches that never touch the tests' own results.

The data files come from a mirror folder: DATA_MIRROR if set, else <repo>/../shared/data if it exists.
Without either, the tests fetch them once from their public URLs through the project's own downloader
(data.fetch, evaluate.fetch_benchmark: pinned, checksummed) into <data cache>/test-mirror, laid out as a
mirror; with no internet either, the session stops with one line saying what to provide.
DATA_CACHE then becomes a fresh temporary folder, and TIKTOKEN_CACHE_DIR (if unset) a writable temporary
copy of <mirror>/tiktoken_cache (without one, tiktoken fetches its own files). The variables are set in
os.environ, so subprocesses (torchrun, train.py) see them too.

The session also starts tests/multiproc.py's warm server, which has imported torch and the project once, so
that each of its jobs (multi-process, or one plain process) forks from it instead of importing them again
(MULTIPROC_SERVER names it).
"""
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
SHARED = REPO.parent / "shared" / "data"


def downloaded_mirror() -> Path:
    """Every registry file the tests read, fetched (once: the downloads are cached) and laid out as a mirror
    in <data cache>/test-mirror."""
    import data
    import evaluate
    root = data.cache_dir() / "test-mirror"
    entries = [(entry["mirror"], lambda name=name: data.fetch(name))
               for name, entry in data.registry().items()]
    for entry in evaluate.BENCHMARKS.values():
        for e in (entry, entry.get("labels")):
            if e:
                entries.append((e["mirror"], lambda e=e: evaluate.fetch_benchmark(e)))
    for where, fetch in entries:
        if not (root / where).is_file():
            (root / where).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(fetch(), root / where)
    return root


def find_mirror() -> Path:
    if os.environ.get("DATA_MIRROR"):
        return Path(os.environ["DATA_MIRROR"]).resolve()
    if SHARED.is_dir():
        return SHARED.resolve()
    import data
    try:
        return downloaded_mirror()
    except data.DataError:  # the failed tries are on stderr above
        pytest.exit("the tests need the data files: there is no mirror folder and downloading failed; set "
                    "DATA_MIRROR to a folder holding them, or run with internet access", returncode=1)


@pytest.fixture(scope="session", autouse=True)
def data_env(tmp_path_factory):
    patch = pytest.MonkeyPatch()
    mirror = find_mirror()
    patch.setenv("DATA_MIRROR", str(mirror))
    patch.setenv("DATA_CACHE", str(tmp_path_factory.mktemp("data_cache")))
    if not os.environ.get("TIKTOKEN_CACHE_DIR") and (mirror / "tiktoken_cache").is_dir():
        tiktoken_cache = tmp_path_factory.mktemp("tiktoken_cache")
        for f in (mirror / "tiktoken_cache").iterdir():  # copyfile, not copytree: keep the copy writable
            shutil.copyfile(f, tiktoken_cache / f.name)
        patch.setenv("TIKTOKEN_CACHE_DIR", str(tiktoken_cache))
    yield mirror
    patch.undo()


@pytest.fixture(scope="session")
def mirror(data_env) -> Path:
    if not data_env.is_dir():
        pytest.fail(f"no data mirror at {data_env}: set DATA_MIRROR to a folder laid out like the registry's "
                    "mirror paths")
    return data_env


@pytest.fixture(scope="session", autouse=True)
def multiproc_server(data_env):
    """The warm server for tests/multiproc.py's jobs, with the variables the jobs inherit; OMP_NUM_THREADS
    is left out, as a job sets its own after the fork. Jobs that start before it listens run on their own."""
    folder = Path(tempfile.mkdtemp(prefix="multiproc-"))
    name = folder.name  # unique while the folder exists
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    with open(folder / "server.log", "wb") as log:
        serve = [sys.executable, str(REPO / "tests" / "multiproc.py"), "--serve", name]
        server = subprocess.Popen(serve, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    patch = pytest.MonkeyPatch()
    patch.setenv("MULTIPROC_SERVER", name)
    yield server
    patch.undo()
    server.terminate()
    server.wait(timeout=30)
    shutil.rmtree(folder, ignore_errors=True)
