"""Joining a job and living in it: the plumbing every distributed script shares, which a learner may
skip. It imports no file of the project.

  launch_env        torchrun's RANK, WORLD_SIZE, MASTER_ADDR..., checked (LaunchError, one line)
  join_job          the job's process group through the rendezvous: NCCL on a GPU, gloo on a CPU
  set_timeout       how long collectives wait; patient() lets the first step (which every rank
                    compiles at its own speed) wait as long as the disk waits do
  run_collective    a collective whose failure is one CommError (the op, the group, its ranks, how
                    long it waited), and (Work) its asynchronous handle, whose wait does the same; a
                    traced step records its span (costs.StepTrace)
  exit_with_agent   a worker whose torchrun agent was killed ends too, freeing its GPU
  configure_process the process-wide settings, once, from a command line: seeds, GPU, TF32,
                    --deterministic; say() prints once per job (global rank 0)
  StopFlag          preemption (SIGTERM, Ctrl-C) as a flag the training loop reads at each step
  HelpFormatter     every script's --help: each flag's default, where it has one its help leaves unsaid
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import platform
import random
import re
import signal
import socket
import sys
import threading
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist

class LaunchError(RuntimeError):
    """Not started as part of a job (torchrun's variables wrong or missing): said by every rank that
    finds it, since its rank may not be known."""

    def __init__(self, why: str):
        super().__init__(f"cannot join the job: {why}")


def launch_env() -> tuple[int, int]:
    """(rank, world size) from torchrun's variables, checked, since a wrong or missing one would be
    a ValueError traceback or a wait for peers that never come. No WORLD_SIZE: one process."""
    def whole(name: str, default: int | None) -> int | None:
        text = os.environ.get(name)
        if text is None or not text.strip():
            return default
        if not text.strip().isdigit():
            raise LaunchError(f"{name}={text[:40]!r} is not a whole number >= 0")
        return int(text)
    launch = "start the processes with torchrun (e.g. torchrun --standalone --nproc_per_node=N ...)"
    world = whole("WORLD_SIZE", 1)
    rank = whole("RANK", 0 if world == 1 else None)
    if world < 1 or rank is None or rank >= world:
        raise LaunchError(f"RANK={os.environ.get('RANK')} and WORLD_SIZE={os.environ.get('WORLD_SIZE')} do "
                          f"not name a process of a job (0 <= RANK < WORLD_SIZE): {launch}")
    local_rank, local_world = whole("LOCAL_RANK", 0), whole("LOCAL_WORLD_SIZE", None)
    if local_world is not None and not local_rank < local_world <= world:
        raise LaunchError(f"LOCAL_RANK={local_rank} and LOCAL_WORLD_SIZE={local_world} do not name a process of "
                          f"this node (0 <= LOCAL_RANK < LOCAL_WORLD_SIZE <= WORLD_SIZE {world}): {launch}")
    if world > 1:
        addr, port = os.environ.get("MASTER_ADDR", "").strip(), whole("MASTER_PORT", None)
        if not addr or port is None or not 0 < port < 65536:
            raise LaunchError(f"WORLD_SIZE={world} needs MASTER_ADDR (a host) and MASTER_PORT (1-65535); "
                              f"got {addr or 'none'!r} and {os.environ.get('MASTER_PORT')!r}: {launch}")
        try:
            socket.getaddrinfo(addr, port)
        except (socket.gaierror, UnicodeError):
            raise LaunchError(f"MASTER_ADDR={addr[:80]!r} is not a host this machine can find") from None
    return rank, world


def join_job(rank: int, world: int, device, timeout_s: float):
    """The job's process group, through the rendezvous at MASTER_ADDR:MASTER_PORT. A peer that never
    comes (a wrong address or port, a rank not started) fails after timeout_s as one CommError."""
    options = process_group_options(device, timeout_s)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    try:
        if restart is None:
            dist.init_process_group(**options)
        else:
            # torchrun's rendezvous store outlives a restart: without a prefix per attempt, the new
            # attempt would read the failed one's keys (peers' addresses for every group).
            agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                                  is_master=not agent_hosts and rank == 0, timeout=options["timeout"])
            dist.init_process_group(store=dist.PrefixStore(f"attempt{restart}", store), rank=rank,
                                    world_size=world, **options)
    except (RuntimeError, ValueError, OSError) as e:  # (DistNetworkError and DistStoreError: RuntimeErrors)
        where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        raise CommError(f"could not join the job of {world} processes at {where} (--dist-timeout "
                        f"{timeout_s:g} s): {' '.join(str(e).split())[:300]}") from None


def leave_job():
    """The end of a process that joined the job: every rank past its last collective (a barrier), then
    the process groups destroyed, and whatever still refers to them collected while the interpreter is
    whole. A gloo group torn down while a peer's transfer is in flight, or left to the interpreter's
    exit, can abort the process after its work is done ("terminate called without an active
    exception": a worker thread destroyed while joinable)."""
    if not dist.is_initialized():
        return
    try:
        dist.barrier()
    except RuntimeError:  # a peer already gone: nothing is left in flight with it
        pass
    gc.collect()  # (cycles holding tensors or work of the groups: freed before the groups go)
    dist.destroy_process_group()
    gc.collect()


def process_group_options(device: torch.device | None, timeout_s: float) -> dict:
    """gloo on CPU; NCCL on CUDA, bound to this process's GPU from the start (device_id): otherwise
    NCCL guesses the GPU from the rank, wrongly wherever ranks and GPUs are numbered differently."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if device is not None and device.type == "cuda":
        return {"backend": "nccl", "device_id": device, "timeout": timeout}
    return {"backend": "gloo", "timeout": timeout}


# The gloo groups for waits on disk work, bounded by --io-timeout: "io" for the main thread's, "ckpt" for
# the background checkpoint writer's (parallel.init_mesh)
LONG_GROUPS = ("io", "ckpt")


def set_timeout(mesh, seconds: float):
    """How long every group's collectives but the io group's may wait from now on.
    ProcessGroup.set_timeout sets it in each of the group's backends (torch 2.14's dist.set_timeout
    calls it and deprecates the private _set_pg_timeout, the only one torch 2.5 has)."""
    timeout = datetime.timedelta(seconds=seconds)
    for group in [dist.group.WORLD] + [g for dim, g in mesh.groups.items() if dim not in LONG_GROUPS]:
        if hasattr(group, "set_timeout"):
            group.set_timeout(timeout)
        else:
            dist.distributed_c10d._set_pg_timeout(timeout, group)


@contextmanager
def patient(mesh):
    """Inside, collectives may wait --io-timeout, not --dist-timeout: in the first step, which each
    rank compiles as it runs it (--compile's graphs, GPU kernels), a rank that compiles slower or
    misses a cache its peers hit can keep the others waiting minutes, which is not a stall."""
    if mesh.world == 1 or mesh.patient:
        yield
        return
    set_timeout(mesh, mesh.io_timeout_s)
    mesh.patient = True
    try:
        yield
    finally:
        set_timeout(mesh, mesh.timeout_s)
        mesh.patient = False


class CommError(RuntimeError):
    """A failed collective or transfer (a peer stalled past the timeout, or died), naming the op,
    the group and its ranks: the log says where the job stopped, not only that it did. Under gloo
    the failing call raises it; on a timeout NCCL's watchdog thread ends the process, naming the op
    and the group (its new_group name: tp / pp / dp)."""


def raise_comm_error(e: Exception, what, mesh, dim: str, t0: float):
    """Raise CommError for `e`. what: (op, tensor or None), described only on failure, so the hot
    path formats nothing. Out of memory, not a communication failure, is re-raised as is."""
    if isinstance(e, torch.OutOfMemoryError):
        raise e
    op, t = what
    what = f"{op} of {tuple(t.shape)}" if t is not None else op
    first = (str(e).strip().splitlines() or [type(e).__name__])[0]
    cause = re.sub(r"^\[[^\]]*\]\s*", "", first)  # drop gloo's "[file.cc:78] "
    cause = cause.split(". This is typically")[0][:300]
    waited = time.monotonic() - t0
    hint = ("a rank in this group stalled (a stack dump of it, e.g. `py-spy dump --pid`, shows where)"
            if waited >= 0.9 * (mesh.io_timeout_s if dim in LONG_GROUPS or mesh.patient else mesh.timeout_s)
            or "timed out" in cause.lower() else "a rank in this group died or failed; its own log says why")
    limit = f"--dist-timeout {mesh.timeout_s:g} s"
    if dim in LONG_GROUPS or mesh.patient:
        limit = f"--io-timeout {mesh.io_timeout_s:g} s" + (", the first step's" if dim not in LONG_GROUPS else "")
    raise CommError(f"{what} on the {dim} group (global ranks {mesh.group_ranks.get(dim)}) failed on rank "
                    f"{mesh.rank} after {waited:.1f} s ({limit}): {cause}; {hint}") from e


class Work:
    """An asynchronous op's handle whose wait() raises CommError as the synchronous ops do. In a
    traced step `done` ends the op's span: on gloo in its future's callback, as the op completes; on
    NCCL (whose futures complete once queued) at the wait, with the device synchronized."""

    def __init__(self, work, what: tuple, mesh, dim: str, t0: float, done=None):
        self.work, self.what, self.mesh, self.dim, self.t0, self.done = work, what, mesh, dim, t0, done
        if done is not None and mesh.device.type == "cpu" and hasattr(work, "get_future"):
            work.get_future().add_done_callback(lambda _: done())

    def wait(self):
        try:
            out = self.work.wait()
        except RuntimeError as e:
            raise_comm_error(e, self.what, self.mesh, self.dim, self.t0)
        if self.done is not None:
            self.done()
        return out


def run_collective(what: tuple, mesh, dim: str, fn, async_op: bool = False, nbytes: float = 0.0):
    t0 = time.monotonic()
    done = mesh.trace.collective(what[0], dim, nbytes) if mesh.trace is not None else None
    try:
        work = fn()
    except RuntimeError as e:  # gloo and NCCL raise RuntimeError subclasses (DistBackendError, ...)
        raise_comm_error(e, what, mesh, dim, t0)
    if done is not None and not async_op:
        done()
    return Work(work, what, mesh, dim, t0, done) if async_op else None


def exit_with_agent(poll_s: float = 1.0):
    """Under torchrun, end this process once its agent (the parent that started it) is gone: an
    agent killed without warning (SIGKILL, the OOM killer) cannot stop its workers, which would wait
    in a collective or the store connect until their own timeouts, holding (GPU) memory the
    restarted job needs. The command lines call it (configure_process, evaluate.py, bench.py)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or any(t.name == "exit-with-agent"
                                                     for t in threading.enumerate()):
        return  # not started by torchrun, or watched already
    agent = os.getppid()

    def watch():
        while os.getppid() == agent:
            time.sleep(poll_s)
        print(f"error (rank {os.environ.get('RANK', '?')}): torchrun's agent (pid {agent}) is gone; "
              "exiting", file=sys.stderr, flush=True)
        os._exit(1)  # from a thread, even while the main thread waits in C++ (a collective, a store)

    threading.Thread(target=watch, name="exit-with-agent", daemon=True).start()


def configure_process(device: torch.device, seed: int, deterministic: bool):
    """Before train(): seeds, this process's GPU, TF32 matmuls on CUDA, --deterministic, and (under
    torchrun) an exit when the agent dies. --deterministic means deterministic CUDA kernels where
    torch has them (an error where it has none), cuBLAS with a fixed workspace, no cuDNN autotuning.
    x86 runs repeat bit for bit without it on one kind of CPU, but MKL and ATen choose kernels by
    the host's vector unit (AVX-512, AVX2), and other kernels sum in another order: the flag pins
    both to AVX2. Both read their variables at first use, so this works in a fresh process, as the
    command line is."""
    exit_with_agent()
    torch.manual_seed(seed)
    random.seed(seed)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # kernels, NCCL and new tensors default to it
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    # set or unset (bench.py times both in one process), but only when it changes: the call imports
    # torch's compiler stack, a second of start-up for every process of a job that never asked for it
    if deterministic != torch.are_deterministic_algorithms_enabled():
        torch.use_deterministic_algorithms(deterministic)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.benchmark = False
        if device.type == "cpu" and platform.machine().lower() in ("x86_64", "amd64"):
            os.environ.setdefault("MKL_CBWR", "AVX2")
            os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")
            say("--deterministic: CPU kernels pinned to AVX2 (MKL_CBWR, ATEN_CPU_CAPABILITY); this costs "
                "throughput: `python bench.py --deterministic` against `python bench.py` measures it")
        elif device.type == "cuda":
            say("--deterministic: deterministic kernels, fixed cuBLAS workspace, no cuDNN autotuning; this "
                "costs throughput: bench.py --sweep 'deterministic=0;deterministic=1' measures how much")


def env_rank() -> int:
    """torchrun's RANK, for deciding who prints: 0 when unset or not a number (which check_config
    refuses, in a line this lets through)."""
    text = os.environ.get("RANK", "0").strip()
    return int(text) if text.isdigit() else 0


def say(msg: str):
    """Print on global rank 0 only (torchrun's RANK): one line per job, not one per process."""
    if env_rank() == 0:
        print(msg, flush=True)


class StopFlag:
    """Preemption. SIGTERM (what schedulers send before taking a node) or SIGINT (Ctrl-C) only
    raises a flag: the loop finishes its step, every rank agrees to stop (one rank's signal is
    enough: the flag is in the step's Tally), a checkpoint is written, and the process exits
    normally. A second signal 2 s or more later means "now": KeyboardInterrupt wherever the process
    is (the last complete checkpoint stays good); sooner, it is the same event twice (the scheduler
    signals every process and torchrun forwards its copy; Ctrl-C reaches torchrun and the workers).
    fail(why): the same stop for a failed log write, which then fails the run (stopped())."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.signal, self.at, self.previous, self.failure = None, None, {}, None
        if threading.current_thread() is threading.main_thread():  # only the main thread may set handlers
            self.previous = {sig: signal.signal(sig, self.handler) for sig in self.SIGNALS}

    def handler(self, signum, frame):
        if self.at is not None and time.monotonic() - self.at >= 2.0:
            raise KeyboardInterrupt
        if self.at is None:
            self.signal, self.at = signal.Signals(signum).name, time.monotonic()

    def fail(self, why: str):
        self.failure = self.failure or why

    def release(self):
        """Give the signals back to whoever had them before the run."""
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help with each flag's default appended, except where there is none to say (None; a switch's
    False) or its help already says it (in words such as "default: the model's context")."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)
