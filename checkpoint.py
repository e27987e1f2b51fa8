"""Checkpoints on disk: what a run keeps in its --out-dir, written so that a crash, a full disk or a
second run on the same folder never costs the last good state.

    <out-dir>/.lock           the run using this folder: host, pid, start time (one run at a time)
    <out-dir>/metrics.jsonl   one JSON record per log line, validation and skipped step
    <out-dir>/step_000500/    a complete checkpoint: shard_ppXX_tpYY.pt per (pp, tp) rank, meta.json
                              (step, loader position, flags, model args, layout, tokenizer, chat or
                              not, recipe, data fingerprint, each shard's size and sha256)
    <out-dir>/latest          the name of the newest complete step directory

Read in this order:
  1. Names     step_name, step_dirs: steps sort by number (step_1000000 after step_999999)
  2. Lock      RunLock: one run per out-dir; a dead process's lock on this host is taken over
  3. Shards    save_shards, load_shards, read_full_state: each (pp, tp) rank's parameters under
               global names with their place in the full tensor, loadable into any layout
  4. Saving    save(): each writer writes, hashes and fsyncs its shards in .tmp-step_N; rank 0
               then writes meta.json with their manifest, renames the folder into place, replaces
               `latest`, rotate()s. A failure removes the partial folder, never the last checkpoint.
               AsyncSaver: the same in a background thread, from a copy of the state in host memory;
               Checkpointer: the training loop's phase 7, which decides when, and what a save holds
  5. Finding   read_latest, damage, find_latest, resolve: the checkpoint --resume or --init uses,
               verified by its manifest; a `latest` pointing out of the folder, a damaged step or
               an unlisted shard file (never read) is said out loud
  6. Records   recorded, tokenizer_for: what an --init folder says about itself (above all, its
               tokenizer); load_init: its model args and weights, in any of the three formats
  7. The folder  check_out_dir (before anything is written), clear_run (--overwrite)
  8. Consolidation  consolidate (`python checkpoint.py consolidate`): a checkpoint, or the mean of
               a run's last few, as a Hugging Face folder; export_peft: LoRA adapters, for PEFT
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import random
import re
import shutil
import socket
import sys
import threading
import time
from contextlib import suppress
from dataclasses import asdict, replace
from pathlib import Path

import torch

import data
import launch
import model as M
import parallel as P
import weights


class CheckpointError(Exception):
    """A checkpoint or out-dir problem the user must act on: printed as one line, exit 1."""


# ----------------------------------------------------------------------------------------------------
# 1. Names

STEP_RE = weights.STEP_RE
SHARD_RE = re.compile(r"shard_pp\d+_tp\d+(_ep\d+)?\.pt")  # one per (pp, tp) rank (and ep): section 3


def step_name(step: int) -> str:
    return f"step_{step:06d}"


def step_number(d: Path) -> int:
    return int(STEP_RE.fullmatch(d.name).group(1))


def step_dirs(out_dir: Path) -> list[Path]:
    """The step directories of an out-dir, oldest first by number."""
    found = [d for d in out_dir.glob("step_*") if STEP_RE.fullmatch(d.name) and d.is_dir()]
    return sorted(found, key=step_number)


# ----------------------------------------------------------------------------------------------------
# 2. One run per out-dir


class RunLock:
    """<out-dir>/.lock, made atomically (O_EXCL) by global rank 0, removed when the run ends. A dead
    process's lock on this host is taken over; a live one's, or another host's (uncheckable), stops
    this run before it writes: two runs would delete each other's temporary checkpoints."""

    def __init__(self, out_dir: Path):
        self.out_dir, self.path = Path(out_dir), Path(out_dir) / ".lock"
        self.me = {"host": socket.gethostname(), "pid": os.getpid(),
                   "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        self.held, self.made_dir = False, False

    def acquire(self, say=print):
        try:
            if not self.out_dir.exists():
                self.out_dir.mkdir(parents=True)
                self.made_dir = True
            for _ in range(5):  # another process may take or free the lock between two looks
                if self._create():
                    self.held = True
                    return
                holder = self._holder()
                if holder is None:
                    continue
                if not self._gone(holder):
                    raise CheckpointError(
                        f"{self.out_dir} is in use by another run (pid {holder.get('pid')} on host "
                        f"{holder.get('host')}, since {holder.get('since')}); wait for it to end or choose "
                        f"another --out-dir (if that run is gone, delete {self.path})")
                if self._take_over(holder):
                    say(f"{self.path}: taken over from pid {holder['pid']} on this host, which is no longer "
                        f"running (a crash or a kill left it)")
            raise CheckpointError(f"could not lock {self.out_dir}: other processes keep taking {self.path}")
        except OSError as e:
            raise CheckpointError(f"cannot write to --out-dir {self.out_dir}: {data.one_line(e)}") from None

    def _create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            json.dump(self.me, f)
        return True

    def _holder(self) -> dict | None:
        try:
            holder = json.loads(self.path.read_text())
            return holder if isinstance(holder, dict) else {}
        except FileNotFoundError:
            return None
        except (OSError, ValueError, RecursionError):
            return {}  # unreadable: treated as held, the message says how to clear it

    def _gone(self, holder: dict) -> bool:
        pid = holder.get("pid")
        if holder.get("host") != self.me["host"] or not isinstance(pid, int) or pid <= 0:
            return False
        if pid == self.me["pid"]:
            return False  # this very process holds it (a run inside a run)
        try:
            os.kill(pid, 0)  # signal 0: only asks whether the process exists
        except ProcessLookupError:
            return True
        except PermissionError:  # alive, another user's
            pass
        return False

    def _take_over(self, stale: dict) -> bool:
        """Move the stale lock aside under a name of our own (of two processes doing this at once,
        one rename wins); if what was moved is not that lock (another run took it), put it back."""
        aside = self.path.with_name(f".lock.stale-{self.me['pid']}")
        try:
            os.replace(self.path, aside)
        except FileNotFoundError:
            return False
        try:
            moved = json.loads(aside.read_text())
        except (OSError, ValueError, RecursionError):
            moved = None
        if moved != stale:
            try:
                os.link(aside, self.path)  # fails if a lock exists again: then that one stands
            except OSError:
                pass
        aside.unlink(missing_ok=True)
        return moved == stale

    def release(self):
        """Remove the lock if it is still ours, and the out-dir if this run made it and left it empty."""
        if self.held and self._holder() == self.me:
            self.path.unlink(missing_ok=True)
        self.held = False
        if self.made_dir:
            try:
                self.out_dir.rmdir()
            except OSError:
                pass


def lock_out_dir(out_dir: Path, mesh, say=print) -> RunLock:
    """Global rank 0 takes the out-dir's lock; every rank stops if it could not (rank 0 says why)."""
    lock, error = RunLock(out_dir), None
    if mesh.rank == 0:
        try:
            lock.acquire(say)
        except CheckpointError as e:
            error = e
    if mesh.world > 1 and not P.all_true(error is None, mesh):
        error = error or CheckpointError(f"{out_dir} could not be locked")
    if error is not None:
        raise error
    return lock


# ----------------------------------------------------------------------------------------------------
# 3. The shard files: fp32 masters only, as the model copy is always the master, rounded.

def shard_file(mesh: P.Mesh) -> str:
    ep = f"_ep{mesh.ep_rank:02d}" if mesh.ep > 1 else ""  # (under ep, each block of experts its own file)
    return f"shard_pp{mesh.pp_rank:02d}_tp{mesh.tp_rank:02d}{ep}.pt"


def save_shards(folder: Path, model, opt, mesh: P.Mesh, sync, extra: dict) -> dict:
    """Collective over dp_cp (ZeRO-1 gathers its state to its rank 0); dp_cp rank 0 of each (pp, tp)
    writes one file and returns its manifest entry {name: {bytes, sha256}} (the other ranks: {})."""
    return write_shard(folder, shard_contents(model, opt, mesh, sync, extra), mesh)


def shard_contents(model, opt, mesh: P.Mesh, sync, extra: dict, keep=None) -> dict | None:
    """What this rank's shard file holds: its parameters under global names with their place in the
    full tensor ({"params", "step", **extra}), on dp_cp rank 0 of each (pp, tp); None elsewhere.
    Collective over dp_cp. keep(key, flat) -> a copy in host memory, for a snapshot that training
    may change under (an asynchronous save); without it, views of the optimizer's own buffers."""
    full = sync.gather_optimizer_state() if sync is not None else opt.full_state()
    if mesh.dp_cp_rank >= mesh.ep:  # (under ep, dp ranks 0 .. ep-1: one of each block of experts)
        return None
    if keep is not None:  # ZeRO's gathered state is a fresh host copy already; the live buffers are not
        full = {k: keep(k, v) if v is getattr(opt, k) else v for k, v in full.items()}
    placement = model.tp_placement
    entries = {}
    for i, name in enumerate(opt.names):
        if mesh.ep_rank > 0 and not P.is_expert(name):  # the rest is ep rank 0's to write
            continue
        sl = slice(opt.offsets[i], opt.offsets[i] + opt.params[i].numel())
        shape = opt.params[i].shape
        state = {k: v[sl].view(shape) for k, v in full.items()}
        dim, size = placement.get(name, (None, None))
        start = 0
        if dim is not None:
            local = shape[dim]
            start = mesh.tp_rank * local
            length = max(0, min(local, size - start))  # the vocabulary padding is not saved
            state = {k: v.narrow(dim, 0, length) for k, v in state.items()}
        entries[name] = {"dim": dim, "start": start, "full_size": size, **state}
    return {"params": entries, "step": opt.step_count, **extra}


def write_shard(folder: Path, contents: dict | None, mesh: P.Mesh) -> dict:
    """Write, hash and fsync this rank's shard file (shard_contents; None: this rank writes none);
    its manifest entry {name: {bytes, sha256}}, or {}."""
    if contents is None:
        return {}
    folder.mkdir(parents=True, exist_ok=True)  # each writer makes what it writes (no shared disk assumed)
    with open(folder / shard_file(mesh), "wb") as f:  # through a file: a failed write keeps its OSError
        hashing = HashingWriter(f)
        torch.save(contents, hashing)
        f.flush()
        os.fsync(f.fileno())
    return {shard_file(mesh): {"bytes": hashing.bytes, "sha256": hashing.sha256.hexdigest()}}


class HashingWriter:
    """A file being written, with the sha256 and size of what passed through: the checkpoint's manifest
    comes from its writers, so no rank reads the files back to hash them."""

    def __init__(self, f):
        self.f, self.sha256, self.bytes = f, hashlib.sha256(), 0

    def write(self, b) -> int:
        self.sha256.update(b)
        self.bytes += memoryview(b).nbytes
        return self.f.write(b)

    def flush(self):
        self.f.flush()


STATE_KEYS = ("master", "exp_avg", "exp_avg_sq")


def _assemble(parts: list[dict], keys=STATE_KEYS) -> dict[str, torch.Tensor]:
    """One parameter's full master / moments from its shard entries (one entry when it is not split)."""
    first = parts[0]
    if first["dim"] is None:
        return {k: first[k] for k in keys}
    d, out = first["dim"], {}
    for k in keys:
        shape = list(first[k].shape)
        shape[d] = first["full_size"]
        out[k] = torch.zeros(shape, dtype=first[k].dtype)
        for e in parts:
            out[k].narrow(d, e["start"], e[k].shape[d]).copy_(e[k])
    return out


def manifest_files(folder: Path) -> list[Path]:
    """The shard files a checkpoint's manifest (meta.json) lists, and no other: a stray file beside
    them, even one named like a shard, is never read."""
    meta = json.loads(data.regular_file(Path(folder) / "meta.json", "checkpoint file").read_text())
    names = sorted(meta["files"]) if isinstance(meta, dict) and isinstance(meta.get("files"), dict) else []
    if not names or not all(SHARD_RE.fullmatch(name) for name in names):
        raise ValueError(f"{folder}/meta.json lists no shard files ('files')")
    return [Path(folder) / name for name in names]


def read_full_state(folder: Path, names=None, keys=STATE_KEYS) -> tuple[weights.LazyState, dict]:
    """A checkpoint's shard files (memory-mapped) -> {name: {"master", "exp_avg", "exp_avg_sq"}} (or
    only `keys`) as full tensors, each assembled when looked up, so loading into another layout
    holds one full parameter at a time; plus the first file's extra fields."""
    shards = [torch.load(data.regular_file(f, "checkpoint file"), map_location="cpu", weights_only=True, mmap=True)
              for f in manifest_files(folder)]
    pieces: dict[str, list] = {}
    for s in shards:
        for name, e in s["params"].items():
            if names is None or name in names:
                pieces.setdefault(name, []).append(e)
    full = weights.LazyState({name: (lambda parts=parts: _assemble(parts, keys)) for name, parts in pieces.items()})
    extra = {k: v for k, v in shards[0].items() if k != "params"}
    return full, extra


def load_shards(folder: Path, model, opt, mesh: P.Mesh):
    """Load a checkpoint of any layout into this rank's shards, one parameter at a time: assembled,
    cut to this rank's tp piece, copied into the optimizer's owned ranges, dropped."""
    full, extra = read_full_state(folder, set(opt.names))
    placement = model.tp_placement
    missing = [name for name in opt.names if name not in full]
    if missing:
        raise ValueError(f"checkpoint {folder} has no parameter {missing[0]}")

    def mine(i: int, name: str) -> dict[str, torch.Tensor]:
        shape, out = opt.params[i].shape, {}
        for k, t in full[name].items():
            out[k] = P.local_piece(t, shape, placement.get(name, (None,))[0], mesh)
            if tuple(out[k].shape) != tuple(shape):
                raise ValueError(f"checkpoint {folder}: {name} has shape {tuple(out[k].shape)}, this model "
                                 f"needs {tuple(shape)}")
        return out

    state = weights.LazyState({name: (lambda i=i, name=name: mine(i, name)) for i, name in enumerate(opt.names)})
    opt.load_state_dict({"step": extra["step"], "params": state})
    return extra


def rng_state(device) -> dict:
    """The random states a resume restores: torch's CPU one, Python's, and this process's GPU's
    (every visible GPU's would not load where a process sees fewer)."""
    rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(device)
    return rng


def restore_rng(rng: dict, device):
    torch.set_rng_state(rng["torch"])
    random.setstate(tuple(x if not isinstance(x, list) else tuple(x) for x in rng["python"]))
    state = rng.get("cuda") if device.type == "cuda" else None
    if isinstance(state, (list, tuple)):  # an older checkpoint's list of every visible GPU's state
        state = state[device.index or 0] if (device.index or 0) < len(state) else None
    if state is not None:
        torch.cuda.set_rng_state(state, device)


# ----------------------------------------------------------------------------------------------------
# 4. Saving


def save(out_dir: Path, step: int, mesh, write_shards, meta: dict, keep: int, last_good: Path | None = None,
         dim: str = "io"):
    """Phase 7, on every rank. write_shards(folder) writes this rank's files (save_shards) and
    returns their manifest entries; `meta` joins them in meta.json. If any write fails, every rank
    raises CheckpointError naming `last_good` (resumed from or last written: after a fallback past
    a damaged step, `latest` names the damaged one). Waits on other ranks' disk work, rank 0's
    deletions included, use the "io" group (--io-timeout): hundreds of GB outlast any collective;
    the background writer (AsyncSaver) uses its own, "ckpt"."""
    name = step_name(step)
    tmp, final = out_dir / f".tmp-{name}", out_dir / name
    failure, _ = _agreed(mesh, lambda: _fresh_folder(out_dir, tmp), everyone=False, dim=dim)
    if not failure:
        failure, written = _agreed(mesh, lambda: write_shards(tmp), everyone=True, dim=dim)
        manifest = {file: entry for part in written for file, entry in (part or {}).items()}
    if not failure:
        failure, _ = _agreed(mesh, lambda: _commit(tmp, final, out_dir, meta, manifest), everyone=False,
                             dim=dim)
    if failure:
        if mesh.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        kept = (f"the previous checkpoint ({last_good.name}) is intact and --resume will use it" if last_good
                else "this run has no earlier checkpoint")
        raise CheckpointError(f"could not write checkpoint {final}: {failure}; {kept}")
    if mesh.rank == 0:
        rotate(out_dir, final, keep)
    P.barrier(mesh, dim=dim)


class AsyncSaver:
    """Phase 7 without the wait for the disk (torchtitan and Megatron-LM save so too): start() copies this
    rank's state into host memory (pinned on a GPU, reused from save to save) and returns; a thread then
    writes, hashes, fsyncs and commits it with save()'s guarantees, over a group of its own ("ckpt"),
    while training goes on. The caller waits for one save before starting the next. A failure is agreed
    on by every rank (save's protocol): on_failure(why) hears it from the thread at once, so the loop can
    stop every rank at the same step; wait() raises it."""

    def __init__(self, device: torch.device, on_failure=None):
        self.device, self.on_failure = device, on_failure
        self.host: dict[str, torch.Tensor] = {}  # "master" / "exp_avg" / "exp_avg_sq" -> a flat host buffer
        self.thread, self.error = None, None
        self.last_committed: Path | None = None
        self.written: list[tuple[int, float]] = []  # (step, seconds from start() until it was durable)
        self.alloc_s = 0.0  # seconds spent allocating host buffers (pinning 15 GB for 1B took seconds)

    def keep(self, key: str, flat: torch.Tensor) -> torch.Tensor:
        """shard_contents' copy: into this key's host buffer (a GPU copies into pinned memory as it goes)."""
        buf = self.host.get(key)
        if buf is None or buf.shape != flat.shape or buf.dtype != flat.dtype:
            t0 = time.perf_counter()
            buf = self.host[key] = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=self.device.type == "cuda")
            self.alloc_s += time.perf_counter() - t0
        return buf.copy_(flat, non_blocking=True)

    def start(self, out_dir: Path, step: int, mesh, snapshot, meta: dict, keep: int, last_good: Path | None):
        """snapshot(keep) -> this rank's shard_contents, made with self.keep (collective over dp_cp)."""
        assert self.thread is None, "wait() for the save in flight first"
        t0 = time.perf_counter()
        contents = snapshot(self.keep)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the copies have landed in host memory

        def write():
            try:
                save(out_dir, step, mesh, lambda folder: write_shard(folder, contents, mesh), meta, keep,
                     last_good, dim="ckpt")
                self.last_committed = out_dir / step_name(step)
                self.written.append((step, time.perf_counter() - t0))
            except BaseException as e:  # (a failed collective too: the main thread raises it)
                self.error = e
                if self.on_failure is not None:
                    self.on_failure(data.one_line(e))
        self.thread = threading.Thread(target=write, name=f"checkpoint-{step_name(step)}", daemon=True)
        self.thread.start()

    def wait(self):
        """Until the save in flight is durable; its failure, if it failed, raised here."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.error is not None:
            error, self.error = self.error, None
            raise error


def _agreed(mesh, write, everyone: bool, dim: str = "io") -> tuple[str | None, list]:
    """Run `write` (on every rank, or rank 0) and agree whether it worked: (None or the first
    failing rank's reason, every rank's result in rank order). A full disk, quota or vanished mount
    raises OSError (torch.save: RuntimeError); a failed collective or out-of-memory propagates."""
    reason, result = None, None
    if everyone or mesh.rank == 0:
        try:
            result = write()
        except (launch.CommError, torch.OutOfMemoryError):
            raise
        except (OSError, RuntimeError) as e:
            reason = write_error(e)
    everyone_says = P.all_gather_objects((reason, result), mesh, dim)
    failed = [(rank, why) for rank, (why, _) in enumerate(everyone_says) if why]
    if failed:
        rank, why = failed[0]
        return (why if mesh.world == 1 else f"rank {rank}: {why}"), []
    return None, [r for _, r in everyone_says]


def write_error(e: Exception) -> str:
    """What went wrong in a write, in the operating system's words where there are some: torch.save
    raises 'unexpected pos ...' when the disk fills up, with the OSError as its context."""
    cause = e
    while cause is not None and not isinstance(cause, OSError):
        cause = cause.__cause__ or cause.__context__
    if cause is not None:
        where = f" ({Path(cause.filename).name})" if getattr(cause, "filename", None) else ""
        return f"{cause.strerror or data.one_line(cause)}{where}"
    return data.one_line(e)


def _fresh_folder(out_dir: Path, tmp: Path):
    for stale in out_dir.glob(".tmp-step_*"):  # left by a crash; only this run writes here (RunLock)
        remove(stale)
    tmp.mkdir(parents=True)  # the writers make it too where the out-dir is not one shared disk


def remove(path: Path):
    """Delete whatever is at `path`: a folder with its contents, or a file, link or FIFO."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.is_symlink() or path.exists():
        path.unlink()


def _commit(tmp: Path, final: Path, out_dir: Path, meta: dict, manifest: dict):
    write_durably(tmp / "meta.json", json.dumps({**meta, "files": dict(sorted(manifest.items()))}, indent=1))
    data.fsync(tmp)
    # over an earlier attempt at this step (resumed from an older checkpoint), or whatever else is there
    data.swap_folder(tmp, final, True, f"checkpoint {final.name}")
    try:
        pointer = out_dir / ".latest.tmp"
        write_durably(pointer, final.name + "\n")
        os.replace(pointer, out_dir / "latest")
        data.fsync(out_dir)
    except OSError:
        shutil.rmtree(final, ignore_errors=True)  # `latest` still names the previous one: keep it that way
        raise


def write_durably(path: Path, text: str):
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def write_jsonl(path: Path, records: list[dict]):
    """JSONL, whole or not at all: written beside `path` and renamed over it."""
    tmp = path.with_name(f".{path.name}.tmp")
    with data.writing(path.parent, path, cleanup=[tmp]):
        write_durably(tmp, "".join(json.dumps(r) + "\n" for r in records))
        os.replace(tmp, path)


def rotate(out_dir: Path, newest: Path, keep: int):
    """Keep `newest` and the keep - 1 step directories just below it; delete older ones. Newer ones
    (left only by a resume past damaged ones) stay: the run replaces each when it gets there."""
    older = [d for d in step_dirs(out_dir) if step_number(d) < step_number(newest)]
    for d in older[:max(0, len(older) - (keep - 1))]:
        try:
            remove(d)
        except OSError:  # what cannot be deleted now is tried again at the next rotation
            pass


class Checkpointer:
    """Phase 7 of train.py's step: every --ckpt-every steps, at the last (0: never) and on an early
    stop. A checkpoint holds every rank's shards with global names (section 3), so it loads into any
    layout, plus the random states, the loss scale and meta.json, whose recipe and data fingerprint
    let --resume refuse another recipe or other data. The functions above keep the folder. The step
    waits only for a copy of the state in host memory; the disk is written in the background
    (AsyncSaver; --ckpt-sync: the step waits for the disk too). One save at a time: the next, an early
    stop and the end of the run wait for the one in flight. A background failure reaches every rank
    in the next step's Tally (through `stop`), and wait() raises it, naming the intact checkpoint."""

    def __init__(self, run, start_step: int, recipe, stop: launch.StopFlag, lora: tuple | None):
        # run: train.Run; recipe: its recipe (train.Pretraining); lora: config.lora_of's, or None
        self.run, self.saved_at, self.recipe = run, start_step, recipe
        self.data = run.loader.fingerprint()  # what the data is, so that --resume can refuse other data
        self.lora = lora_record(lora, recipe.init_folder, run.args.seed)
        out = Path(run.args.out_dir)  # the checkpoint a failed save leaves as the good one
        self.committed = out / step_name(start_step) if start_step else None
        self.saver = None if run.args.ckpt_sync else AsyncSaver(run.device, on_failure=stop.fail)
        self.stalls: dict[int, tuple] = {}  # step -> (seconds the step waited, of them allocating)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, kind, error, traceback):
        """The save in flight is waited for, its failure raised, also when an error ends the run (that
        error then goes on: the checkpoint is not lost with the run); not at a second signal ("now")."""
        if kind is None:
            self.wait()
        elif not issubclass(kind, KeyboardInterrupt):
            with suppress(Exception):
                self.wait()

    @property
    def last_good(self) -> Path | None:
        """The newest checkpoint known to be complete on disk."""
        return (self.saver and self.saver.last_committed) or self.committed

    def due(self, step: int) -> bool:
        every = self.run.args.ckpt_every
        return every > 0 and (step % every == 0 or step == self.run.args.max_steps)

    def save(self, step: int, wait: bool = False):
        """Start the save of `step` (unless it was just saved); wait: return once it is on disk. Either
        way a save in flight before it is waited for first, and its failure raised."""
        if step != self.saved_at:
            self.start(step)
        if wait:
            self.wait()

    def start(self, step: int):
        run = self.run
        run.timer.start()  # timed as an entry of its own, apart from the training step
        t0 = time.perf_counter()
        self.wait()  # the save in flight, if any: its host copy is reused, and a failure is raised here
        extra = {"rng": rng_state(run.device), "scaler": run.scaler.state_dict() if run.scaler else None}
        meta = {"step": step, "loader": run.loader.state_dict(), "args": dict(vars(run.args)),  # (as of now)
                "model_args": asdict(run.margs), "tokenizer": run.tok.name, "chat": self.recipe.chat,
                "recipe": self.recipe.kind, "data": self.data, "lora": self.lora,
                "layout": run.mesh.layout.record()}
        out, keep = Path(run.args.out_dir), run.args.keep_ckpts
        if self.saver is None:
            write = lambda folder: save_shards(folder, run.model, run.opt, run.mesh, run.sync, extra)
            save(out, step, run.mesh, write, meta, keep, self.last_good)
            self.committed = out / step_name(step)
            took = time.perf_counter() - t0
            # the step waited for all of it
            run.saves.append({"step": step, "stall_s": took, "write_s": took, "host_alloc_s": 0.0})
        else:
            snapshot = lambda copy: shard_contents(run.model, run.opt, run.mesh, run.sync, extra, copy)
            allocated = self.saver.alloc_s  # (the first save allocates host buffers; later ones reuse them)
            self.saver.start(out, step, run.mesh, snapshot, meta, keep, self.last_good)
            self.stalls[step] = (time.perf_counter() - t0, self.saver.alloc_s - allocated)
        run.timer.mark("7 checkpoint")
        self.saved_at = step

    def wait(self):
        """Until the save in flight is on disk (its timings then join run.saves); its failure raised."""
        if self.saver is None:
            return
        self.saver.wait()
        for step, write_s in self.saver.written:
            stall, alloc = self.stalls.pop(step)
            self.run.saves.append({"step": step, "stall_s": stall, "write_s": write_s, "host_alloc_s": alloc})
        self.saver.written.clear()


# ----------------------------------------------------------------------------------------------------
# 5. Finding the checkpoint to resume or start from


def read_latest(out_dir: Path) -> Path | None:
    """The step directory `latest` names (maybe missing), or None without `latest`. A path into
    another run's folder, not a step directory of this out-dir, is refused, not followed."""
    pointer = Path(out_dir) / "latest"
    if not pointer.exists():
        return None
    if not pointer.is_file():
        raise CheckpointError(f"{pointer} is not a file; move it out of the way")
    try:
        name = pointer.read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"cannot read {pointer}: {data.one_line(e)}") from None
    if not STEP_RE.fullmatch(name):
        raise CheckpointError(f"{pointer} names {name[:100]!r}, which is not a step directory (step_N) of "
                              f"{out_dir}; fix or delete it")
    return Path(out_dir) / name


def read_meta(d: Path) -> dict:
    """A step directory's meta.json, its fields checked: CheckpointError says what is wrong."""
    meta, why = _load_meta(d)
    if why:
        raise CheckpointError(f"checkpoint {d}: {why}")
    return meta


def _load_meta(d: Path) -> tuple[dict | None, str | None]:
    if not (d / "meta.json").is_file():  # (a FIFO would hang the read)
        return None, f"meta.json is {'missing' if not (d / 'meta.json').exists() else 'not a regular file'}"
    try:
        meta = json.loads((d / "meta.json").read_text())
    except (OSError, ValueError, RecursionError) as e:  # (deep nesting: RecursionError, not ValueError)
        return None, f"meta.json unreadable: {type(e).__name__}"
    why = _meta_problem(meta)
    return meta, (f"meta.json malformed: {why}" if why else None)


def _meta_problem(meta) -> str | None:
    if not isinstance(meta, dict):
        return f"a {type(meta).__name__}, not an object"
    for key, kind in (("step", int), ("loader", dict), ("args", dict), ("model_args", dict), ("files", dict)):
        if not isinstance(meta.get(key), kind) or isinstance(meta.get(key), bool):
            return f"{key!r} is {meta.get(key)!r:.60}, not {'an' if kind is int else 'a'} {kind.__name__}"
    consumed = meta["loader"].get("consumed")
    if meta["step"] < 0 or not isinstance(consumed, int) or isinstance(consumed, bool) or consumed < 0:
        return "'step' or the loader's 'consumed' is not a count"
    for key in ("recipe", "data"):  # (older checkpoints lack them)
        if key in meta and not isinstance(meta[key], str):
            return f"{key!r} is {meta[key]!r:.60}, not a string"
    layout = meta.get("layout", {"tp": 1, "pp": 1, "dp": 1})
    if not (isinstance(layout, dict) and all(isinstance(layout.get(k), int) for k in ("tp", "pp", "dp"))):
        return f"'layout' is {layout!r:.60}, not {{tp, pp, dp}}"
    if not meta["files"]:
        return "no manifest ('files' is empty)"
    for name, info in meta["files"].items():
        if not SHARD_RE.fullmatch(name):  # a name such as ../../x would make the check read outside
            return f"the manifest names {name!r:.60}, not a shard file"
        if not (isinstance(info, dict) and isinstance(info.get("bytes"), int)
                and isinstance(info.get("sha256"), str)):
            return f"the manifest entry of {name} is not {{bytes, sha256}}"
    return None


def damage(d: Path, check=None) -> str | None:
    """Why a step directory cannot be used (None: intact): meta.json unreadable or malformed, or a
    shard missing, truncated or altered per its manifest. check: file_problem or shared_check."""
    meta, why = _load_meta(d)
    if why:
        return why
    return (check or file_problem)(d, meta["files"])


def file_problem(d: Path, files: dict) -> str | None:
    """The problem of the first file failing its manifest entry {name: {bytes, sha256}}, or None."""
    for name, info in sorted(files.items()):
        f = d / name
        if not f.is_file():  # (a FIFO or a folder under a shard's name: reading it would hang or fail)
            return f"{name} is {'missing' if not f.exists() else 'not a regular file'}"
        if f.stat().st_size != info["bytes"]:
            return f"{name} has {f.stat().st_size:,} bytes, the manifest says {info['bytes']:,}"
        if data.sha256_file(f) != info["sha256"]:
            return f"{name} does not match its checksum"
    return None


def shared_check(mesh):
    """file_problem split over the job's ranks, for --resume and --init at scale (405B's checkpoint
    is ~4.9 TB: one rank would hash it for hours): rank r checks files r, r + world, ... in name
    order, and every rank gets the first problem found. Collective, on the same folder."""
    if mesh.world == 1:
        return file_problem

    def check(d: Path, files: dict) -> str | None:
        mine = {name: files[name] for name in sorted(files)[mesh.rank::mesh.world]}
        found = [why for why in P.all_gather_objects(file_problem(d, mine), mesh) if why]
        return found[0] if found else None
    return check


def unlisted(d: Path) -> list[str]:
    """Shard files in a step directory its manifest does not name: never read, but said aloud."""
    meta, why = _load_meta(d)
    listed = meta["files"] if not why else {}
    return sorted(f.name for f in Path(d).glob("shard_pp*_tp*.pt") if f.name not in listed)


def find_latest(out_dir: Path, verify: bool = True, check=None) -> tuple[Path | None, list[tuple[str, str]]]:
    """The newest usable checkpoint (`latest`'s, else the newest intact step directory) and
    (name, why) for each newer one passed over. verify=False skips checksums; check: see damage."""
    out_dir = Path(out_dir)
    skipped, seen = [], set()
    named = read_latest(out_dir)
    if named is not None and not named.is_dir():
        skipped.append((named.name, "missing, though `latest` names it"))
        seen.add(named.name)
    candidates = ([named] if named is not None and named.is_dir() else []) + step_dirs(out_dir)[::-1]
    for d in candidates:
        if d.name in seen:
            continue
        seen.add(d.name)
        why = damage(d, check) if verify else _load_meta(d)[1]
        if why is None:
            return d, skipped
        skipped.append((d.name, f"damaged ({why})"))
    return None, skipped


def is_checkpoint(path) -> bool:
    """An out-dir of train.py / sft.py / dpo.py, or one of its step directories."""
    return weights.folder_format(path) == "checkpoint"


def resolve(path, say=print, verify: bool = True, check=None) -> Path:
    """--init, evaluate.py or consolidate's checkpoint argument -> a verified step directory: the
    folder itself, or the out-dir's newest intact one as --resume picks it. verify=False reads
    meta.json alone (the same step if nothing is damaged); check: see damage."""
    path = Path(path)
    if (path / "meta.json").is_file():
        why = damage(path, check) if verify else _load_meta(path)[1]
        if why:
            raise CheckpointError(f"checkpoint {path} is damaged ({why})")
        found = path
    else:
        found, skipped = find_latest(path, verify, check)
        for name, why in skipped:
            say(f"checkpoint {name} is {why}; falling back to an older one")
        if found is None:
            detail = f": {skipped[0][0]} is {skipped[0][1]}" if skipped else ""
            raise CheckpointError(f"no intact checkpoint in {path}{detail}")
    if verify:
        say_unlisted(found, say)
    return found


def last_intact(out_dir, n: int, say=print) -> list[Path]:
    """The newest n intact checkpoints of an out-dir, newest first (damaged ones passed over and
    said), for averaging: they must be one run's (run_of), or it is refused."""
    out_dir = Path(out_dir)
    if not is_checkpoint(out_dir) or (out_dir / "meta.json").is_file():
        raise CheckpointError(f"{out_dir} is not an out-dir of checkpoints (averaging reads several of them)")
    found = []
    for d in step_dirs(out_dir)[::-1]:
        why = damage(d)
        if why:
            say(f"checkpoint {d.name} is damaged ({why}); passed over")
        elif len(found) < n:
            found.append(d)
    if len(found) < n:
        raise CheckpointError(f"{out_dir} holds {len(found)} intact checkpoint(s), fewer than the {n} to "
                              "average (a run keeps --keep-ckpts of them)")
    other = next((d for d in found if run_of(d) != run_of(found[0])), None)
    if other is not None:
        raise CheckpointError(f"{other.name} and {found[0].name} in {out_dir} are not of one run (another "
                              "model, tokenizer, recipe, data or seed): averaging them would mean nothing")
    return found


def run_of(d: Path) -> list:
    """What makes checkpoints one run's: the model's shape, tokenizer, recipe, data and seed."""
    meta = read_meta(d)
    return [meta.get(k) for k in ("model_args", "tokenizer", "recipe", "data")] + [meta["args"].get("seed")]


def say_unlisted(d: Path, say):
    extra = unlisted(d)
    if extra:
        say(f"checkpoint {d}: {', '.join(extra[:4])}{' ...' if len(extra) > 4 else ''} not in its manifest: "
            "ignored (only the manifest's shards are read)")


def resume_point(out_dir: Path, args, margs, mesh, say=print) -> tuple[Path | None, dict | None]:
    """The checkpoint this run continues from and its meta.json (None, None: a fresh start), on
    every rank, all ranks verifying it at once (shared_check). A fresh run never mixes into an
    earlier one's folder: that takes --resume (continue it) or --overwrite (remove it first)."""
    verify = args.resume  # (without --resume only whether something is there matters: no checksums)
    ckpt, skipped = find_latest(out_dir, verify, shared_check(mesh)) if out_dir.is_dir() else (None, [])
    earlier = earlier_run(out_dir)
    if not args.resume and not args.overwrite and (ckpt or skipped or earlier):
        what = f"checkpoint {ckpt.name}" if ckpt else earlier or skipped[0][0]
        raise CheckpointError(f"{out_dir} already holds {what} of an earlier run; pass --resume to continue "
                              "it, --overwrite to start afresh, or another --out-dir")
    if not args.resume:
        return None, None
    for name, why in skipped:
        say(f"checkpoint {name} is {why}; falling back to an older one")
    if ckpt is None and skipped:
        raise CheckpointError(f"no intact checkpoint in {out_dir}: {skipped[0][0]} is {skipped[0][1]}; "
                              "nothing was overwritten")
    if ckpt is None and not skipped:
        say(f"--resume: no checkpoint in {out_dir}, starting from scratch")
    if ckpt is not None:
        say_unlisted(ckpt, say)
    return ckpt, (meta_for(ckpt, margs, args.model) if ckpt else None)


def meta_for(ckpt: Path, margs: M.ModelArgs, model: str | None = None) -> dict:
    """The checkpoint's meta.json, if its model is this run's (`model`: this run's --model, said when they
    differ beside the checkpoint's, which shows where a default came in)."""
    meta = read_meta(ckpt)
    try:
        saved = M.ModelArgs.from_dict(meta["model_args"])
    except ValueError as e:
        raise CheckpointError(f"cannot read checkpoint {ckpt}: its model_args are malformed: "
                              f"{data.one_line(e)}")
    if saved != margs:
        diff = {k: (v, getattr(margs, k)) for k, v in asdict(saved).items() if getattr(margs, k) != v}
        flags = meta.get("args") if isinstance(meta.get("args"), dict) else {}
        theirs = " ".join(f"--{k.replace('_', '-')} {flags[k]}" for k in ("model", "seq_len", "micro_batch")
                          if k in flags)
        said = (f"; it was trained with {theirs}, this run has --model {model}: repeat the flags that shaped it "
                "(a run on a GPU given no flag that sizes it takes the GPU's default model, one given any "
                "flag the CPU's)") if theirs and model else ""
        raise CheckpointError(f"checkpoint {ckpt} is for another model: (checkpoint, this run) differ in "
                              f"{diff}{said}")
    return meta


# ----------------------------------------------------------------------------------------------------
# 6. What a model folder records (tokenizer, seq_len, chat or not), and its weights


def recorded(path) -> dict:
    """{"tokenizer", "seq_len", "vocab_size", "chat", "num_labels"}, each where the folder says it
    (a checkpoint's tokenizer record, else its --tokenizer flag; the "tokenizer" consolidate --hf
    writes in config.json; num_labels: a scoring head's outputs, absent for a language model)."""
    path = Path(path)
    if is_checkpoint(path):  # an out-dir: its newest checkpoint (the one loaded is verified when it is read)
        path = resolve(path, say=lambda msg: None, verify=False)
    name = {"checkpoint": "meta.json", "hf": "config.json", "meta": "params.json"}.get(weights.folder_format(path))
    try:
        found = json.loads((path / name).read_text()) if name and (path / name).is_file() else None  # (a FIFO waits)
    except (OSError, ValueError, RecursionError):
        found = None
    if isinstance(found, dict):
        if name == "meta.json":
            args, margs = (found.get(k) if isinstance(found.get(k), dict) else {}
                           for k in ("args", "model_args"))
            out = {"tokenizer": found.get("tokenizer", args.get("tokenizer")), "seq_len": args.get("seq_len"),
                   "vocab_size": margs.get("vocab_size"), "chat": found.get("chat", "init" in args),
                   "num_labels": margs.get("num_labels")}
        else:  # (a Meta folder's params.json names no architecture: a language model)
            out = {"tokenizer": found.get("tokenizer"), "vocab_size": found.get("vocab_size"),
                   "num_labels": weights.classifier_labels(found)}
        kinds = {"tokenizer": str, "seq_len": int, "vocab_size": int, "chat": bool, "num_labels": int}
        return {k: v for k, v in out.items() if isinstance(v, kinds[k])}
    raise CheckpointError(f"--init {path}: not a checkpoint folder, a Hugging Face folder (config.json) or "
                          "a Meta folder (params.json)")


def check_head(path, flag: str, reward: bool = False):
    """Check, before any weight is read, that `path` (given as `flag`) is a language model, or with
    `reward` a reward model (ModelArgs.num_labels 1). The other kind would run and give nonsense: a
    scoring head's one column sampled as token 0, a vocabulary's logits read as a score."""
    labels = recorded(path).get("num_labels")
    if reward and labels != 1:
        what = "a language model" if labels is None else f"a head of {labels} outputs"
        raise CheckpointError(f"{flag} {path} is not a reward model ({what}): train one with reward.py")
    if not reward and labels is not None:
        raise CheckpointError(f"{flag} {path} is a reward model (a head of {labels} output{'s' * (labels > 1)}, "
                              f"no vocabulary): {flag} takes a language model (a train.py, sft.py, dpo.py or "
                              "rl.py checkpoint, or a Hugging Face causal LM)")


def tokenizer_for(path, requested: str | None, mirror=None, grows: bool = False):
    """The tokenizer of the model in `path`: the one it records, or `requested` if it records none.
    Ids meaning other text than the model learned give numbers that look right and are not, so this
    refuses a differing request, an unrecorded tokenizer for a vocabulary not Llama 3's, and (unless
    the caller `grows` the embedding, as sft.py does) more ids than the model has rows."""
    found = recorded(path)
    name, rows = found.get("tokenizer"), found.get("vocab_size")
    if name is not None and name not in data.TOKENIZERS and Path(name).expanduser().is_file():
        name = data.get_tokenizer(name, mirror).name  # an older checkpoint recorded its --tokenizer path
    if requested is None and name is None:
        if rows is None or rows < data.LLAMA3_RANKS:
            raise CheckpointError(f"--init {path} does not record which tokenizer it was trained with: "
                                  "name it with --tokenizer")
        requested = "llama3"  # a Hugging Face or Meta Llama 3 folder
    try:
        tok = data.get_tokenizer(requested or name, mirror)
    except data.DataError:
        if requested is not None:
            raise
        raise CheckpointError(f"--init {path} was trained with the tokenizer {name}: give its "
                              "tokenizer.model with --tokenizer") from None
    if name is not None and tok.name != name:
        raise CheckpointError(f"--tokenizer {requested}: --init {path} was trained with {name}, whose ids "
                              f"mean other text; drop --tokenizer or give {name}")
    if rows is not None and tok.n_vocab > rows and not grows:
        raise CheckpointError(f"--tokenizer {tok.name} has {tok.n_vocab:,} ids but --init {path} has "
                              f"{rows:,} embedding rows")
    return tok


def load_init(path, tok, verify: bool = True) -> tuple[M.ModelArgs, dict]:
    """--init -> (model args, full state dict), from any of the three formats. A checkpoint is
    verified as --resume does, unless verify=False: for a job whose ranks have verified it."""
    path = Path(path)
    if is_checkpoint(path):
        path = resolve(path, verify=verify)
    found = weights.folder_format(path)
    try:
        if found == "checkpoint":
            margs, state = checkpoint_state(path, tok, verify)
        elif found == "hf":  # read lazily: each rank reads only the weights it keeps
            margs, state = weights.hf_state(path)
        elif found == "meta":
            model = weights.load_meta(path)
            margs, state = model.args, model.state_dict()
        else:
            raise CheckpointError(f"--init {path}: not a checkpoint folder, a Hugging Face folder "
                                     "(config.json) or a Meta folder (params.json)")
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"cannot read --init {path}: {type(e).__name__}: {data.one_line(e)}")
    if tok is not None and tok.n_vocab > margs.vocab_size:
        margs, state = grow_vocab(margs, state, tok.n_vocab)
    return margs, state


def checkpoint_args(step: Path) -> M.ModelArgs:
    return M.ModelArgs.from_dict(read_meta(step)["model_args"])


def checkpoint_state(step: Path, tok=None, verify: bool = True) -> tuple[M.ModelArgs, weights.LazyState]:
    """A checkpoint's model args and weights (fp32 masters, each read when looked up), without what
    only training keeps (M.TRAINING_ONLY). A LoRA checkpoint holds its adapters alone: each adapted
    weight is then the model it adapts (lora_base) merged with them, W + (alpha / r) B A."""
    margs, lora = checkpoint_args(step), read_meta(step).get("lora")
    full, _ = read_full_state(step, keys=("master",))
    master = lambda name: (lambda: full[name]["master"])
    state = {name: master(name) for name in full
             if not name.startswith(M.TRAINING_ONLY) and not M.is_lora(name)}
    if lora:
        base, scale = lora_base(lora, margs, tok, verify), lora["alpha"] / lora["rank"]
        merged = lambda name, linear: (lambda: M.merge_lora(base[name], full[f"{linear}.lora_A"]["master"],
                                                            full[f"{linear}.lora_B"]["master"], scale))
        for name in base:
            linear = name.removesuffix(".weight")
            if f"{linear}.lora_A" in full:
                state[name] = merged(name, linear)
            else:  # (a head trained whole is the run's own)
                state.setdefault(name, lambda name=name: base[name])
    if margs.tie_embeddings:
        state["output.weight"] = state["tok_embeddings.weight"]
    return margs, weights.LazyState(state)


def lora_record(lora: tuple | None, base: Path | None, seed: int) -> dict | None:
    """What a LoRA checkpoint needs to become a model again (checkpoint_state): its adapters'
    settings and the model they adapt: `base` (absolute, fingerprinted; a folder without a manifest
    also lists its weight files, so that a change can be told from a touch), or the one --seed draws."""
    if lora is None:
        return None
    rank, alpha, targets = lora
    base = Path(base).expanduser().resolve() if base else None
    files = weight_files(base) if base and not (base / "meta.json").is_file() else None
    return {"rank": rank, "alpha": alpha, "targets": list(targets), "seed": seed,
            "base": str(base) if base else None, "base_fingerprint": fingerprint(base) if base else None,
            **({"base_files": files} if files is not None else {})}


BASE_RECORD = ("base_fingerprint", "base_files")  # how a record knows its base, checked by unchanged_base


def weight_files(folder: Path) -> dict:
    """{name: [size, modification time in ns]} of a model folder's weight files."""
    return {f.name: [f.stat().st_size, f.stat().st_mtime_ns] for f in sorted(Path(folder).iterdir())
            if f.suffix in (".safetensors", ".pth", ".bin")}


def fingerprint(folder: Path) -> str:
    """What identifies the weights in a model folder without reading them: a checkpoint's manifest
    (each shard's sha256), else the name, size and modification time of each weight file."""
    folder = Path(folder)
    listed = read_meta(folder)["files"] if (folder / "meta.json").is_file() else weight_files(folder)
    return hashlib.sha256(json.dumps(listed, sort_keys=True).encode()).hexdigest()[:16]


def unchanged_base(lora: dict) -> Path | None:
    """The folder a LoRA checkpoint adapts (None: the model drawn from its seed), refused if it is
    gone or its weight files have changed since training: said to have changed where names or sizes
    differ, to may have changed where only their modification times moved (no bytes were read)."""
    if lora["base"] is None:
        return None
    base = Path(lora["base"])
    if not base.exists():
        raise CheckpointError(f"this LoRA checkpoint adapts {base}, which is gone: the adapters alone are "
                              "no model")
    if lora.get("base_fingerprint") not in (None, fingerprint(base)):
        sizes = lambda files: {name: size for name, (size, _) in (files or {}).items()}
        if lora.get("base_files") is not None and sizes(lora["base_files"]) == sizes(weight_files(base)):
            raise CheckpointError(f"this LoRA checkpoint adapts {base}, whose weight files may have changed "
                                  "since it was trained: the same files at the same sizes, modified since "
                                  "(touched, copied back, or another model of the same shape saved there); the "
                                  "adapters belong to the model that was there: if these are its bytes, give "
                                  "the files back their modification times (as `cp -p` keeps them)")
        raise CheckpointError(f"this LoRA checkpoint adapts {base}, whose weight files have changed since "
                              "it was trained: the adapters belong to the model that was there")
    return base


def lora_base(lora: dict, margs: M.ModelArgs, tok, verify: bool):
    """The weights a LoRA checkpoint adapts, lazily: the folder it records (unchanged since), read as any
    --init is, or the model drawn from its seed."""
    base = unchanged_base(lora)
    if base is not None:
        return load_init(base, tok, verify)[1]
    with torch.device("meta"):
        shapes = {name: p.shape for name, p in M.Transformer(margs).named_parameters()}
    return weights.LazyState({name: (lambda name=name, shape=shape: M.init_tensor(margs, name, shape, lora["seed"]))
                        for name, shape in shapes.items()})


def with_room_for(margs: M.ModelArgs, n_vocab: int) -> M.ModelArgs:
    """The model args with a row for each of n_vocab ids (rounded up to 64 rows)."""
    if n_vocab <= margs.vocab_size:
        return margs
    return replace(margs, vocab_size=64 * ((n_vocab + 63) // 64))


def grow_vocab(margs: M.ModelArgs, state: dict, n_vocab: int) -> tuple[M.ModelArgs, dict]:
    """Add embedding and output rows for ids the model has never seen (e.g. sft.py's chat tokens).
    New rows start at the mean of the existing rows (Hewitt 2021): a new token begins as an
    'average' token, and its logit as the mean logit, not as noise of an unrelated scale."""
    grown = with_room_for(margs, n_vocab)
    state = collections.ChainMap({}, state)  # the grown tensors over the rest (a lazy state stays lazy)
    for name in ("tok_embeddings.weight", "output.weight")[:1 if margs.num_labels else 2]:  # (not a score)
        if name in state:
            w = state[name]
            state[name] = torch.cat([w, w.mean(dim=0, keepdim=True).expand(grown.vocab_size - w.shape[0],
                                                                           -1)])
    print(f"vocabulary grown from {margs.vocab_size} to {grown.vocab_size} rows (new rows = mean of the old)",
          flush=True)
    return grown, state


# ----------------------------------------------------------------------------------------------------
# 7. The out-dir itself

RUN_FILES = ("latest", "metrics.jsonl", ".latest.tmp")


def check_out_dir(out_dir: Path):
    """Before writing: refuse a non-folder out-dir, or a non-file where a run file goes."""
    if out_dir.exists() and not out_dir.is_dir():
        raise CheckpointError(f"--out-dir {out_dir} exists and is not a folder")
    for name in RUN_FILES + (".lock",):
        f = out_dir / name
        if f.exists() and not f.is_file():
            raise CheckpointError(f"{f} is not a file; move it out of the way")


def earlier_run(out_dir: Path) -> str | None:
    """What an earlier run left here, in a few words, or None: a fresh run must not mix into it."""
    steps = step_dirs(out_dir) if out_dir.is_dir() else []
    if steps:
        return f"checkpoint {steps[-1].name}"
    if (out_dir / "latest").exists():
        return "latest"
    # a log with records: a run that stopped before its first step leaves an empty one, which is no run
    if (out_dir / "metrics.jsonl").is_file() and (out_dir / "metrics.jsonl").stat().st_size:
        return "metrics.jsonl"
    return None


def clear_run(out_dir: Path) -> list[str]:
    """--overwrite: remove an earlier run's step directories (finished or not), `latest` and
    metrics.jsonl, so none is resumed, rotated in or mixed into new metrics; returns their names."""
    gone = [*step_dirs(out_dir), *out_dir.glob(".tmp-step_*")]
    gone += [out_dir / n for n in RUN_FILES if (out_dir / n).is_file()]
    for p in gone:
        remove(p)
    return [p.name for p in gone]


# ----------------------------------------------------------------------------------------------------
# 8. Consolidation: a checkpoint (or the mean of a run's last few) -> one Hugging Face folder


def consolidate(folder: Path, hf: Path, tokenizer=None, chat: bool = False, average: list[Path] = ()):
    """A sharded checkpoint -> a Hugging Face folder (read by --init, as by transformers), recording
    and carrying its `tokenizer`. With `average` (other checkpoints of the run), each weight is the
    fp32 mean of all (Polyak averaging), a parameter at a time: never N models in memory."""
    folder = Path(folder)
    meta = json.loads(data.regular_file(folder / "meta.json", "checkpoint file").read_text())
    states = [checkpoint_state(f, tokenizer, verify=False)[1] for f in [folder, *average]]
    model = weights.empty_model(M.ModelArgs.from_dict(meta["model_args"]))
    mean = lambda name: sum(state[name].float() for state in states) / len(states)
    model.load_state_dict({name: states[0][name] if not average else mean(name) for name in states[0]})
    if tokenizer is None:
        weights.save_hf(model, hf)
    else:
        files = weights.hf_tokenizer_files(tokenizer, chat, model.args.max_seq_len)
        weights.save_hf(model, hf, weights.hf_tokens(tokenizer, chat), files)
    return model


PEFT_EXPORT_FILES = ("adapter_model.safetensors", "adapter_config.json")
PEFT_NAMES = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj", "w1": "gate_proj",
              "w2": "down_proj", "w3": "up_proj"}


def export_peft(folder: Path, out: Path):
    """A LoRA checkpoint's adapters alone, as PEFT saves them (adapter_model.safetensors: the
    Hugging Face module's name, then lora_A.weight (r, in) and lora_B.weight (out, r);
    adapter_config.json), for PeftModel.from_pretrained(base, out) on the Hugging Face export of the
    model they adapt. base_model_name_or_path names that model if it is a Hugging Face folder (PEFT
    loads no other); else none (the README: export the base with --hf first)."""
    meta, (full, _) = read_meta(folder), read_full_state(folder, keys=("master",))
    lora = meta.get("lora")
    if not lora:
        raise CheckpointError(f"{folder} is not a LoRA checkpoint (no --lora-rank): export it whole with --hf")
    if any(not M.is_lora(name) and not name.startswith(M.TRAINING_ONLY) for name in full):
        raise CheckpointError(f"{folder} trains a head whole beside its adapters (a reward model): export it "
                              "merged with --hf")
    base = unchanged_base(lora)
    loadable = base is not None and not is_checkpoint(base) and (base / "config.json").is_file()
    def theirs(name):  # layers.0.attention.wq.lora_A -> base_model.model.(its HF module).lora_A.weight
        linear, factor = name.rsplit(".", 1)
        return f"base_model.model.{weights.hf_name(linear + '.weight').removesuffix('.weight')}.{factor}.weight"
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora["rank"], "lora_alpha": lora["alpha"],
              "target_modules": sorted(PEFT_NAMES[t] for t in lora["targets"]), "lora_dropout": 0.0,
              "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
              "base_model_name_or_path": str(base) if loadable else None}
    adapters = {theirs(name): full[name]["master"] for name in full if M.is_lora(name)}
    weights.write_export(out, {"adapter_model.safetensors": adapters}, {"adapter_config.json": config},
                   PEFT_EXPORT_FILES)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Tools for sharded checkpoints.")
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("consolidate", help="merge a checkpoint's shards into a Hugging Face folder",
                       formatter_class=launch.HelpFormatter)
    c.add_argument("checkpoint", help="a step directory, or an --out-dir (its newest intact checkpoint)")
    out = c.add_mutually_exclusive_group(required=True)
    out.add_argument("--hf", help="write a Hugging Face Llama folder here (a LoRA checkpoint: merged)")
    out.add_argument("--peft", help="write a LoRA checkpoint's adapters alone here, in PEFT's layout")
    c.add_argument("--tokenizer", help="the tokenizer.model of a checkpoint trained with a custom one")
    c.add_argument("--average-last", type=int, default=1, metavar="N",
                   help="write the mean of the out-dir's last N intact checkpoints (Llama 3 averaged those "
                        "of its annealing; the run must keep them: --keep-ckpts)")
    a = p.parse_args(argv)
    try:
        say = lambda msg: print(msg, file=sys.stderr)
        if a.average_last < 1 or (a.peft and a.average_last > 1):
            raise CheckpointError(f"--average-last {a.average_last}: at least 1, and 1 with --peft (the "
                                  "mean of adapters is not the mean of the models: average them with --hf)")
        ckpts = ([resolve(a.checkpoint, say=say)] if a.average_last == 1 else
                 last_intact(a.checkpoint, a.average_last, say))
        ckpt = ckpts[0]
        tok = tokenizer_for(ckpt, a.tokenizer)
        if a.peft:
            export_peft(ckpt, Path(a.peft))
        else:
            consolidate(ckpt, Path(a.hf), tok, recorded(ckpt).get("chat", False), ckpts[1:])
    except (CheckpointError, data.DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except (OSError, RuntimeError, ValueError) as e:  # unreadable shards, an unwritable --out: the reason
        print(f"error: cannot consolidate {a.checkpoint}: {type(e).__name__}: {data.one_line(e)}",
              file=sys.stderr)
        return 1
    averaged = f" (the mean of {', '.join(c.name for c in ckpts)})" if len(ckpts) > 1 else ""
    print(f"consolidated {ckpt}{averaged} -> {a.hf or a.peft} (tokenizer {tok.name})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
