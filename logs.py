"""What a run logs, an appendix: the console and metrics.jsonl (Meter), sent to Weights & Biases and
TensorBoard if asked (Trackers), and the run's banner. train.py's loop feeds the Meter each step and
validation; it measures tokens/s and MFU (costs.py's peaks and FLOP counts)."""

from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager
from pathlib import Path

import checkpoint
import config
import costs
import data
import launch
import ramp


def banner(run, meter: Meter, name: str, data_desc: str):
    """The run's banner: the model, the layout, the data and what MFU is measured against."""
    margs, mesh, args, task = run.margs, run.mesh, run.args, run.task
    launch.say(f"model {name}: {costs.count_params(margs):,} parameters ({costs.count_params(margs, False):,} "
               f"non-embedding), dim {margs.dim}, layers {margs.n_layers}, heads "
               f"{margs.n_heads}/{margs.n_kv_heads}, vocab {margs.vocab_size}"
               + (f"; dropout {args.dropout:g} while training" if args.dropout else ""))
    if margs.n_experts:  # (MFU counts the active parameters: 6 N_active + 12 L d T)
        launch.say(f"mixture of experts: {margs.top_k} of {margs.n_experts} experts of {margs.expert_dim} in "
                   f"{margs.moe_layers} of {margs.n_layers} layers; {costs.count_params(margs, active=True):,} "
                   f"parameters active per token; load-balancing loss x {args.moe_aux_coef:g}")
    launch.say(f"layout: {mesh.layout.describe()}")
    rows = f" x {task.rows_per_example} rows" if task.rows_per_example > 1 else ""
    launch.say(f"data {data_desc}; {meter.tokens_per_step:,} tokens/step ({args.micro_batch}{rows} x "
               f"{args.seq_len} x {args.grad_accum} accumulation x {mesh.dp} dp)")
    lora = config.lora_of(args)
    if lora:
        trained = sum(p.numel() for p in run.opt.params)
        launch.say(f"LoRA rank {lora[0]}, alpha {lora[1]:g} on {', '.join(lora[2])}: {trained:,} trained "
                   f"parameters on this rank, the model frozen in {run.precision}")
    fp8 = " with the blocks' matmuls in fp8 (MFU against the bf16 peak)" if args.precision == "fp8" else ""
    launch.say(f"device {run.device}, {run.precision}{fp8}, attention {run.attention}; MFU uses the PaLM convention "
        + ("4N+12LdT (LoRA: no weight gradients)" if lora else "6N+12LdT")
        + (" plus the frozen models' forwards" if task.reference_forwards else "")  # (a reference, a teacher)
        + f" = {meter.flops_per_token / 1e6:.1f} MFLOP/token against {costs.rate(meter.peak)} "
        f"per device ({meter.peak_source})")


class Meter:
    """The console and <out-dir>/metrics.jsonl, written by rank 0. Every --log-every steps and at
    the last it logs the mean loss (and the task's metrics) since the previous line, the last
    gradient norm, tokens/s and MFU, peak memory and the bytes sent per step. Its clock stops while
    paused: validation and checkpoints are not training time, and their bytes are not a step's."""

    def __init__(self, run, stop):
        self.run, self.args, self.mesh, self.stop = run, run.args, run.mesh, stop
        self.path, self.file = Path(run.args.out_dir) / "metrics.jsonl", None
        if run.mesh.rank == 0:
            try:  # unbuffered: each record is written, and made durable, as it is logged
                self.file = open(self.path, "ab", buffering=0)
            except OSError as e:
                raise checkpoint.CheckpointError(f"cannot write {self.path}: {checkpoint.write_error(e)}") from None
        self.trackers = Trackers(run.args) if run.mesh.rank == 0 else None
        self.restage()
        self.peak, self.peak_source = costs.peak_flops(run.device, run.precision)
        self.began, self.paused_s, self.paused_at = time.perf_counter(), 0.0, None
        self.restart()

    def restage(self):
        """Recompute tokens per step and model FLOPs per token (a --ramp stage changes them)."""
        self.tokens_per_step = step_tokens(self.run.args, self.run.task, self.run.mesh)
        self.flops_per_token = model_flops_per_token(self.run.margs, self.run.args.seq_len, self.run.task,
                                                     config.lora_of(self.run.args) is not None)

    def restart(self):
        """A new window: steps, tokens, loss and metric sums, time and bytes since the last line."""
        self.steps, self.window_start, self.comm_at = 0, self.clock(), dict(self.mesh.comm_bytes)
        self.tokens, self.loss, self.metrics = 0, 0.0, [0.0] * len(self.run.metric_names)

    def tokens_at(self, step: int) -> int:
        """Tokens trained on in the run's first `step` steps."""
        return ramp.tokens_before(self.run.ramp, step) if self.run.ramp else step * self.tokens_per_step

    def clock(self) -> float:
        """Seconds spent training so far: wall time less the pauses."""
        return (self.paused_at or time.perf_counter()) - self.began - self.paused_s

    @contextmanager
    def paused(self):
        self.paused_at, comm = time.perf_counter(), dict(self.mesh.comm_bytes)
        try:
            yield
        finally:
            self.paused_s += time.perf_counter() - self.paused_at
            self.paused_at = None
            self.comm_at = {k: v + self.mesh.comm_bytes[k] - comm[k] for k, v in self.comm_at.items()}

    def write(self, record: dict):
        if self.file:
            self.append((json.dumps(record) + "\n").encode())
        if self.trackers:
            self.trackers.log(record)

    def append(self, line: bytes):
        """One record, fsynced, so a full disk or a lost mount shows at this record, not at the end
        of the run (some file systems report it only on flush). On failure the log closes and the
        run stops at the next step with a checkpoint (launch.StopFlag.fail), as for any failed write."""
        at = os.fstat(self.file.fileno()).st_size
        try:
            view = memoryview(line)
            while view:
                view = view[self.file.write(view):]
            os.fsync(self.file.fileno())
        except OSError as e:
            # the log keeps whole records only; closing may report the same failure again
            for cleanup in (lambda: os.ftruncate(self.file.fileno(), at), self.file.close):
                try:
                    cleanup()
                except OSError:
                    pass
            self.file = None
            self.stop.fail(f"cannot write {self.path} ({checkpoint.write_error(e)}); its records from here on are lost")

    def named(self, values: list, prefix="") -> dict:
        return {prefix + k: v for k, v in zip(self.run.metric_names, values)}

    def step(self, step: int, result):
        """Add a finished step; log when due."""
        self.steps += 1
        self.tokens += self.tokens_per_step
        self.loss += result.loss
        self.metrics = [a + b for a, b in zip(self.metrics, result.metrics)]
        if step % self.args.log_every == 0 or step == self.args.max_steps:
            self.log(step, result)
            self.restart()

    def log(self, step: int, result):
        # Host numbers only (the steps' tallies), so logging never synchronizes. The clock is read
        # at one point of each step (after its tally), so a window's time is its steps' time.
        n, now, mesh = self.steps, self.clock(), self.mesh
        tps = self.tokens / (now - self.window_start)
        comm = {k: (v - self.comm_at[k]) / n for k, v in mesh.comm_bytes.items()}
        metrics = self.named([m / n for m in self.metrics])
        rec = {"step": step, "tokens": self.tokens_at(step), "loss": self.loss / n,
               "lr": result.lr, "grad_norm": result.grad_norm,
               "tokens_per_s": tps, "mfu": tps * self.flops_per_token / (self.peak * mesh.world),
               "peak_mem_gb": costs.peak_memory_gb(self.run.device), "time_s": now, "comm_bytes_per_step": comm,
               **metrics, **tokens_by_source(self.run)}
        comm_txt = "" if mesh.world == 1 else " | comm/step " + " ".join(  # (the tally's bytes: in the file)
            f"{k} {v / 1e6:.2f}MB" for k, v in comm.items() if k != "world" and v > 0)
        extra_txt = "".join(f" | {k} {short(v)}" for k, v in metrics.items())
        launch.say(f"step {step:6d} | loss {rec['loss']:.4f} | lr {result.lr:.2e} | grad norm "
                   f"{rec['grad_norm']:.3f} | {tps:,.0f} tok/s | MFU {100 * rec['mfu']:.2f}% | mem "
                   f"{rec['peak_mem_gb']:.2f} GB{comm_txt}{extra_txt}")
        self.write(rec)

    def validation(self, step: int, loss: float, metrics: list, by_source: dict, scores: dict):
        """Log a validation (called while paused: the pause so far is its time). by_source: a
        mixture's loss on each source's validation split; scores: --eval-tasks accuracies."""
        by_source = {f"val_loss/{k}": v for k, v in by_source.items()}
        extra = {**self.named(metrics, "val_"), **by_source, **scores}
        launch.say(f"step {step:6d} | val loss {loss:.4f}"
                   + "".join(f" | {k} {short(v)}" for k, v in extra.items())
                   + f" | train time {self.clock():.1f} s | eval {time.perf_counter() - self.paused_at:.1f} s")
        self.write({"step": step, "tokens": self.tokens_at(step), "val_loss": loss, **extra,
                    "time_s": self.clock()})

    def close(self):
        if self.file:
            self.file.close()
        if self.trackers:
            self.trackers.close()


class Trackers:
    """--wandb PROJECT and --tensorboard DIR: rank 0 sends on each metrics.jsonl record as written,
    nested values flattened (comm_bytes_per_step/dp). Each package is imported only if its flag
    asks; checks.check_trackers refuses a flag whose package is missing before the run starts."""

    def __init__(self, args):
        self.wandb = self.tensorboard = None
        if args.wandb:
            import wandb
            self.wandb = wandb.init(project=args.wandb, config=vars(args), dir=args.out_dir)
        if args.tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self.tensorboard = SummaryWriter(args.tensorboard)

    def log(self, record: dict):
        flat = {f"{k}/{sub}" if isinstance(v, dict) else k: x for k, v in record.items() if k != "step"
                for sub, x in (v.items() if isinstance(v, dict) else [(None, v)])}
        if self.wandb:
            self.wandb.log(flat, step=record["step"])
        if self.tensorboard:  # scalars only (a skipped step's reason is text)
            for name, value in flat.items():
                if isinstance(value, (int, float)):
                    self.tensorboard.add_scalar(name, value, record["step"])

    def close(self):
        if self.wandb:
            self.wandb.finish()
        if self.tensorboard:
            self.tensorboard.close()


def step_tokens(args, task, mesh) -> int:
    """Tokens trained on per optimizer step: every row of every micro-batch on every dp rank."""
    return args.micro_batch * task.rows_per_example * args.seq_len * args.grad_accum * mesh.dp


def short(v: float) -> str:
    """A metric in the log line: three decimals, or two digits where it is smaller than they show (a gap of
    5e-7 is not 0.000)."""
    return f"{v:.3f}" if v == 0 or abs(v) >= 1e-3 else f"{v:.1e}"


def model_flops_per_token(margs, seq_len: int, task, lora: bool = False) -> float:
    """Model FLOPs per trained token (PaLM convention, 6N + 12LdT for forward and backward), plus a
    third of that for each forward of a frozen reference model the task runs alongside (DPO without
    a cache). Under LoRA the frozen weights get no gradient: 4N + 12LdT."""
    forward = costs.flops_per_token(margs, seq_len)["palm"] / 3
    return costs.flops_per_token(margs, seq_len, frozen=lora)["palm"] + task.reference_forwards * forward


def tokens_by_source(run) -> dict[str, int]:
    """A mixture's tokens seen so far from each source, over every rank ({} for a single source)."""
    if not isinstance(run.loader, data.MixtureLoader):
        return {}
    return {f"tokens/{name}": n for name, n in run.loader.tokens_seen().items()}


def mixture_seen(run) -> str | None:
    """A mixture's realized shares of the tokens seen so far, as one line."""
    seen = tokens_by_source(run)
    total = sum(seen.values())
    return "data seen: " + ", ".join(f"{k.split('/', 1)[1]} {n / total:.1%} ({n:,} tokens)"
                                     for k, n in seen.items()) if total else None
