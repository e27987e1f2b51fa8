"""Shared test set-up: import path, the offline data mirror, and caches that never touch $HOME.

DATA_MIRROR is taken from the environment if set, else <repo>/../shared/data. DATA_CACHE becomes a fresh
temporary folder, and TIKTOKEN_CACHE_DIR (if unset) a writable temporary copy of <mirror>/tiktoken_cache.
The variables are set in os.environ, so subprocesses (torchrun, train.py) see them too.
"""
import os
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
MIRROR = Path(os.environ.get("DATA_MIRROR") or REPO.parent / "shared" / "data").resolve()


@pytest.fixture(scope="session", autouse=True)
def data_env(tmp_path_factory):
    patch = pytest.MonkeyPatch()
    patch.setenv("DATA_MIRROR", str(MIRROR))
    patch.setenv("DATA_CACHE", str(tmp_path_factory.mktemp("data_cache")))
    if not os.environ.get("TIKTOKEN_CACHE_DIR") and (MIRROR / "tiktoken_cache").is_dir():
        tiktoken_cache = tmp_path_factory.mktemp("tiktoken_cache")
        for f in (MIRROR / "tiktoken_cache").iterdir():  # copyfile, not copytree: keep the copy writable
            shutil.copyfile(f, tiktoken_cache / f.name)
        patch.setenv("TIKTOKEN_CACHE_DIR", str(tiktoken_cache))
    yield
    patch.undo()


@pytest.fixture(scope="session")
def mirror() -> Path:
    if not MIRROR.is_dir():
        pytest.fail(f"no data mirror at {MIRROR}: set DATA_MIRROR to a folder laid out like shared/data")
    return MIRROR
