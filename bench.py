"""Measure speed, memory and communication on the machine at hand (plan.py plans runs on machines we don't have).
Numbers come from runs, never from timed unit tests; the README reports them with these commands.

  python bench.py [--model mini --micro-batch 8 --seq-len 128 ...]   (torchrun for --tp/--pp)
      train.py's own loop, timed: tokens/s (total and per device), step time split into the seven
      phases (device-synchronized, warm-up steps excluded), MFU under both FLOP conventions against
      the device's peak, peak memory beside costs.memory_estimate, and bytes sent per step for tp,
      cp, pp and dp beside costs.comm_estimate.
  python bench.py --sweep "tp=1,mb=4;tp=2,mb=8;mb=8,act_ckpt=1;act_ckpt=selective"
      several layouts / micro-batch sizes / activation checkpointing in one run, one table (keys:
      tp, cp, pp, ep, mb, accum, seq_len, zero, sp, act_ckpt, compile, loss_chunk, deterministic, attn,
      precision).
  python bench.py --compare-hf
      transformers.LlamaForCausalLM + torch.optim.AdamW on the same model and batch, alternating
      with ours in the same run, and the throughput ratio.
  python bench.py --plan --model llama3-70b --gpus 16384 --tp 8 --pp 4 ...
      plan.py's planner, no hardware: parameters, training FLOPs, per-GPU memory by kind, bytes sent per step and their
      time on NVLink or the network, bubble, step time and days at a stated MFU, whether it fits,
      and the cost (GPU-hours, energy by --pue, money by --usd-per-gpu-hour). --budget-flops C adds
      the size and tokens Chinchilla's fit would spend C on, beside Llama 3's choice. With --launch
      slurm|k8s it prints a batch script or Kubernetes PyTorchJob for that layout instead.
  torchrun --standalone --nproc_per_node=2 bench.py --dp-vs-ddp | --bubble
      our data parallelism against torch's DistributedDataParallel; the bubble against its formula.
  torchrun --standalone --nproc_per_node=4 bench.py --trace DIR --tp 2 --pp 2 --grad-accum 4
      one step after the warm-up, traced on every rank: DIR/trace.json (a Chrome trace of phases,
      micro-batches and collectives) and DIR/step.png, the bubble measured beside the formula's.

Every mode prints a table, and with --json one JSON object (settings and versions included). The
comparison with torch's DDP (--dp-vs-ddp) is here, the one place torch's parallelism runs; the one
with Hugging Face's model and the bubble's are compare.py's.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import signal
import statistics
import shutil
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import checkpoint
import checks
import compare
import config
import costs
import data
import launch
import model as M
import optim as O
import parallel as P
import plan
import train
import zero as Z

# ----------------------------------------------------------------------------------------------------
# Measuring train.py's loop


def train_args(a, out_dir: str, ckpt_every: int = 0, **over) -> argparse.Namespace:
    """train.py's arguments for a timed run, into out_dir: no validation, and no checkpoint unless
    ckpt_every says when (the checkpoint row: measure_ckpt)."""
    argv = ["--model", a.model, "--seq-len", str(over.get("seq_len", a.seq_len)),
            "--micro-batch", str(over.get("mb", a.micro_batch)), "--grad-accum", str(over.get("accum",
                                                                                              a.grad_accum)),
            "--tp", str(over.get("tp", a.tp)), "--pp", str(over.get("pp", a.pp)),
            "--cp", str(over.get("cp", a.cp)), "--zero", str(over.get("zero", a.zero)),
            "--ep", str(over.get("ep", a.ep)), "--moe-aux-coef", str(a.moe_aux_coef),
            "--bucket-mb", str(a.bucket_mb), "--loss-chunk", str(over.get("loss_chunk", a.loss_chunk)),
            "--max-steps", str(a.warmup_steps + a.steps), "--warmup", "1", "--eval-every", "-1",
            "--ckpt-every", str(ckpt_every),
            "--log-every", str(10 ** 9), "--sample-tokens", "0", "--out-dir", out_dir,
            "--precision", over.get("precision", a.precision), f"--data={a.data}"]
    argv += ["--device", a.device] if a.device else []
    ckpt = costs.ckpt_mode(over.get("act_ckpt", a.act_ckpt))
    argv += ["--act-ckpt", ckpt] if ckpt else []
    argv += ["--sp"] if over.get("sp", a.sp) else []
    argv += ["--compile"] if over.get("compile", a.compile) else []
    argv += ["--deterministic"] if over.get("deterministic", a.deterministic) else []
    argv += ["--ckpt-sync"] if a.ckpt_sync else []
    argv += ["--attn-backend", over.get("attn", a.attn_backend)]
    argv += [] if a.memory_check else ["--no-memory-check"]
    argv += [] if a.doc_mask is None else ["--doc-mask" if a.doc_mask else "--no-doc-mask"]
    argv += [f for flag in (*config.SHAPE_FLAGS, "rope_scaling") if getattr(a, flag) is not None
             for f in (f"--{flag.replace('_', '-')}", str(getattr(a, flag)))]
    return config.get_parser().parse_args(argv)


def cpu_census(fn) -> tuple[object, int]:
    """fn()'s result and the peak bytes of tensors alive at once while it ran, on a CPU: torch keeps
    no allocator statistics there, but its profiler records every allocation and free, replayed in
    time order. Left out: tensors from before fn (and their frees), and what a collective allocates
    in its own op (gloo holds copies of the buckets it reduces while in flight, as many as timing
    has; NCCL's buffers are outside torch's allocator). The census slows the run's timings."""
    from torch.profiler import profile, ProfilerActivity
    from torch._C._profiler import _EventType
    gc.collect()  # an earlier run's garbage goes now, not during this census
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    events, nodes = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while nodes:
        node = nodes.pop()
        nodes.extend(node.children)
        if node.typed[0] == _EventType.Allocation:
            allocation = node.typed[1]
            events.append((node.start_time_ns, allocation.alloc_size, allocation.ptr, _in_collective(node)))
    live, total, peak = set(), 0, 0
    for _, size, ptr, collective in sorted(events):
        if size > 0 and not collective:
            live.add(ptr)
            total += size
        elif size < 0 and ptr in live:
            live.discard(ptr)
            total += size
        peak = max(peak, total)
    return out, peak


def _in_collective(node) -> bool:
    while node is not None:
        if node.name.startswith("c10d::"):
            return True
        node = node.parent
    return False


def measure(a, timing: str = "phases", **over) -> dict:
    """One timed train.py run: phases and step time are medians over the steps after the warm-up.
    timing "phases" synchronizes the device after every phase to split the step, "steps" only at
    each step's end, as a plain run does (costs.PhaseTimer). Peak memory: the CUDA allocator's, on
    a CPU the process's peak RSS, or with --memory-census cpu_census's. The log goes to a temporary
    folder per rank, gone with the row. A row times the step alone: no checkpoint (measure_ckpt)."""
    with tempfile.TemporaryDirectory(prefix="bench-") as out_dir:
        return measure_in(out_dir, a, timing, **over)


def ckpt_setting(a) -> dict:
    """The checkpoint row's setting, as its table line and JSON name it."""
    return {"checkpoint": "sync" if a.ckpt_sync else "async"}


def measure_ckpt(a) -> dict:
    """--measure-ckpt: the flags' run for two steps with a checkpoint after each; the first, written
    while the second step trains: how long the step waited for it (ckpt_stall_s: the copy of the state
    to host memory, or with --ckpt-sync the whole write), of that how long allocating the host buffers
    that later saves reuse (ckpt_host_alloc_s: pinned memory on a GPU), and how long until it was on disk,
    committed (ckpt_write_s). Its folder (8B weights and their optimizer state: ~100 GB) goes with the row."""
    b = argparse.Namespace(**{**vars(a), "warmup_steps": 1, "steps": 1})
    with tempfile.TemporaryDirectory(prefix="bench-") as out_dir:
        args = train_args(b, out_dir, ckpt_every=1)
        import io, contextlib  # noqa: E401  (keep train.py's per-run banner out of the table)
        with contextlib.redirect_stdout(io.StringIO()):
            config.configure_process(args)
            run = train.train(args)
        first = run.saves[0]
        files = json.loads((Path(out_dir) / "step_000001" / "meta.json").read_text())["files"]
    return {"setting": ckpt_setting(a), "ckpt_stall_s": first["stall_s"],
            "ckpt_host_alloc_s": first["host_alloc_s"], "ckpt_write_s": first["write_s"],
            "ckpt_gb": sum(f["bytes"] for f in files.values()) / 1e9,
            "params": costs.count_params(run.margs), "precision": run.precision}


def measure_in(out_dir: str, a, timing: str, **over) -> dict:
    args = train_args(a, out_dir, **over)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    census = a.memory_census and not torch.cuda.is_available()
    import io, contextlib  # noqa: E401  (keep train.py's per-run banner out of the table)
    with contextlib.redirect_stdout(io.StringIO()):
        config.configure_process(args)  # as train.py's command line does
        trained = lambda: train.train(args, time_phases=timing)
        if census:  # peak FLOP/s measured outside the census: its matrices are not training's
            costs.peak_flops(*config.pick_device_and_precision(args))
        run, peak = cpu_census(trained) if census else (trained(), None)
    mesh, margs = run.mesh, run.margs
    peak = peak / 1e9 if census else costs.peak_memory_gb(run.device)
    peaks = P.all_gather_objects(peak, mesh) if mesh.world > 1 else [peak]
    steps = run.phases[a.warmup_steps:]
    phases = {k: statistics.median(s.get(k, 0.0) for s in steps) for k in steps[0]}
    step_s = statistics.median(sum(s.values()) for s in steps)
    tokens = args.micro_batch * args.seq_len * args.grad_accum * mesh.dp
    peak, peak_src = costs.peak_flops(run.device, run.precision)
    flops = costs.flops_per_token(margs, args.seq_len)
    shape = costs.Shape(args.micro_batch, args.seq_len, run.precision, args.grad_accum, args.act_ckpt,
                        run.task.chunk)
    kept = costs.kept_by(run.device.type, run.precision, args.attn_backend, train.doc_mask_on(args) or mesh.cp > 1,
                         args.compile, args.dropout > 0)
    est = costs.memory_estimate(margs, mesh.layout, shape, mesh.pp_rank, bucket_mb=args.bucket_mb, kept=kept)
    comm_est = costs.comm_estimate(margs, mesh.layout, shape, mesh.pp_rank)
    rates = costs.measured_rates(run.device, run.precision)
    owned = sum(hi - lo for lo, hi in run.opt.ranges)
    floors = costs.phase_floors(margs, args.seq_len, tokens / mesh.world, owned, run.precision, rates,
                                run.task.takes_hidden, "2-4 pipeline" in phases)
    return {"tp": mesh.tp, "cp": mesh.cp, "pp": mesh.pp, "dp": mesh.dp, "ep": mesh.ep, "micro_batch": args.micro_batch,
            "seq_len": args.seq_len,
            "grad_accum": args.grad_accum, "act_ckpt": args.act_ckpt, "sp": args.sp, "zero": args.zero,
            "deterministic": args.deterministic, "compile": args.compile, "loss_chunk": run.task.chunk,
            "attn_backend": args.attn_backend, "attn_kernel": run.attention, "params": costs.count_params(margs),
            "precision": run.precision, "fp8": args.precision == "fp8", "step_s": step_s, "phases_s": phases,
            "tokens_per_s": tokens / step_s,
            "tokens_per_s_per_device": tokens / step_s / mesh.world,
            "mfu": {k: v * tokens / step_s / (peak * mesh.world) for k, v in flops.items()},
            "peak_flops": peak, "peak_flops_source": peak_src, "peak_memory_gb": max(peaks),
            "peak_memory_gb_per_rank": peaks, "memory_census": census,
            "memory_estimate_gb": {k: v / 1e9 for k, v in est.items()},
            "comm_bytes_per_step": logged_comm(args.out_dir) or {k: v / (a.warmup_steps + a.steps)
                                                                for k, v in mesh.comm_bytes.items()},
            "comm_estimate_bytes": comm_est,
            "matmul_flops_measured": rates[0], "copy_bytes_per_s_measured": rates[1],
            "floors_ms": {k: 1000 * v for k, v in floors.items()},
            "ceiling_mfu": {k: v * tokens / (sum(floors.values()) * peak * mesh.world) for k, v in flops.items()},
            "loss_rate_vs_blocks": loss_vs_blocks(margs, flops["palm"], phases, run.task.takes_hidden)}


def loss_vs_blocks(margs, flops_per_token: float, phases: dict, chunked: bool) -> float | None:
    """The loss phase's FLOP rate over the blocks' (forward and backward), in the same steps: with the
    chunked loss the head's forward and backward (6 x dim x vocabulary FLOPs a token) run in phase 3,
    the rest of the model's in phases 2 and 4. None where the phases do not split so (whole logits: the
    head's forward is in phase 2; a pipeline times 2-4 as one)."""
    if not chunked or "2 forward" not in phases:
        return None
    head = 6 * margs.dim * margs.output_size
    blocks_s = phases["2 forward"] + phases["4 backward"]
    return head / phases["3 loss"] / ((flops_per_token - head) / blocks_s)


def logged_comm(out_dir) -> dict | None:
    """Bytes sent per step as the run's log has them (its last line covers every step but not the
    checkpoint, whose ZeRO gathers are no step's); None without a log (only rank 0 writes one)."""
    log = Path(out_dir) / "metrics.jsonl"
    if not log.exists():
        return None
    records = [json.loads(line) for line in log.read_text().splitlines()]
    return [r for r in records if "comm_bytes_per_step" in r][-1]["comm_bytes_per_step"]


class Table:
    """Measured rows, printed as each finishes: with --json a JSON line each (settings and versions
    included), else a table headed at the first row; a refused or failed setting says why."""

    def __init__(self, a, versions: dict):
        self.a, self.versions, self.measured, self.failed = a, versions, 0, 0
        self.quiet = int(os.environ.get("RANK", "0")) != 0

    def add(self, row: dict):
        self.failed += "error" in row
        if self.quiet:
            return
        if self.a.json:
            print(json.dumps({**self.versions, "model": self.a.model, **row}), flush=True)
        elif "error" in row:
            print(f"  {setting_text(row['setting'])}: {row['error']}", flush=True)
        elif "ckpt_write_s" in row:
            print(f"  checkpoint ({row['setting']['checkpoint']}), {row['ckpt_gb']:.2f} GB of weights and "
                  f"optimizer state on this rank's files: the step waited {row['ckpt_stall_s']:.2f} s "
                  f"({row['ckpt_host_alloc_s']:.2f} s of it allocating host buffers, which later saves "
                  f"reuse), on disk after {row['ckpt_write_s']:.2f} s", flush=True)
        else:
            if not self.measured:
                self.heading(row)
            print(row_line(row), flush=True)
        self.measured += "error" not in row and "ckpt_write_s" not in row  # (rows of steps, under the heading)

    def heading(self, r0: dict):
        a = self.a
        fp8 = " (fp8 matmuls in the blocks: MFU against the bf16 peak)" if a.precision == "fp8" else ""
        print(f"{a.model} ({r0['params']:,} params), {r0['precision']}{fp8}, peak "
              f"{costs.rate(r0['peak_flops'])} per device ({r0['peak_flops_source']}); medians of "
              f"{a.steps} steps after {a.warmup_steps} warm-up")
        print(f"  {'tp cp pp dp':>11s} {'mb':>3s} {'ckpt':>4s} {'step ms':>8s} {'tok/s':>9s} {'tok/s/dev':>9s} "
              f"{'MFU palm':>8s} {'megatron':>8s} {'mem GB':>7s} {'est GB':>7s}  phases (ms)", flush=True)

    def close(self):
        if self.quiet or self.a.json or not self.measured:
            return
        if self.a.memory_census:
            print("  (mem GB: the busiest rank's tensors at their peak, counted by torch's profiler, which slows "
                  "the steps; est GB: costs.memory_estimate)")
        elif self.a.device == "cpu" or not torch.cuda.is_available():
            print("  (mem GB on a CPU is the process's peak RSS, the Python runtime included; est GB counts "
                  "tensors: --memory-census counts them too)")


def row_line(r: dict) -> str:
    """One row of the table, and on a line below the bytes it sent beside the estimate."""
    ph = " ".join(f"{k.split()[0]}:{1000 * v:.1f}" for k, v in r["phases_s"].items())
    line = (f"  {r['tp']:2d} {r['cp']:2d} {r['pp']:2d} {r['dp']:2d} {r['micro_batch']:3d} "
            f"{costs.ckpt_label(r['act_ckpt']):>4s} {1000 * r['step_s']:8.1f} {r['tokens_per_s']:9,.0f} "
            f"{r['tokens_per_s_per_device']:9,.0f} {100 * r['mfu']['palm']:7.2f}% "
            f"{100 * r['mfu']['megatron']:7.2f}% "
            f"{r['peak_memory_gb']:7.3f} {r['memory_estimate_gb']['total']:7.3f}  {ph}"
            + "".join(f"  {k}" for k in ("sp", "zero", "compile", "deterministic", "fp8") if r[k])
            + (f"  ep {r['ep']}" if r["ep"] > 1 else "")
            + f"  attn {r['attn_kernel']}")
    line += "\n       floors (ms): " + " ".join(f"{k.split()[0]}:{v:.1f}" for k, v in r["floors_ms"].items()) + (
        f"; ceiling MFU {100 * r['ceiling_mfu']['palm']:.1f}% (matmul {costs.rate(r['matmul_flops_measured'])}, "
        f"copy {r['copy_bytes_per_s_measured'] / 1e9:.1f} GB/s, measured)")
    if r["loss_rate_vs_blocks"] is not None:
        line += f"\n       the loss phase's FLOP rate / the blocks': {r['loss_rate_vs_blocks']:.2f}"
    comm = {k: v for k, v in r["comm_bytes_per_step"].items() if v and k != "world"}  # world: tiny
    if comm:
        est = r["comm_estimate_bytes"]
        line += "\n       bytes sent per step (estimate): " + ", ".join(
            f"{k} {v / 1e6:.2f} MB ({est.get(k, 0) / 1e6:.2f})" for k, v in comm.items())
    return line


def setting_text(over: dict) -> str:
    """A --sweep setting as it is written ('mb=4,attn=flash'); the flags' own run: '(the flags)'."""
    return ",".join(f"{k}={v}" for k, v in over.items()) or "(the flags)"


def run_measured(a, versions: dict, argv: list[str]) -> int:
    """Measure and print each setting (the flags' run, or each --sweep setting over them); a refused
    or failed one is a row, and the sweep goes on. In one process each setting runs in its own child
    (measure_apart), so nothing of one row (memory, compiled code, failure) reaches the next; under
    torchrun they run here, and a refusal (alike on every rank, before anything runs) is a row."""
    settings = [] if a.measure_ckpt == "only" else parse_sweep(a.sweep) if a.sweep is not None else [{}]
    rows = settings + ([ckpt_setting(a)] if a.measure_ckpt else [])  # the checkpoint's row, once
    apart = len(rows) > 1 and launch.launch_env()[1] == 1
    table = Table(a, versions)
    for over in rows:
        table.add(measure_apart(argv, over) if apart else measure_here(a, over))
    table.close()
    if dist.is_initialized():
        launch.leave_job()
    return int(table.failed > 0)


def measure_here(a, over: dict) -> dict:
    """One setting (or the checkpoint's: ckpt_setting) measured in this process: its row, or
    {"setting", "error"} for a refusal (or, in
    a process of its own, any failure: there is nothing left to lose)."""
    alone = launch.launch_env()[1] == 1
    try:
        return measure_ckpt(a) if "checkpoint" in over else {"setting": over, **measure(a, **over)}
    except (config.ConfigError, checkpoint.CheckpointError, OSError) as e:  # a refusal, or the user's disk: one line
        return {"setting": over, "error": data.one_line(e)}
    except Exception as e:
        if not alone:
            raise
        traceback.print_exc()  # (the row says what failed; the traceback, where)
        return {"setting": over, "error": f"{type(e).__name__}: {data.one_line(e)}"[:400]}


def measure_apart(argv: list[str], over: dict) -> dict:
    """One setting measured in a child process (this script, its flags, the one setting, --json):
    its row, or {"setting", "error"} with the child's last line of errors."""
    flags, skip = [], False
    for i, arg in enumerate(argv):  # the flags without the sweep or the checkpoint's row (and --json)
        if skip or arg in ("--sweep", "--json", "--measure-ckpt") or arg.startswith(("--sweep=",
                                                                                    "--measure-ckpt=")):
            skip = arg == "--sweep" or (arg == "--measure-ckpt" and argv[i + 1:i + 2] in (["also"], ["only"]))
            continue
        flags.append(arg)
    row = (["--measure-ckpt", "only"] if "checkpoint" in over else ["--sweep", setting_text(over)] if over
           else [])  # ({}: the flags' own run)
    # the child's temporary folders (its run's log and checkpoints) inside one of ours, removed here even
    # when the child is killed (the OOM killer) before it can remove them itself
    with tempfile.TemporaryDirectory(prefix="bench-row-") as tmp:
        p = subprocess.run([sys.executable, str(Path(__file__).resolve()), *flags, *row, "--json"],
                           capture_output=True, text=True, env={**os.environ, "TMPDIR": tmp})
    rows = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    if p.returncode:
        sys.stderr.write(p.stderr)  # (a refusal's row says why; a failure's traceback is here)
    if rows:
        return {k: v for k, v in rows[-1].items() if k not in ("torch", "python", "device", "model")}
    if p.returncode < 0:  # ended by a signal: its last line (a progress line, say) is not why
        name = signal.Signals(-p.returncode).name
        why = f"the process was killed by {name}" + (" (the OOM killer sends it when memory runs out)"
                                                     if name == "SIGKILL" else "")
        return {"setting": over, "error": why}
    why = (p.stderr.strip().splitlines() or [f"exit code {p.returncode}"])[-1]
    return {"setting": over, "error": why.removeprefix("error: ")}


SWEEP_KEYS = ("tp", "cp", "pp", "ep", "mb", "accum", "seq_len", "zero", "sp", "act_ckpt", "compile", "loss_chunk",
              "deterministic", "attn", "precision")
PRECISIONS = ("fp32", "bf16", "fp16", "fp8")
# what a --sweep key may be set to: its flag's rule (the others: at least 1)
SWEEP_CHOICES = {"zero": (0, 1, 2, 3), "sp": (0, 1), "act_ckpt": (0, 1, "full", "selective"), "compile": (0, 1),
                 "deterministic": (0, 1), "attn": tuple(M.ATTN_BACKENDS), "precision": PRECISIONS}
SWEEP_WORDS = {"act_ckpt": ("full", "selective"), "attn": tuple(M.ATTN_BACKENDS),
               "precision": PRECISIONS}  # keys with words
SWEEP_FORMAT = ("';'-separated settings of key=integer pairs (act_ckpt also full or selective; attn a train.py "
                "--attn-backend; precision fp32, bf16, fp16 or fp8), e.g. 'tp=2,mb=8;act_ckpt=selective;attn=flash'")


def refuse(message: str):
    """A value bench.py cannot use: one line on stderr, exit code 1, before any work."""
    raise SystemExit(f"error: {message}")


def parse_sweep(text: str) -> list[dict]:
    """'tp=2,mb=8;act_ckpt=1' -> [{'tp': 2, 'mb': 8}, {'act_ckpt': 1}]. An empty setting is refused,
    not read as the flags' own setting: a stray ';' would otherwise measure the flags' run twice."""
    return [parse_setting(item, text) for item in text.split(";")]


def parse_setting(item: str, text: str) -> dict:
    pairs = [kv.split("=") for kv in item.split(",") if kv.strip()]
    if not pairs:
        refuse(f"--sweep {text!r} has an empty setting; expected {SWEEP_FORMAT}")
    try:
        keys = [k.strip() for k, _ in pairs]
        values = [v.strip() if v.strip() in SWEEP_WORDS.get(k, ()) else int(v)
                  for k, (_, v) in zip(keys, pairs)]
    except ValueError:  # no '=', two of them, or a value that is no integer
        refuse(f"bad --sweep item {item!r}: expected {SWEEP_FORMAT}")
    unknown = sorted(set(keys) - set(SWEEP_KEYS))
    if unknown:
        refuse(f"unknown --sweep key(s) {', '.join(unknown)} in {item!r}; known: {', '.join(SWEEP_KEYS)}")
    repeated = sorted({k for k in keys if keys.count(k) > 1})
    if repeated:  # the last value would win silently; two runs are two settings
        refuse(f"--sweep setting {item!r} sets {', '.join(repeated)} more than once; one value per key in a "
               "setting (';' separates settings)")
    row = dict(zip(keys, values))
    for k, v in row.items():
        if k in SWEEP_CHOICES and v not in SWEEP_CHOICES[k]:
            refuse(f"--sweep setting {item!r}: {k} must be one of {', '.join(map(str, SWEEP_CHOICES[k]))}, "
                   f"got {v}")
        if k not in SWEEP_CHOICES and v < (0 if k == "loss_chunk" else 1):
            refuse(f"--sweep setting {item!r}: {k} must be at least {0 if k == 'loss_chunk' else 1}, got {v}")
    return row


# ----------------------------------------------------------------------------------------------------
# Against torch's DistributedDataParallel: the one place this project runs torch's own parallelism,
# as a baseline


def dp_vs_ddp(args, mesh, margs, device):
    """Same seed, model, batch, AdamW settings, fp32; ours and DDP alternate in --blocks blocks."""
    torch.manual_seed(0)
    x = torch.randint(0, margs.vocab_size, (args.micro_batch, args.seq_len), device=device)
    y = torch.randint(0, margs.vocab_size, (args.micro_batch, args.seq_len), device=device)
    n_targets = y.numel() * mesh.dp

    torch.manual_seed(0)
    ours = M.Transformer(margs).to(device)
    opt = O.AdamW(ours.named_parameters(), lr=1e-4, pad_to=mesh.dp)
    sync = Z.GradSync(opt, mesh, args.bucket_mb)

    def our_step():
        logits = ours(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1), reduction="sum") / n_targets
        sync.start()  # one micro-batch per step: reduce while backward runs
        loss.backward()
        sync.finish()
        opt.step(grad_scale=O.clip_scale(1.0, Z.grad_norm(sync, ours)))
        opt.zero_grad()

    torch.manual_seed(0)
    ref = torch.nn.parallel.DistributedDataParallel(M.Transformer(margs).to(device),
                                                    bucket_cap_mb=args.bucket_mb,
                                                    device_ids=[device.index] if device.type == "cuda"
                                                    else None)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, foreach=True)

    def ddp_step():
        logits = ref(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))  # DDP: mean over ranks
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)

    times = {"parallel.py": [], "DDP": []}
    for _ in range(args.blocks):
        times["parallel.py"] += compare.timed_steps(our_step, args.steps, device)
        times["DDP"] += compare.timed_steps(ddp_step, args.steps, device)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"median_step_s": med, "ratio_ddp_over_ours": med["DDP"] / med["parallel.py"],
            "grad_mb": 4 * costs.count_params(margs) / 2 ** 20, "steps_each": args.steps * args.blocks}


# ----------------------------------------------------------------------------------------------------
# The command line: the modes, their flags and their checks


def get_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=launch.HelpFormatter)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--sweep", default=None, help="';'-separated settings, e.g. 'tp=2,mb=8;act_ckpt=1'")
    mode.add_argument("--compare-hf", action="store_true",
                      help="train transformers' LlamaForCausalLM on the same model and batch, alternating "
                      "with ours")
    mode.add_argument("--plan", action="store_true",
                      help="no hardware: memory, bytes sent, bubble and time of a run on --gpus x --gpu")
    mode.add_argument("--dp-vs-ddp", action="store_true",
                      help="under torchrun: our data parallelism against torch's DistributedDataParallel")
    mode.add_argument("--bubble", action="store_true",
                      help="under torchrun: the pipeline bubble measured at pp = processes, beside "
                      "(p-1)/(Vm+p-1)")
    mode.add_argument("--trace", metavar="DIR",
                      help="one step of train.py's loop on every rank, after the warm-up, as DIR/trace.json (a "
                           "Chrome trace: ui.perfetto.dev) and DIR/step.png (with matplotlib)")
    add_train_args(p)
    p.add_argument("--measure-ckpt", nargs="?", const="also", choices=["also", "only"], default=None,
                   help="also measure one checkpoint, as a row of its own: how long the step waits for it "
                        "and how long until it is on disk (only: that row alone; --ckpt-sync: the step "
                        "waits for the disk)")
    p.add_argument("--memory-census", action="store_true",
                   help="on a CPU: measure the peak of tensor memory with torch's profiler (slower steps)")
    p.add_argument("--steps", type=int, default=10, help="timed steps (per block for --dp-vs-ddp)")
    p.add_argument("--warmup-steps", type=int, default=3, help="steps run before timing starts")
    p.add_argument("--blocks", type=int, default=4, help="alternating blocks (--dp-vs-ddp)")
    p.add_argument("--micro-batches", default="1,2,4,8,16",  # read by micro_batch_counts
                   help="--bubble: the numbers of micro-batches m to measure, e.g. 1,2,4")
    p.add_argument("--schedule", default="1f1b", choices=["1f1b", "afab", "interleaved"],
                   help="pipeline schedule (--plan; --bubble: the one measured beside the interleaved)")
    p.add_argument("--virtual-stages", type=int, default=1,
                   help="model chunks per rank: --plan with --schedule interleaved; --bubble measures the "
                        "interleaved schedule with this many beside --schedule")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (settings and versions included)")
    plan.add_plan_args(p.add_argument_group("--plan"))
    config.add_lora_flags(p)  # (--plan: the memory and FLOPs of LoRA fine-tuning)
    return p


# train.py's flags that a measured run passes on (train_args), as train.py has them
TRAIN_FLAGS = {"--data", "--seq-len", "--micro-batch", "--grad-accum", "--doc-mask", "--precision", "--act-ckpt",
               "--compile", "--attn-backend", "--memory-check", "--loss-chunk", "--tp", "--cp", "--pp", "--sp",
               "--zero", "--ep", "--moe-aux-coef", "--bucket-mb", "--deterministic", "--device", "--ckpt-sync"}


def add_train_args(p: argparse.ArgumentParser):
    """train.py's flags for the measured run (config.py); only measured runs take shape flags."""
    config.add_model_flags(p)
    for group in (config.add_data_flags, config.add_optimization_flags, config.add_memory_and_speed_flags,
                  config.add_parallel_flags, config.add_run_flags):
        group(p, only=TRAIN_FLAGS)


def validate(a):
    """Every flag value bench.py cannot use, in any mode, refused in one line before any work as
    config.validate does (NaN too): a count below 1, a float out of range, a malformed
    --micro-batches or --sweep, a layout this run's processes cannot hold."""
    def need(ok: bool, name: str, rule: str):
        if not ok:
            refuse(f"--{name.replace('_', '-')} must be {rule}, got {getattr(a, name)}")
    for name in ("tp", "pp", "cp", "virtual_stages", "steps", "blocks", "gpus"):
        need(getattr(a, name) >= 1, name, "at least 1")
    need(a.warmup_steps >= 0, "warmup_steps", "at least 0")
    need(a.gpus_per_node is None or a.gpus_per_node >= 1, "gpus_per_node", "at least 1")
    need(0 < a.tokens < math.inf, "tokens", "a positive number")
    need(0 < a.mfu <= 1, "mfu", "in (0, 1]")
    need(0 <= a.reserve_gb < math.inf, "reserve_gb", "a number >= 0")
    need(1 <= a.pue < math.inf, "pue", "a number >= 1 (the facility's power over the GPUs')")
    need(0 <= a.usd_per_gpu_hour < math.inf, "usd_per_gpu_hour", "a number >= 0")
    need(a.budget_flops is None or 0 < a.budget_flops < math.inf, "budget_flops", "a positive number")
    try:  # the flags train.py has, as train.py refuses them
        config.validate(train_args(a, "unused"))
    except config.ConfigError as e:
        refuse(str(e))
    max_seq_len = model_args(a).max_seq_len  # (an unknown preset is refused here)
    need(a.seq_len <= max_seq_len, "seq_len", f"at most model {a.model}'s max_seq_len {max_seq_len}")
    micro_batch_counts(a.micro_batches)
    if a.compare_hf and launch.launch_env()[1] > 1:  # (N processes of ours against N copies of theirs on one GPU)
        refuse(f"--compare-hf times one process of ours against one transformers model on the same device; "
               f"this job has {launch.launch_env()[1]} processes: run it as one")
    if a.launch and not a.plan:
        refuse("--launch writes the launch of a --plan: add --plan and the layout")
    check_launch_values(a)
    shape = [f"--{f.replace('_', '-')}" for f in (*config.SHAPE_FLAGS, "rope_scaling")
             if getattr(a, f) is not None]
    if shape and (a.plan or a.dp_vs_ddp or a.bubble):
        refuse(f"{', '.join(shape)}: override the preset of a measured run (train.py's loop, --compare-hf); "
               "--plan, --dp-vs-ddp and --bubble take the presets as they are")
    if a.lora_rank is not None and not a.plan:  # (what bench.py measures is train.py's pretraining)
        refuse("--lora-rank plans LoRA fine-tuning: use it with --plan")
    if a.trace and Path(a.trace).exists() and not Path(a.trace).is_dir():
        refuse(f"--trace {a.trace} is a file: name a folder for trace.json and step.png")
    try:
        world = launch.launch_env()[1]
    except launch.LaunchError as e:
        refuse(str(e))
    if a.dp_vs_ddp or a.bubble:
        check_comparison(a, world)
    elif not a.plan:  # --plan's layout is over --gpus, not this run's processes: plan() checks it
        for row in parse_sweep(a.sweep) if a.sweep is not None else [{}]:
            check_measured_run(a, row, world)


def model_args(a) -> M.ModelArgs:
    """The measured model: --model with the shape flags over it, on the byte tokenizer's vocabulary
    (train.py's default, which train_args keeps), as train.py makes it."""
    try:
        return config.model_args_from(a, data.get_tokenizer("byte").n_vocab)
    except config.ConfigError as e:
        refuse(str(e))


def check_launch_values(a):
    """Free text --launch writes into a script: an image reference never holds a space, and a --data
    that is empty, starts with '-' or holds an unprintable character (a line break, say) is a
    mistake or would not reach train.py. What passes is quoted (shlex, yaml_string)."""
    if not a.image or any(c.isspace() or not c.isprintable() for c in a.image):
        refuse(f"--image {a.image!r} must name a container image: not empty, no spaces or line breaks")
    if a.launch and (not a.data.isprintable() or a.data[:1] in ("", "-")):
        refuse(f"--data {a.data!r} would not reach train.py as written: name the data in printable text "
               "(a path that starts with '-' as ./-...)")


def micro_batch_counts(text: str) -> list[int]:
    """--micro-batches '1,2,4' -> [1, 2, 4]."""
    try:
        counts = [int(x) for x in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        refuse(f"--micro-batches {text!r} must be ','-separated counts of at least 1, e.g. 1,2,4")
    return counts


def check_measured_run(a, row: dict, world: int):
    """Refuse a measured run (the flags, with a --sweep setting over them) as checks.check_config
    would, before the first run, so that no setting is measured in vain before a later one fails."""
    tp, cp, pp = (row.get(k, getattr(a, k)) for k in ("tp", "cp", "pp"))
    seq_len = row.get("seq_len", a.seq_len)
    what = (f"--sweep setting {','.join(f'{k}={v}' for k, v in row.items())!r}" if row
            else f"--tp {tp} --cp {cp} --pp {pp}")
    if world % (tp * cp * pp):
        refuse(f"{what} needs tp x cp x pp = {tp * cp * pp} processes (or a multiple), this run has {world}: "
               f"launch it with torchrun --standalone --nproc_per_node={tp * cp * pp} bench.py ...")
    margs = model_args(a)
    if seq_len > margs.max_seq_len:
        refuse(f"{what}: seq_len must be at most model {a.model}'s max_seq_len {margs.max_seq_len}, "
               f"got {seq_len}")
    layout = P.Layout(tp=tp, cp=cp, pp=pp, dp=world // (tp * cp * pp), sp=bool(row.get("sp", a.sp)))
    try:  # train_args passes no --schedule: train.py's default, 1F1B
        checks.check_layout(layout, world, margs, row.get("accum", a.grad_accum), seq_len)
    except P.LayoutError as e:
        refuse(f"invalid parallel layout ({what}): {e}")


def check_comparison(a, world: int):
    """--dp-vs-ddp and --bubble compare processes: 2 or more, and for --bubble one pipeline stage
    per process under each schedule it measures."""
    mode = "--dp-vs-ddp" if a.dp_vs_ddp else "--bubble"
    if world < 2:
        refuse(f"{mode} needs 2 or more processes, this run has {world}: launch it with torchrun "
               f"--standalone --nproc_per_node=2 bench.py {mode} ...")
    for schedule, virtual in compare.bubble_schedules(a) if a.bubble else []:
        try:
            checks.check_layout(P.Layout(pp=world, schedule=schedule, virtual=virtual), world, M.PRESETS[a.model],
                                world, a.seq_len)
        except P.LayoutError as e:
            refuse(f"invalid parallel layout: {e}")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = get_parser()
    a = parser.parse_args(argv)
    try:
        config.check_ramp_flags(a, config.given_flags(parser, argv))
    except config.ConfigError as e:
        refuse(str(e))
    validate(a)  # before any process group, run or output
    launch.exit_with_agent()  # a worker whose torchrun agent was killed ends too
    versions = {"torch": torch.__version__, "python": platform.python_version(),
                "device": torch.cuda.get_device_name() if torch.cuda.is_available()
                else f"cpu x{os.cpu_count()}"}
    try:
        return run_mode(a, versions, argv)
    except config.ConfigError as e:  # what train.py refuses beyond validate() (--device, memory)
        refuse(str(e))


def run_mode(a, versions: dict, argv: list[str]) -> int:
    """Run the mode the flags name (none: measure train.py's loop); returns the exit code."""
    if a.plan:
        plan.run_plan(a)
    elif a.dp_vs_ddp or a.bubble:
        run_comparison(a, versions)
    elif a.compare_hf:
        run_compare_hf(a, versions)
    elif a.trace:
        run_trace(a)
    else:
        return run_measured(a, versions, argv)
    return 0


def run_trace(a):
    """--trace DIR: the warm-up steps and one more, traced on every rank with its checkpoint
    (train.py --trace-step); rank 0 moves the files into DIR and prints each rank's phases."""
    b = argparse.Namespace(**{**vars(a), "steps": 1, "memory_census": False})
    with tempfile.TemporaryDirectory(prefix="bench-") as out_dir:
        args = train_args(b, out_dir, ckpt_every=b.warmup_steps + 1)  # (the step's phase 7 too)
        args.trace_step = args.max_steps
        import io, contextlib  # noqa: E401  (keep train.py's per-run banner out of the output)
        with contextlib.redirect_stdout(io.StringIO()):
            config.configure_process(args)
            run = train.train(args)
        if run.mesh.rank == 0:
            folder, made = Path(a.trace), Path(out_dir) / f"trace_step_{args.trace_step:06d}"
            folder.mkdir(parents=True, exist_ok=True)
            for suffix, name in ((".json", "trace.json"), (".png", "step.png")):
                if made.with_suffix(suffix).exists():
                    shutil.move(made.with_suffix(suffix), folder / name)  # (DIR may be on another disk)
            print_trace(json.loads((folder / "trace.json").read_text()), folder)
    if dist.is_initialized():
        launch.leave_job()


def print_trace(trace: dict, folder: Path):
    info, events = trace["otherData"], trace["traceEvents"]
    print(f"step {info['step']} on {len(info['counted_bytes'])} ranks (tp {info['tp']} x cp {info['cp']} x pp "
          f"{info['pp']} x dp {info['dp']}, {info['micro_batches']} micro-batches): {folder / 'trace.json'}"
          + (f", {folder / 'step.png'}" if (folder / "step.png").exists() else " (no picture: no matplotlib)"))
    for r, counted in enumerate(info["counted_bytes"]):
        phases = {}
        for e in events:
            if e.get("pid") == r and e.get("tid") == 0 and e["ph"] == "X":
                phases[e["name"]] = phases.get(e["name"], 0.0) + e["dur"] / 1e3
        print(f"  rank {r}: " + ", ".join(f"{k} {v:.1f} ms" for k, v in phases.items()) + "; sent "
              + ", ".join(f"{k} {v / 1e6:.2f} MB" for k, v in counted.items() if v))
    if info["pp"] > 1:
        print(f"  pipeline bubble: {info['bubble']['measured']:.3f} measured, {info['bubble']['formula']:.3f} "
              f"= (p - 1) / (v m + p - 1)")


def run_comparison(a, versions: dict):
    """--dp-vs-ddp or --bubble, under torchrun."""
    world = int(os.environ.get("WORLD_SIZE", "1"))  # 2 or more: validate()
    device = config.pick_device_and_precision(a)[0]  # this rank's GPU (LOCAL_RANK), else the CPU
    if device.type == "cuda":
        torch.cuda.set_device(device)  # kernels, NCCL and new tensors default to it
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    margs = M.PRESETS[a.model]
    mesh = P.init_mesh(P.Layout(pp=world) if a.bubble else None, device=device)
    result = {**versions, "threads_per_process": torch.get_num_threads(), "processes": world,
              "model": a.model,
              "params": costs.count_params(margs), "micro_batch": a.micro_batch, "seq_len": a.seq_len,
              "torch_device": str(device)}
    if a.dp_vs_ddp:
        result["dp_vs_ddp"] = dp_vs_ddp(a, mesh, margs, device)
    else:
        result["bubble"] = compare.bubble(a, mesh, margs, device, micro_batch_counts(a.micro_batches))

    if mesh.rank == 0:
        print_comparison(result, a, world)
    launch.leave_job()


def run_compare_hf(a, versions: dict):
    r = compare.compare_hf(a, model_args(a), lambda: measure(a, "steps")["tokens_per_s"])
    if a.json:
        print(json.dumps({**versions, "model": a.model, "micro_batch": a.micro_batch, "seq_len": a.seq_len,
                          "compare_hf": r}))
        return
    print(f"{a.model}, batch {a.micro_batch}x{a.seq_len} x {a.grad_accum}: ours "
          + " / ".join(f"{t:,.0f}" for t in r["ours_tokens_per_s"]) + " tok/s, transformers "
          + " / ".join(f"{t:,.0f}" for t in r["hf_tokens_per_s"])
          + f" tok/s -> ours / transformers = {r['ratio_ours_over_hf']:.2f}")
    print(f"  ours keeps {r['ours_keeps']}; transformers keeps {r['hf_keeps']}")


def print_comparison(result, a, world):
    if a.json:
        print(json.dumps(result))
    elif a.dp_vs_ddp:
        r = result["dp_vs_ddp"]
        print(f"{a.model} ({result['params']:,} params, {r['grad_mb']:.1f} MB of fp32 gradients), "
              f"batch {a.micro_batch}x{a.seq_len} per rank, dp {world}, {r['steps_each']} steps each")
        for k, v in r["median_step_s"].items():
            print(f"  {k:12s} median step {1000 * v:8.1f} ms")
        print(f"  DDP / parallel.py step time: {r['ratio_ddp_over_ours']:.3f} (> 1: ours is faster)")
    else:
        print(f"pipeline bubble, pp {world}, {a.model}, micro-batch {a.micro_batch}x{a.seq_len}")
        print(f"  {'schedule':>16s} {'m':>3s} {'step ms':>9s} {'measured':>9s} {'(p-1)/(Vm+p-1)':>15s}   "
              "per stage")
        for r in result["bubble"]:
            name = r["schedule"] + (f" V={r['virtual']}" if r["virtual"] > 1 else "")
            print(f"  {name:>16s} {r['m']:3d} {1000 * r['step_s']:9.1f} {r['bubble_measured']:9.3f} "
                  f"{r['bubble_formula']:15.3f}   " + " ".join(f"{b:.3f}"
                                                              for b in r["bubble_measured_per_stage"]))


if __name__ == "__main__":
    sys.exit(main())
