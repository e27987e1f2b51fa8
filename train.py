"""Pretrain a Llama 3 model: `python train.py` (or `torchrun --standalone --nproc_per_node=1 train.py`).

With no arguments it trains a small Llama on TinyShakespeare with the byte tokenizer, bf16 on a GPU and
fp32 on a CPU, and prints a sample at the end. Every optimizer step is the same seven phases:

  1 data loading      grad_accum micro-batches (B, T) from the Loader
  2 forward           tokens -> logits, one micro-batch at a time
  3 loss              sum of token losses / number of target tokens in the whole global batch
  4 backward          gradients accumulate, in fp32, in the optimizer's flat gradient buffer
  5 gradient sync     the seam where data parallelism reduces gradients across replicas (parallel.py)
  6 optimizer step    loss-scale check (fp16), clip by global norm, AdamW on fp32 master weights
  7 checkpoint        every --ckpt-every steps: atomic write to a step directory, `latest` pointer last

Around the loop: configuration and validation (every bad input fails before anything is written),
validation loss, logging to the console and to <out-dir>/metrics.jsonl, checkpoint save and resume.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import resource
import signal
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist

import checkpoint as C
import data
import model as M
import optim as O
import parallel as P

IGNORE_INDEX = P.IGNORE_INDEX  # targets with this id carry no loss (used by SFT for prompt tokens)


class ConfigError(Exception):
    """A user-facing error: printed as one line, exit code 1."""


class TrainingError(ConfigError):
    """Training cannot go on (too many bad steps): one line, exit 1."""


class ResourceError(ConfigError):
    """This process's machine cannot run the job (too little memory): said by every rank that finds it."""


# ----------------------------------------------------------------------------------------------------
# Configuration


def get_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("model")
    g.add_argument("--model", default="mini", help=f"preset: {', '.join(M.PRESETS)}")
    for flag in ("dim", "n-layers", "n-heads", "n-kv-heads", "vocab-size"):
        g.add_argument(f"--{flag}", type=int, default=None, help="override the preset")
    g = p.add_argument_group("data")
    g.add_argument("--data", default="tinyshakespeare",
                   help="registry name, text/JSONL file or glob, or a folder of prepared shards")
    g.add_argument("--tokenizer", default="byte", help="byte, gpt2, cl100k_base, o200k_base, llama3, or a path")
    g.add_argument("--mirror", default=None, help="local mirror folder for downloads (default: $DATA_MIRROR)")
    g.add_argument("--seq-len", type=int, default=128)
    g.add_argument("--micro-batch", type=int, default=8, help="sequences per micro-batch")
    g.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    g = p.add_argument_group("optimization")
    g.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    g.add_argument("--min-lr-ratio", type=float, default=0.1, help="cosine floor, as a fraction of --lr")
    g.add_argument("--warmup", type=int, default=100, help="linear warmup steps")
    g.add_argument("--max-steps", type=int, default=2400)
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument("--beta1", type=float, default=0.9)
    g.add_argument("--beta2", type=float, default=0.95)
    g.add_argument("--grad-clip", type=float, default=1.0, help="max global gradient norm (0: off)")
    g.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16", "fp16"],
                   help="auto: bf16 on CUDA, fp32 elsewhere")
    g.add_argument("--act-ckpt", action="store_true", help="recompute each block in backward to save memory")
    g.add_argument("--compile", action="store_true", help="torch.compile the model")
    g = p.add_argument_group("parallelism (launch with torchrun --nproc_per_node=N; dp = N / (tp * pp))")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel size (innermost: one NVLink domain)")
    g.add_argument("--pp", type=int, default=1, help="pipeline-parallel stages")
    g.add_argument("--pp-layers", default=None, help="layers per stage, e.g. 3,3,2 (default: balanced)")
    g.add_argument("--schedule", default="1f1b", choices=["1f1b", "afab"], help="pipeline schedule")
    g.add_argument("--sp", action="store_true", help="sequence parallelism inside the TP group")
    g.add_argument("--zero", type=int, default=0, choices=[0, 1], help="1: shard optimizer state over dp (ZeRO-1)")
    g.add_argument("--bucket-mb", type=float, default=25.0, help="gradient all-reduce bucket size")
    g.add_argument("--dist-timeout", type=float, default=300.0, help="seconds before a stuck collective fails")
    g.add_argument("--io-timeout", type=float, default=3600.0, help="seconds ranks wait for others' disk work "
                   "(data preparation, checkpoint writes and checks) before the job fails")
    g = p.add_argument_group("run")
    g.add_argument("--out-dir", default="out")
    g.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out-dir")
    g.add_argument("--overwrite", action="store_true", help="start afresh even if --out-dir has checkpoints")
    g.add_argument("--eval-every", type=int, default=600,
                   help="validation every N steps (0: only at the end, -1: never)")
    g.add_argument("--eval-batches", type=int, default=100, help="micro-batches per validation")
    g.add_argument("--ckpt-every", type=int, default=1000, help="checkpoint every N steps and at the end (0: never)")
    g.add_argument("--keep-ckpts", type=int, default=2, help="how many step directories to keep")
    g.add_argument("--log-every", type=int, default=100)
    g.add_argument("--sample-tokens", type=int, default=300,
                   help="length of the sample printed at the end (at most --seq-len: RoPE was trained on no more)")
    g.add_argument("--seed", type=int, default=1337)
    g.add_argument("--deterministic", action="store_true",
                   help="bit-identical reruns: deterministic kernels on CUDA (slower); CPU runs already are")
    g.add_argument("--max-skips", type=int, default=5,
                   help="stop after this many consecutive skipped steps (non-finite loss or gradient, spikes)")
    g.add_argument("--skip-spikes", type=float, default=0.0,
                   help="skip updates whose loss exceeds this multiple of the recent mean (0: off)")
    g.add_argument("--device", default=None, help="cuda, cpu, ... (default: cuda if available)")
    return p


def model_args_from(args, vocab_size: int) -> M.ModelArgs:
    """Preset + overrides. The small presets adapt their vocabulary to the tokenizer (rounded up to a multiple
    of 64 for efficient matmuls); the published Llama 3 presets keep theirs."""
    presets = M.PRESETS
    if args.model not in presets:
        raise ConfigError(f"unknown model preset {args.model!r}; choose from {', '.join(presets)}")
    margs = presets[args.model]
    over = {k: getattr(args, k) for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size")
            if getattr(args, k) is not None}
    if "vocab_size" not in over and not args.model.startswith("llama"):
        over["vocab_size"] = 64 * ((vocab_size + 63) // 64)
    if "n_heads" in over and "n_kv_heads" not in over and margs.n_heads % margs.n_kv_heads == 0:
        over["n_kv_heads"] = max(1, over["n_heads"] * margs.n_kv_heads // margs.n_heads)
    try:
        margs = replace(margs, **over)
    except ValueError as e:
        raise ConfigError(f"invalid model dimensions: {e}") from None
    if vocab_size > margs.vocab_size:
        raise ConfigError(f"tokenizer {args.tokenizer!r} has {vocab_size} ids but model {args.model!r} has a "
                          f"vocabulary of {margs.vocab_size}")
    return margs


def validate(args):
    """Every flag value a run cannot use is refused here, before anything is read or written. NaN fails
    every comparison below, so it is refused wherever a range is."""
    def need(ok: bool, name: str, rule: str):
        if not ok:
            raise ConfigError(f"--{name.replace('_', '-')} must be {rule}, got {getattr(args, name)}")
    for name in ("seq_len", "micro_batch", "grad_accum", "max_steps", "log_every", "keep_ckpts", "eval_batches",
                 "max_skips"):
        need(getattr(args, name) >= 1, name, "at least 1")
    for name in ("warmup", "ckpt_every", "sample_tokens"):
        need(getattr(args, name) >= 0, name, "at least 0")
    need(args.eval_every >= -1, "eval_every", "-1 (never), 0 (at the end) or a number of steps")
    need(0 < args.lr < math.inf, "lr", "a positive number")
    need(0 <= args.min_lr_ratio <= 1, "min_lr_ratio", "in [0, 1]")
    need(0 <= args.beta1 < 1, "beta1", "in [0, 1)")
    need(0 <= args.beta2 < 1, "beta2", "in [0, 1)")
    need(0 <= args.weight_decay < math.inf, "weight_decay", "a number >= 0")
    need(0 <= args.grad_clip < math.inf, "grad_clip", "a number >= 0 (0: off)")
    need(args.skip_spikes == 0 or 1 < args.skip_spikes < math.inf, "skip_spikes", "0 (off) or a factor above 1")
    need(0 < args.dist_timeout < math.inf, "dist_timeout", "a positive number of seconds")
    need(0 < args.io_timeout < math.inf, "io_timeout", "a positive number of seconds")
    need(0 < args.bucket_mb < math.inf, "bucket_mb", "a positive number")
    need(0 <= args.seed < 2 ** 63, "seed", "in [0, 2^63)")


def parse_pp_layers(text: str | None) -> list[int] | None:
    if not text:
        return None
    try:
        return [int(s) for s in text.split(",")]
    except ValueError:
        raise ConfigError(f"--pp-layers {text!r}: expected the layers of each stage, e.g. 3,3,2") from None


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # --precision -> compute dtype


def pick_device_and_precision(args):
    try:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda", "mps"):
        raise ConfigError(f"--device {args.device!r}: use cpu, cuda, cuda:N or mps")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda was asked for but CUDA is not available")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError("--device mps was asked for but MPS is not available")
    if device.type == "cuda":  # one GPU per process: torchrun's LOCAL_RANK, unless --device names one
        if device.index is None:
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        if device.index >= torch.cuda.device_count():
            raise ConfigError(f"GPU {device.index} asked for (--device or LOCAL_RANK), but this process sees "
                              f"{torch.cuda.device_count()}; start at most that many processes per node")
        torch.cuda.set_device(device)  # kernels, NCCL and new tensors default to it
    precision = args.precision
    if precision == "auto":
        precision = "bf16" if device.type == "cuda" else "fp32"
    return device, precision


# ----------------------------------------------------------------------------------------------------
# Measuring: peak FLOP/s for MFU, memory


# Dense tensor-core peaks in TFLOP/s (datasheets, without sparsity): bf16 and fp16, and TF32, which is what
# fp32 matmuls run on here (train() allows TF32). NVL parts run at lower clocks than SXM ones.
GPU_PEAK_TFLOPS = {"A100": {"bf16": 312, "tf32": 156}, "H100 PCIe": {"bf16": 756, "tf32": 378},
                   "H100 NVL": {"bf16": 835, "tf32": 417.5}, "H100": {"bf16": 989, "tf32": 494.5},
                   "H200 NVL": {"bf16": 835, "tf32": 417.5}, "H200": {"bf16": 989, "tf32": 494.5},
                   "B200": {"bf16": 2250, "tf32": 1100}, "GB200": {"bf16": 2500, "tf32": 1250}}


def gpu_peak(name: str, precision: str) -> tuple[float, str] | None:
    """(FLOP/s, which figure) for a GPU named like torch.cuda.get_device_name(), or None if unknown."""
    for key in sorted(GPU_PEAK_TFLOPS, key=len, reverse=True):  # 'H100 NVL' before 'H100', 'GB200' before 'B200'
        if key in name:
            kind = "tf32" if precision == "fp32" else "bf16"
            return GPU_PEAK_TFLOPS[key][kind] * 1e12, f"{name} ({key}, dense {kind.upper()}, table)"
    return None


def peak_flops(device: torch.device, precision: str) -> tuple[float, str]:
    """Peak dense FLOP/s of the device in the run's precision: the table above for known GPUs, else a
    measured matmul."""
    known = gpu_peak(torch.cuda.get_device_name(device), precision) if device.type == "cuda" else None
    if known:
        return known
    dtype = DTYPES[precision]
    n = 1024 if device.type == "cpu" else 8192
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    # The best of a few (the machine may be shared), within about a second: a CPU without fp16 kernels
    # takes seconds for one fp16 matmul of this size.
    best, tries, t_start = float("inf"), 0, time.perf_counter()
    while tries < 8 and (tries < 2 or time.perf_counter() - t_start < 1.0):
        sync_device(device)
        t0 = time.perf_counter()
        a @ b
        sync_device(device)
        best, tries = min(best, time.perf_counter() - t0), tries + 1
    return 2 * n ** 3 / best, f"{device.type} measured {n}x{n} {precision} matmul"


def sync_device(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_gb(device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # Linux reports KiB: process peak RSS


def available_memory(device) -> float | None:
    """Bytes this process may still use: free GPU memory, or the host's available memory shared by the
    processes torchrun started on it (None where it cannot be read)."""
    if device.type == "cuda":
        return float(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None
    return kib * 1024 / int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def check_memory(margs, args, world: int, device, precision: str):
    """Refuse a model that cannot fit before any of it is allocated: the estimate of what one process holds
    (model states, activations and temporaries of its busiest pipeline stage, parallel.memory_estimate)
    against what its device has free."""
    est = P.memory_estimate(margs, precision, args.micro_batch, args.seq_len, args.act_ckpt, args.tp, args.pp,
                            world // (args.tp * args.pp), args.zero, args.sp, args.grad_accum, args.schedule,
                            split=parse_pp_layers(args.pp_layers) if args.pp > 1 else None)
    have = available_memory(device)
    if have is not None and est["total"] > have:
        parts = ", ".join(f"{k} {v / 1e9:.1f}" for k, v in est.items() if k != "total" and v >= 0.05e9)
        raise ResourceError(f"model {args.model} needs about {est['total'] / 1e9:.1f} GB per process ({parts} GB) "
                            f"but {device.type} has {have / 1e9:.1f} GB available; use a smaller model, shard it "
                            f"over more processes (--tp, --pp, --zero 1) or a device with more memory")


# ----------------------------------------------------------------------------------------------------
# Checkpoints (checkpoint.py keeps the folder: lock, atomic save, manifest, rotation, finding the newest).
# What goes into one is decided here: every rank's shards with global names (parallel.py, section 8), so a
# checkpoint loads into any layout, plus the random states, the loss scale and, in meta.json, the step,
# the loader's position, the flags and the model's shape.


def rng_state(device) -> dict:
    """The random states a resume restores: torch's on the CPU, Python's, and this process's own GPU's
    (one GPU per process: every visible GPU's state would not load where a process sees fewer)."""
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


def save_checkpoint(out_dir: Path, step: int, model, opt, sync, scaler, loader, args, margs, mesh):
    extra = {"rng": rng_state(mesh.device), "scaler": scaler.state_dict() if scaler else None}
    meta = {"step": step, "loader": loader.state_dict(), "args": vars(args), "model_args": asdict(margs),
            "layout": {"tp": mesh.tp, "pp": mesh.pp, "dp": mesh.dp}}
    C.save(out_dir, step, mesh, lambda folder: P.save_shards(folder, model, opt, mesh, sync, extra), meta,
           args.keep_ckpts)


def lock_out_dir(out_dir: Path, mesh, log) -> C.RunLock:
    """Global rank 0 takes the out-dir's lock; every rank stops if it could not (rank 0 says why)."""
    lock, error = C.RunLock(out_dir), None
    if mesh.rank == 0:
        try:
            lock.acquire(log)
        except C.CheckpointError as e:
            error = e
    if mesh.world > 1 and not P.all_true(error is None, mesh):
        error = error or C.CheckpointError(f"{out_dir} could not be locked")
    if error is not None:
        raise error
    return lock


def resume_point(out_dir: Path, args, margs, log) -> tuple[Path | None, dict | None]:
    """The checkpoint this run continues from and its meta.json (None, None: a fresh start). A fresh run
    never mixes into an earlier one's folder: that takes --resume (continue it) or --overwrite (remove it
    first)."""
    ckpt, skipped = C.find_latest(out_dir) if out_dir.is_dir() else (None, [])
    earlier = C.earlier_run(out_dir)
    if not args.resume and not args.overwrite and (ckpt or skipped or earlier):
        what = f"checkpoint {ckpt.name}" if ckpt else earlier or skipped[0][0]
        raise ConfigError(f"{out_dir} already holds {what} of an earlier run; pass --resume to continue it, "
                          f"--overwrite to start afresh, or another --out-dir")
    if not args.resume:
        return None, None
    for name, why in skipped:
        log(f"checkpoint {name} is {why}; falling back to an older one")
    if ckpt is None and skipped and not args.overwrite:
        raise ConfigError(f"no intact checkpoint in {out_dir}: {skipped[0][0]} is {skipped[0][1]}; "
                          f"nothing was overwritten")
    if ckpt is None and not skipped:
        log(f"--resume: no checkpoint in {out_dir}, starting from scratch")
    return ckpt, (read_meta(ckpt, margs) if ckpt else None)


def read_meta(ckpt: Path, margs: M.ModelArgs) -> dict:
    meta = C.read_meta(ckpt)
    try:
        saved = M.ModelArgs(**meta["model_args"])
    except (TypeError, ValueError) as e:
        raise ConfigError(f"cannot read checkpoint {ckpt}: its model_args are malformed: {data.one_line(e)}")
    if saved != margs:
        diff = {k: (v, getattr(margs, k)) for k, v in asdict(saved).items() if getattr(margs, k) != v}
        raise ConfigError(f"checkpoint {ckpt} is for another model: (checkpoint, this run) differ in {diff}")
    return meta


def load_checkpoint(ckpt: Path, model, opt, mesh) -> dict:
    try:
        return P.load_shards(ckpt, model, opt, mesh)
    except Exception as e:  # truncated, corrupt, or not ours: say which checkpoint, not a traceback
        raise ConfigError(f"cannot read checkpoint {ckpt}: {type(e).__name__}: {data.one_line(e)}")


# ----------------------------------------------------------------------------------------------------
# Preemption: SIGTERM (what schedulers send before taking a node) or SIGINT (Ctrl-C) only raise a flag; the
# loop finishes the step it is in, every rank agrees to stop (one rank's signal is enough), a checkpoint
# is written, and the process exits normally. A second signal to the same process, 2 s or more after the
# first, means "now": it raises KeyboardInterrupt wherever the process is (the last complete checkpoint
# stays the good one). Sooner, it is the same event delivered twice (the scheduler signals every process
# and torchrun forwards its own copy; a terminal's Ctrl-C reaches torchrun and the workers alike).


def watch_signals() -> dict:
    stop = {"signal": None}

    def handler(signum, frame):
        if stop.get("at") is not None and time.monotonic() - stop["at"] >= 2.0:
            raise KeyboardInterrupt
        if stop.get("at") is None:
            stop["signal"], stop["at"] = signal.Signals(signum).name, time.monotonic()

    if threading_main():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, handler)
    return stop


def threading_main() -> bool:
    import threading
    return threading.current_thread() is threading.main_thread()


def stop_requested(stop: dict, mesh) -> bool:
    flag = torch.tensor([1.0 if stop["signal"] else 0.0], device=mesh.device)
    if mesh.world > 1:
        for dim in ("tp", "pp", "dp"):
            P.all_reduce(flag, mesh, dim, op=dist.ReduceOp.MAX)
        if flag.item() and not stop["signal"]:
            stop["signal"] = "(on another rank)"
    return bool(flag.item())


# ----------------------------------------------------------------------------------------------------
# Step timing for bench.py. Off by default.


class PhaseTimer:
    """Seconds per phase of every step. mode "phases": measured between device synchronizations, one after
    each phase (which costs throughput); "steps": the device is synchronized only where any run does, at
    each step's end, so the phases' sum is the step's time as a plain run spends it (the split between them
    is then host time); None: off."""

    def __init__(self, device, mode: str | None = None):
        if mode not in (None, "phases", "steps"):
            raise ValueError(f"PhaseTimer mode {mode!r}: use None, 'phases' or 'steps'")
        self.device, self.mode, self.steps = device, mode, []

    def start(self):
        if self.mode:
            sync_device(self.device)
            self.steps.append({})
            self.t = time.perf_counter()

    def mark(self, phase: str):
        if self.mode:
            if self.mode == "phases":
                sync_device(self.device)
            now = time.perf_counter()
            self.steps[-1][phase] = self.steps[-1].get(phase, 0.0) + now - self.t
            self.t = now


@dataclass
class Run:
    """What train() returns to its callers (main, sft.py, dpo.py, bench.py)."""
    model: M.Transformer
    tok: object  # the tiktoken Encoding
    mesh: P.Mesh
    device: torch.device
    margs: M.ModelArgs
    precision: str
    phases: list  # per step {phase: seconds} when train() was asked to time them, else []


# ----------------------------------------------------------------------------------------------------
# The task: what a micro-batch's loss is. Language modelling here (pretraining and SFT); dpo.py brings
# another. The loop below knows only these four methods.


class LMTask:
    """Next-token prediction: the sum of token cross-entropies over the number of target tokens in the
    whole global batch (all micro-batches, all dp ranks), so accumulation and every layout give the same
    gradient. IGNORE_INDEX targets (SFT prompts, padding) count for nothing."""

    metric_names: tuple = ()
    rows_per_example = 1  # model input rows per example the loader counts (a DPO pair has two)
    reference_forwards = 0  # forward passes of a frozen model per row, besides the trained one's (DPO: 0 or 1)

    def __init__(self, margs: M.ModelArgs, mesh):
        self.vocab_size, self.mesh = margs.vocab_size, mesh
        self.total = None  # the global normalizer, set by the loop before each step

    def prepare(self, batches):
        return batches

    def count(self, batch) -> torch.Tensor:
        return (batch[1] != IGNORE_INDEX).sum()

    def loss(self, logits, targets) -> torch.Tensor:
        return P.loss_sum(logits, targets, self.vocab_size, self.mesh) / self.total

    def metrics(self) -> torch.Tensor:
        return torch.zeros(0)


def step_tokens(args, task, mesh) -> int:
    """Tokens the model trains on per optimizer step: every row of every micro-batch on every dp rank."""
    return args.micro_batch * task.rows_per_example * args.seq_len * args.grad_accum * mesh.dp


def model_flops_per_token(margs, seq_len: int, task) -> float:
    """Model FLOPs per trained token (PaLM convention, 6N + 12LdT for forward and backward), plus a third of
    that for each forward of a frozen reference model the task runs alongside (DPO without a cache)."""
    return M.flops_per_token(margs, seq_len)["palm"] * (1 + task.reference_forwards / 3)


def global_total(task, batches, mesh, device) -> torch.Tensor:
    total = sum(task.count(b) for b in batches).float().to(device)
    P.all_reduce(total, mesh, "dp")
    return total


# ----------------------------------------------------------------------------------------------------
# Validation


@torch.no_grad()
def evaluate(model, make_val, task, args, mesh, device, dtype) -> tuple[float, torch.Tensor]:
    """Mean loss over the first --eval-batches validation micro-batches (the same ones every time, so
    successive values are comparable; at most one pass over the split), split over dp ranks and run
    through the pipeline. The micro-batches are read twice, --grad-accum at a time: once to count the
    targets (the normalizer, as in training), once for the losses; memory never holds more than that."""
    model.eval()
    counting, scoring = make_val(), make_val()
    one_pass = math.ceil(len(counting) / (counting.batch_size * mesh.dp))
    n = max(1, min(args.eval_batches // mesh.dp, one_pass))
    chunks = [min(args.grad_accum, n - i) for i in range(0, n, args.grad_accum)]
    task.total = global_total(task, (counting.next() for _ in range(n)), mesh, device)
    task.metrics()  # start the metric sums afresh
    loss = torch.zeros((), device=device)
    for size in chunks:
        batches = task.prepare([tuple(t.to(device) for t in scoring.next()) for _ in range(size)])
        for chunk_loss in P.pipeline_forward(model, batches, mesh, args.seq_len, model.args.dim, task.loss, dtype):
            loss = loss + chunk_loss
    metrics = task.metrics().to(device)
    for dim in ("pp", "dp"):  # the loss lives on the last stage; each dp rank saw its own batches
        P.all_reduce(loss, mesh, dim)
        P.all_reduce(metrics, mesh, dim)
    model.train()
    return loss.item(), metrics


# ----------------------------------------------------------------------------------------------------
# Training


def pretraining_model(args, tok):
    """Pretraining starts from the preset (or dims) and a seeded random initialization: no initial weights."""
    return model_args_from(args, tok.n_vocab), lambda mesh: None


def pretraining_data(args, tok, mesh):
    """Token shards, prepared (and cached) by one process per cache folder, never by two at once: global
    rank 0 first; then the first process of every other node, which finds them ready where DATA_CACHE is
    shared between nodes and prepares its node's own copy where it is not; then all the others."""
    resolve = lambda: data.resolve_data(args.data, args.tokenizer, mirror=args.mirror)
    data_dir = resolve() if mesh.rank == 0 else None
    P.barrier(mesh, long=True)  # a large corpus takes longer to tokenize than any collective should wait
    if data_dir is None and int(os.environ.get("LOCAL_RANK", "0")) == 0:
        data_dir = resolve()
    P.barrier(mesh, long=True)
    data_dir = data_dir or resolve()
    train = data.Loader(data_dir, "train", args.micro_batch, args.seq_len, dp_rank=mesh.dp_rank,
                        dp_size=mesh.dp, seed=args.seed, tokenizer=tok)
    make_val = lambda: data.Loader(data_dir, "val", args.micro_batch, args.seq_len, dp_rank=mesh.dp_rank,
                                   dp_size=mesh.dp, seed=0, tokenizer=tok)
    make_val()  # fail now, not at the first evaluation
    return train, make_val, f"{data_dir}: {train.num_tokens:,} train tokens"


def read_initial(state, name: str) -> torch.Tensor:
    """One initial weight from a (lazy) state dict: a truncated or unreadable file is read only now."""
    try:
        return state[name]
    except Exception as e:
        raise ConfigError(f"cannot read initial weight {name}: {type(e).__name__}: {data.one_line(e)}") from None


def build_model(margs, state, args, mesh, device, dtype):
    """The model on the meta device (shapes, no storage), sharded (tp) and cut (pp) there; then this rank's
    pieces get storage and values, from the seed or from `state` (a full state dict), and are cast. Every
    layout starts from bit-identical weights, and a rank holds only its own."""
    with torch.device("meta"):
        model = M.Transformer(margs)
    P.apply_tensor_parallel(model, mesh)
    P.apply_pipeline(model, mesh, parse_pp_layers(args.pp_layers))
    if state is None:  # drawn on the CPU, so one seed gives one model on any device
        full_value = lambda name, shape: M.init_tensor(margs, name, shape, args.seed)
    else:
        missing = sorted({n for n, _ in model.named_parameters()} - set(state))
        if missing:
            raise ValueError(f"the initial state has no {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}")
        full_value = lambda name, shape: read_initial(state, name)
    P.materialize(model, mesh, device, full_value)
    model.to(dtype)
    model.act_ckpt = args.act_ckpt
    return model


def compile_blocks(model, backend="inductor"):
    """--compile: torch.compile each transformer block (as torchtitan does) rather than the whole model. A
    pipeline stage runs its blocks itself (parallel.stage_forward), never the top-level forward, so only
    this reaches them under --pp; and every block has the same code, so it is compiled once."""
    model.compiled_blocks = {key: torch.compile(layer, backend=backend) for key, layer in model.layers.items()}


def train(args, model_fn=pretraining_model, data_fn=pretraining_data, task_fn=LMTask,
          time_phases: str | None = None):
    """The one training loop. Pretraining (main below), sft.py and dpo.py differ only in the three
    functions they pass: model_fn(args, tok) -> (model args, weights), where weights(mesh) gives the initial
    full state dict (read lazily) or None once the processes can talk,
    data_fn(args, tok, mesh) -> (train loader, make_val_loader, description), and
    task_fn(margs, mesh[, ...]) -> the task (LMTask's four methods). time_phases: bench.py's PhaseTimer mode."""
    validate(args)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    log = (lambda msg: print(msg, flush=True)) if rank == 0 else (lambda msg: None)
    device, precision = pick_device_and_precision(args)
    dtype = DTYPES[precision]
    torch.manual_seed(args.seed)  # the same on every rank: every layout starts from the same full model
    random.seed(args.seed)
    # --deterministic: deterministic CUDA kernels where torch has them (an error where it has none), cuBLAS
    # with a fixed workspace, no cuDNN autotuning. On an x86 CPU, runs repeat bit for bit without it on one
    # kind of CPU, but MKL and ATen choose kernels by the host's vector unit (AVX-512, AVX2), and other
    # kernels sum in another order: the flag pins both to AVX2. (Both read these variables at their first
    # use: effective in a fresh process, as the CLI is, not after other work in the same process.)
    # Set (or unset) for every run: bench.py times runs with and without it in one process.
    torch.use_deterministic_algorithms(args.deterministic)
    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.benchmark = False
        if device.type == "cpu" and platform.machine().lower() in ("x86_64", "amd64"):
            os.environ.setdefault("MKL_CBWR", "AVX2")
            os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")
            log("--deterministic: CPU kernels pinned to AVX2 (MKL_CBWR, ATEN_CPU_CAPABILITY); this costs "
                "throughput: `python bench.py --deterministic` against `python bench.py` measures it")
        elif device.type == "cuda":
            log("--deterministic: deterministic kernels, fixed cuBLAS workspace, no cuDNN autotuning; this costs "
                "throughput: bench.py --sweep 'deterministic=0;deterministic=1' measures how much")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    # Validate everything that can be wrong before any communication and before touching --out-dir.
    tok = data.get_tokenizer(args.tokenizer)
    margs, initial_weights = model_fn(args, tok)
    if args.seq_len > margs.max_seq_len:
        raise ConfigError(f"--seq-len {args.seq_len} exceeds the model's max_seq_len {margs.max_seq_len}")
    split = parse_pp_layers(args.pp_layers)  # a malformed --pp-layers is refused here, whatever --pp is
    try:
        P.check_layout(world, args.tp, args.pp, margs, args.grad_accum, args.schedule, args.seq_len, args.sp)
        if args.pp > 1:
            P.stage_layers(margs.n_layers, args.pp, split)
    except P.LayoutError as e:
        raise ConfigError(f"invalid parallel layout: {e}") from None
    check_memory(margs, args, world, device, precision)
    out_dir = Path(args.out_dir)
    C.check_out_dir(out_dir)

    mesh = P.init_mesh(args.tp, args.pp, args.sp, device, args.dist_timeout, args.io_timeout)
    lock, metrics = lock_out_dir(out_dir, mesh, log), None
    try:
        # rank 0 alone checks the checkpoint against its manifest (hashing every shard) and reads its meta
        resume, meta = P.on_rank0(lambda: resume_point(out_dir, args, margs, log), mesh)
        init_state = initial_weights(mesh)  # --init: verified by rank 0 likewise
        loader, make_val, data_desc = data_fn(args, tok, mesh)
        per_step = loader.batch_size * args.grad_accum * mesh.dp
        if len(loader) < per_step:  # every step would see the same sequences several times: surely a mistake
            raise data.DataError(f"the training data holds {len(loader):,} sequences of up to seq_len {args.seq_len}, "
                                 f"fewer than one global batch of {per_step:,} (--micro-batch {loader.batch_size} x "
                                 f"--grad-accum {args.grad_accum} x dp {mesh.dp}); use more data or a smaller batch")

        # Model and optimizer: the model's storage is handed to the optimizer; then the data-parallel
        # gradient reduction hooks into the optimizer.
        try:
            model = build_model(margs, init_state, args, mesh, device, dtype)
        except ValueError as e:  # an initial state that does not fit the model (missing names, other shapes)
            raise ConfigError(f"cannot build the model from the initial weights: {e}") from None
        opt = O.AdamW(model.named_parameters(), lr=args.lr, betas=(args.beta1, args.beta2),
                      weight_decay=args.weight_decay, pad_to=mesh.dp, allocate_state=False)  # GradSync shards it
        sp_partial = [i for i, n in enumerate(opt.names) if mesh.sp and n not in model.tp_placement]
        sync = P.GradSync(opt, mesh, args.bucket_mb, args.zero, partial_tp=sp_partial)
        scaler = O.LossScaler() if precision == "fp16" else None
        task = task_fn(margs, mesh)
        start_step = 0
        if resume:
            extra = load_checkpoint(resume, model, opt, mesh)
            if scaler and extra.get("scaler"):
                scaler.load_state_dict(extra["scaler"])
            loader.load_state_dict(meta["loader"])
            restore_rng(extra["rng"], device)
            start_step = meta["step"]
            old = meta.get("layout", {"tp": 1, "pp": 1, "dp": 1})
            log(f"resumed from {resume} at step {start_step} (written at tp {old['tp']}, pp {old['pp']}, dp {old['dp']})")
        if args.compile:
            compile_blocks(model)

        if rank == 0 and resume is None and args.overwrite:  # the first write of this run: the old one goes
            gone = C.clear_run(out_dir)
            if gone:
                log(f"--overwrite: removed {', '.join(gone)} of the earlier run in {out_dir}")
        P.barrier(mesh)
        metrics = open(out_dir / "metrics.jsonl", "a") if rank == 0 else None
        n_params = M.count_params(margs)
        tokens_per_step = step_tokens(args, task, mesh)
        flops_tok = model_flops_per_token(margs, args.seq_len, task)
        peak, peak_src = peak_flops(device, precision)
        log(f"model {getattr(args, 'init', None) or args.model}: {n_params:,} parameters "
            f"({M.count_params(margs, False):,} non-embedding), dim {margs.dim}, layers {margs.n_layers}, "
            f"heads {margs.n_heads}/{margs.n_kv_heads}, vocab {margs.vocab_size}")
        log(f"layout: {mesh.world} processes = dp {mesh.dp} x pp {mesh.pp} x tp {mesh.tp}"
            + (f", {args.schedule} schedule" if mesh.pp > 1 else "") + (", sequence parallel" if mesh.sp else "")
            + (", ZeRO-1" if args.zero and mesh.dp > 1 else ""))
        log(f"data {data_desc}; {tokens_per_step:,} tokens/step "
            f"({args.micro_batch}{f' x {task.rows_per_example} rows' if task.rows_per_example > 1 else ''} x "
            f"{args.seq_len} x {args.grad_accum} accumulation x {mesh.dp} dp)")
        log(f"device {device}, {precision}; MFU uses the PaLM convention 6N+12LdT"
            + (" plus the reference's forward" if task.reference_forwards else "") + f" = {flops_tok / 1e6:.1f} MFLOP/token "
            f"against {peak / 1e12:.2f} TFLOP/s per device ({peak_src})")

        def write(record):
            if metrics:
                metrics.write(json.dumps(record) + "\n")
                metrics.flush()

        def named(values: torch.Tensor, prefix="") -> dict:
            return {prefix + k: v for k, v in zip(task.metric_names, values.tolist())}

        def micro_loss(logits, targets):  # 3. loss (the task's), scaled for fp16 so small gradients survive
            loss = task.loss(logits, targets)
            return loss * scaler.scale if scaler else loss

        model.train()
        t_log, tokens_since, loss_acc = time.perf_counter(), 0, torch.zeros((), device=device)
        metric_acc = torch.zeros(len(task.metric_names), device=device)
        comm_at_log = dict(mesh.comm_bytes)
        train_time = 0.0
        timer = PhaseTimer(device, time_phases)
        stop = watch_signals()
        recent, skipped, consecutive, saved_at = [], 0, 0, start_step
        step = start_step
        while step < args.max_steps:
            t0 = time.perf_counter()
            timer.start()
            before = loader.state_dict()  # a skipped step rewinds to here
            # 1. data loading: every micro-batch of this step, so the global normalizer is known up front
            batches = [tuple(t.to(device, non_blocking=True) for t in loader.next()) for _ in range(args.grad_accum)]
            batches = task.prepare(batches)
            task.total = global_total(task, batches, mesh, device)
            timer.mark("1 data")
            if mesh.pp > 1:
                # 2-4. forward, loss, backward of every micro-batch, interleaved across stages by the schedule
                loss_total = P.pipeline_step(model, batches, mesh, args.seq_len, margs.dim, micro_loss,
                                             args.schedule, before_last_backward=sync.start, dtype=dtype)
                timer.mark("2-4 pipeline")
            else:
                loss_total = torch.zeros((), device=device)
                for i, batch in enumerate(batches):
                    # 2. forward
                    logits = model(batch[0], doc_ids=P._doc_ids(batch))  # (B, T, vocab[/tp])
                    timer.mark("2 forward")
                    # 3. loss: summed over the micro-batch, divided by the global normalizer (exact accumulation)
                    loss = micro_loss(logits, batch[1])
                    loss_total += loss.detach()
                    timer.mark("3 loss")
                    # 4. backward; the last micro-batch's gradients are reduced over dp as they are produced
                    if i == len(batches) - 1:
                        sync.start()
                    loss.backward()
                    timer.mark("4 backward")
            if scaler:
                loss_total /= scaler.scale
            # 5. gradient synchronization: wait for the dp buckets (ZeRO-1: reduce-scatter), SP norms over tp
            sync.finish()
            timer.mark("5 grad sync")
            # 6. optimizer step, unless the step is bad: then weights, optimizer state and loader position stay
            #    as they were (every rank reaches the same verdict: the norm and the loss are global)
            lr = O.lr_at(step, args.lr, args.warmup, args.max_steps, args.min_lr_ratio)
            bad = None
            overflow = scaler is not None and not scaler.unscale_and_check(opt, lambda ok: P.all_true(ok, mesh))
            if overflow:
                bad = f"fp16 gradient overflow, loss scale -> {scaler.scale:g}"
            else:
                grad_norm = P.grad_norm(sync, model)
                # The global norm sums each dp rank's own piece of the gradients. Under plain DP every rank
                # also applies the pieces it did not sum: a second, local check catches a rank whose copy of
                # the reduced gradients went bad (replicas must never apply different updates). ZeRO-1 ranks
                # apply only their own piece, and one replica has no other pieces: the global norm suffices.
                replicas_apply_all = mesh.dp > 1 and not args.zero
                if not (torch.isfinite(grad_norm) and
                        (not replicas_apply_all or P.all_true(torch.isfinite(opt.grad_norm()), mesh))):
                    bad = f"non-finite gradient norm ({grad_norm.item()})"
                elif args.skip_spikes > 0:
                    global_loss = loss_total.clone()
                    for dim in ("pp", "dp"):
                        P.all_reduce(global_loss, mesh, dim)
                    mean = sum(recent) / len(recent) if len(recent) >= 10 else None
                    if mean is not None and global_loss.item() > args.skip_spikes * mean:
                        bad = f"loss spike: {global_loss.item():.4f} > {args.skip_spikes} x recent mean {mean:.4f}"
                    else:
                        recent = (recent + [global_loss.item()])[-50:]
            if bad is not None:
                opt.zero_grad()
                loader.load_state_dict(before)
                # An fp16 overflow is the loss scaler searching for its scale (normal while it settles down
                # from 2^16): it counts toward --max-skips only once the scale is below 1, where the gradients
                # overflow by themselves.
                skipped, consecutive = skipped + 1, consecutive + (not overflow or scaler.scale < 1)
                log(f"step {step + 1}: skipped ({bad}); {consecutive} in a row, {skipped} in all")
                write({"step": step + 1, "skipped": bad, "skipped_total": skipped})
                if consecutive >= args.max_skips:
                    raise TrainingError(f"stopped: {consecutive} consecutive steps skipped, the last for {bad}; "
                                        f"the last checkpoint is intact (lower --lr, check the data, or --resume)")
                continue
            consecutive = 0
            grad_norm = opt.clip_grad_norm(args.grad_clip, grad_norm)
            opt.step(lr)
            sync.all_gather_params()  # ZeRO-1: every rank's updated shard back into everyone's weights
            opt.zero_grad()
            sync_device(device)  # the step's end: its time is the device's, not only the host's
            timer.mark("6 optimizer")
            train_time += time.perf_counter() - t0
            loss_acc += loss_total
            metric_acc += task.metrics().to(device)
            tokens_since += tokens_per_step
            step = done = step + 1
            if done % args.log_every == 0 or done == args.max_steps:
                for dim in ("pp", "dp"):  # the loss lives on the last stage; dp ranks hold parts of it
                    P.all_reduce(loss_acc, mesh, dim)
                    P.all_reduce(metric_acc, mesh, dim)
                dt = time.perf_counter() - t_log
                n_logged = (done - start_step - 1) % args.log_every + 1
                tps = tokens_since / dt
                comm = {k: (mesh.comm_bytes[k] - comm_at_log[k]) / n_logged for k in mesh.comm_bytes}
                rec = {"step": done, "loss": loss_acc.item() / n_logged, "lr": lr, "grad_norm": grad_norm.item(),
                       "tokens_per_s": tps, "mfu": tps * flops_tok / (peak * mesh.world),
                       "peak_mem_gb": peak_memory_gb(device), "time_s": train_time,
                       "comm_bytes_per_step": comm, **named(metric_acc / n_logged)}
                comm_txt = "" if mesh.world == 1 else " | comm/step " + " ".join(
                    f"{k} {v / 1e6:.2f}MB" for k, v in comm.items() if mesh.size(k) > 1)
                extra_txt = "".join(f" | {k} {v:.3f}" for k, v in named(metric_acc / n_logged).items())
                log(f"step {done:6d} | loss {rec['loss']:.4f} | lr {lr:.2e} | grad norm {rec['grad_norm']:.3f} | "
                    f"{tps:,.0f} tok/s | MFU {100 * rec['mfu']:.2f}% | mem {rec['peak_mem_gb']:.2f} GB{comm_txt}{extra_txt}")
                write(rec)
                t_log, tokens_since, loss_acc = time.perf_counter(), 0, torch.zeros((), device=device)
                metric_acc = torch.zeros(len(task.metric_names), device=device)
                comm_at_log = dict(mesh.comm_bytes)
            if args.eval_every >= 0 and ((args.eval_every and done % args.eval_every == 0) or done == args.max_steps):
                t_eval = time.perf_counter()
                val, val_metrics = evaluate(model, make_val, task, args, mesh, device, dtype)
                extra = named(val_metrics, "val_")
                log(f"step {done:6d} | val loss {val:.4f}" + "".join(f" | {k} {v:.3f}" for k, v in extra.items())
                    + f" | train time {train_time:.1f} s | eval {time.perf_counter() - t_eval:.1f} s")
                write({"step": done, "val_loss": val, **extra, "time_s": train_time})
                t_log += time.perf_counter() - t_eval  # evaluation time is not training throughput
                comm_at_log = dict(mesh.comm_bytes)
            # 7. checkpoint
            if args.ckpt_every > 0 and (done % args.ckpt_every == 0 or done == args.max_steps):
                t_ck = time.perf_counter()
                timer.start()  # the checkpoint is timed as an entry of its own, apart from the training step
                save_checkpoint(out_dir, done, model, opt, sync, scaler, loader, args, margs, mesh)
                saved_at = done
                timer.mark("7 checkpoint")
                t_log += time.perf_counter() - t_ck
                comm_at_log = dict(mesh.comm_bytes)
            if stop_requested(stop, mesh):  # preemption: finish this step, save, leave
                if saved_at != done:
                    save_checkpoint(out_dir, done, model, opt, sync, scaler, loader, args, margs, mesh)
                log(f"stopped by signal {stop['signal']} after step {done}; checkpoint step_{done:06d} written, "
                    f"--resume continues from it")
                break
    finally:
        if metrics:
            metrics.close()
        lock.release()
    return Run(model, tok, mesh, device, margs, precision, timer.steps)


def main(argv=None):
    args = get_parser().parse_args(argv)
    run = train(args)
    model, tok, mesh, device = run.model, run.tok, run.mesh, run.device
    if args.sample_tokens > 0 and mesh.tp == 1 and mesh.pp == 1 and mesh.rank == 0:
        prompt = [data.bos_id(tok)] + tok.encode_ordinary("\n")
        g = torch.Generator(device=device).manual_seed(args.seed)
        new = M.generate(model, prompt, min(args.sample_tokens, args.seq_len - len(prompt)),
                         temperature=0.8, top_k=200, generator=g, n_vocab=tok.n_vocab)
        print("-" * 60 + "\n" + tok.decode(new[0].tolist()) + "\n" + "-" * 60, flush=True)
    elif args.sample_tokens > 0 and mesh.rank == 0:
        print(f"(no sample under tp/pp: `python parallel.py consolidate {args.out_dir}` merges the checkpoint)")
    if mesh.world > 1:
        dist.destroy_process_group()


def run(main_fn=main, argv=None):
    """main_fn() with user errors as one line on stderr (from rank 0, or from the rank whose own input is
    bad, or from each rank whose collective failed) and a non-zero exit; torchrun then stops the others."""
    rank = int(os.environ.get("RANK", "0"))
    try:
        main_fn(argv)
    except (ConfigError, C.CheckpointError) as e:
        if rank == 0 or isinstance(e, ResourceError):
            print(f"error: {e}" if rank == 0 else f"error (rank {rank}): {e}", file=sys.stderr)
        sys.exit(1)
    except data.DataError as e:
        print(f"error: {e}" if rank == 0 else f"error (rank {rank}): {e}", file=sys.stderr)
        sys.exit(1)
    except P.CommError as e:  # every rank that saw it says so: the ranks named are the ones to look at
        print(f"error (rank {rank}): {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    run()
