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
import os
import random
import resource
import shutil
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
import torch.nn.functional as F

import data
import model as M
import optim as O

IGNORE_INDEX = -100  # targets with this id carry no loss (used by SFT for prompt tokens)


class ConfigError(Exception):
    """A user-facing error: printed as one line, exit code 1."""


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
    g = p.add_argument_group("run")
    g.add_argument("--out-dir", default="out")
    g.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out-dir")
    g.add_argument("--overwrite", action="store_true", help="start afresh even if --out-dir has checkpoints")
    g.add_argument("--eval-every", type=int, default=600, help="validation every N steps (0: only at the end)")
    g.add_argument("--eval-batches", type=int, default=100, help="micro-batches per validation")
    g.add_argument("--ckpt-every", type=int, default=1000, help="checkpoint every N steps (and at the end)")
    g.add_argument("--keep-ckpts", type=int, default=2, help="how many step directories to keep")
    g.add_argument("--log-every", type=int, default=100)
    g.add_argument("--sample-tokens", type=int, default=300,
                   help="length of the sample printed at the end (at most --seq-len: RoPE was trained on no more)")
    g.add_argument("--seed", type=int, default=1337)
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
    if args.seq_len > margs.max_seq_len:
        raise ConfigError(f"--seq-len {args.seq_len} exceeds the model's max_seq_len {margs.max_seq_len}")
    return margs


def validate(args):
    for name in ("seq_len", "micro_batch", "grad_accum", "max_steps", "log_every", "keep_ckpts", "eval_batches"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.warmup < 0 or args.lr <= 0:
        raise ConfigError("--warmup must be >= 0 and --lr > 0")


def pick_device_and_precision(args):
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda was asked for but CUDA is not available")
    precision = args.precision
    if precision == "auto":
        precision = "bf16" if device.type == "cuda" else "fp32"
    return device, precision


# ----------------------------------------------------------------------------------------------------
# Measuring: peak FLOP/s for MFU, memory


GPU_PEAK_TFLOPS = {"A100": 312, "H100 PCIe": 756, "H100": 989, "H200": 989, "B200": 2250, "GB200": 2500}


def peak_flops(device: torch.device, precision: str) -> tuple[float, str]:
    """Peak dense FLOP/s of the device: the GUIDE's table for known GPUs (bf16 dense), else a measured matmul."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key in sorted(GPU_PEAK_TFLOPS, key=len, reverse=True):  # 'H100 PCIe' before 'H100'
            if key in name:
                return GPU_PEAK_TFLOPS[key] * 1e12, f"{name} (table)"
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    n = 1024 if device.type == "cpu" else 8192
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(5):  # best of a few: the machine may be shared
        sync(device)
        t0 = time.perf_counter()
        for _ in range(4):
            a @ b
        sync(device)
        best = min(best, (time.perf_counter() - t0) / 4)
    return 2 * n ** 3 / best, f"{device.type} measured {n}x{n} {precision} matmul"


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_gb(device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # Linux reports KiB: process peak RSS


# ----------------------------------------------------------------------------------------------------
# Loss and validation


def loss_sum(logits, targets):
    """Sum (not mean) of token cross-entropies, computed from fp32 logits; IGNORE_INDEX targets count 0."""
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1),
                           ignore_index=IGNORE_INDEX, reduction="sum")


@torch.no_grad()
def evaluate(model, data_dir, args, device, tokenizer_name) -> float:
    """Mean token loss over the first --eval-batches micro-batches of the validation split (the same batches
    every time, so successive values are comparable)."""
    model.eval()
    loader = data.Loader(data_dir, "val", args.micro_batch, args.seq_len, seed=0, tokenizer=tokenizer_name)
    total, count = torch.zeros((), device=device), torch.zeros((), device=device)
    show = sys.stderr.isatty() and args.eval_batches >= 10
    for i in range(args.eval_batches):
        x, y = (t.to(device) for t in loader.next())
        total += loss_sum(model(x), y)
        count += (y != IGNORE_INDEX).sum()
        if show:
            print(f"\r  validation {i + 1}/{args.eval_batches}", end="", file=sys.stderr, flush=True)
    if show:
        print("\r" + " " * 30 + "\r", end="", file=sys.stderr, flush=True)
    model.train()
    return (total / count).item()


# ----------------------------------------------------------------------------------------------------
# Checkpoints: <out-dir>/step_000500/{state.pt, meta.json}, written as .tmp-step_000500 and renamed when
# complete; <out-dir>/latest names the newest complete one and is replaced (atomically) only after it.


def save_checkpoint(out_dir: Path, step: int, model, opt, scaler, loader, args, margs, keep: int):
    name = f"step_{step:06d}"
    tmp = out_dir / f".tmp-{name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "rng": rng,
             "scaler": scaler.state_dict() if scaler else None}
    torch.save(state, tmp / "state.pt")
    meta = {"step": step, "loader": loader.state_dict(), "args": vars(args), "model_args": asdict(margs)}
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    for f in tmp.iterdir():  # make the bytes durable before the rename makes them visible
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    final = out_dir / name
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    pointer = out_dir / ".latest.tmp"
    pointer.write_text(name + "\n")
    os.replace(pointer, out_dir / "latest")
    for old in sorted(out_dir.glob("step_*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def find_latest(out_dir: Path) -> Path | None:
    """The checkpoint `latest` names; if that pointer is missing or stale, the newest complete step dir."""
    pointer = out_dir / "latest"
    if pointer.exists():
        d = out_dir / pointer.read_text().strip()
        if (d / "state.pt").exists() and (d / "meta.json").exists():
            return d
    dirs = [d for d in sorted(out_dir.glob("step_*")) if (d / "state.pt").exists() and (d / "meta.json").exists()]
    return dirs[-1] if dirs else None


def load_checkpoint(ckpt: Path, margs: M.ModelArgs):
    try:
        meta = json.loads((ckpt / "meta.json").read_text())
        state = torch.load(ckpt / "state.pt", map_location="cpu", weights_only=True)
    except Exception as e:  # truncated, corrupt, or not ours: say which file, not a traceback
        raise ConfigError(f"cannot read checkpoint {ckpt}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
    saved = M.ModelArgs(**meta["model_args"])
    if saved != margs:
        diff = {k: (v, getattr(margs, k)) for k, v in asdict(saved).items() if getattr(margs, k) != v}
        raise ConfigError(f"checkpoint {ckpt} is for another model: (checkpoint, this run) differ in {diff}")
    return meta, state


# ----------------------------------------------------------------------------------------------------
# Training


def log(msg: str):
    print(msg, flush=True)


def main(argv=None):
    args = get_parser().parse_args(argv)
    validate(args)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError("more than one process needs the parallel layouts of parallel.py (not yet available); "
                          "run with --nproc_per_node=1")
    device, precision = pick_device_and_precision(args)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    # Validate everything that can be wrong before touching --out-dir.
    tok = data.get_tokenizer(args.tokenizer)
    margs = model_args_from(args, tok.n_vocab)
    out_dir = Path(args.out_dir)
    ckpt = find_latest(out_dir) if out_dir.exists() else None
    if ckpt is not None and not args.resume and not args.overwrite:
        raise ConfigError(f"{out_dir} already holds checkpoint {ckpt.name}; pass --resume to continue it, "
                          f"--overwrite to start afresh, or another --out-dir")
    resume = ckpt if args.resume else None
    if args.resume and ckpt is None:
        log(f"--resume: no checkpoint in {out_dir}, starting from scratch")
    meta, state = load_checkpoint(resume, margs) if resume else (None, None)
    data_dir = data.resolve_data(args.data, args.tokenizer, mirror=args.mirror)
    loader = data.Loader(data_dir, "train", args.micro_batch, args.seq_len, seed=args.seed, tokenizer=tok.name)
    data.Loader(data_dir, "val", args.micro_batch, args.seq_len, seed=0, tokenizer=tok.name)  # fail now, not at eval

    # Model and optimizer: build in fp32 from the seed, cast, then hand the storage to the optimizer.
    model = M.Transformer(margs).to(device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    model.to(dtype)
    model.act_ckpt = args.act_ckpt
    opt = O.AdamW(model.named_parameters(), lr=args.lr, betas=(args.beta1, args.beta2),
                  weight_decay=args.weight_decay)
    scaler = O.LossScaler() if precision == "fp16" else None
    start_step = 0
    if resume:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])  # restores the fp32 master weights and refreshes the model copy
        if scaler and state["scaler"]:
            scaler.load_state_dict(state["scaler"])
        loader.load_state_dict(meta["loader"])
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        if "cuda" in state["rng"] and device.type == "cuda":
            torch.cuda.set_rng_state_all(state["rng"]["cuda"])
        start_step = meta["step"]
        log(f"resumed from {resume} at step {start_step}")
    fwd_model = torch.compile(model) if args.compile else model

    out_dir.mkdir(parents=True, exist_ok=True)
    metrics = open(out_dir / "metrics.jsonl", "a")
    n_params = M.count_params(margs)
    tokens_per_step = args.micro_batch * args.seq_len * args.grad_accum
    flops_tok = M.flops_per_token(margs, args.seq_len)["palm"]
    peak, peak_src = peak_flops(device, precision)
    log(f"model {args.model}: {n_params:,} parameters ({M.count_params(margs, False):,} non-embedding), "
        f"dim {margs.dim}, layers {margs.n_layers}, heads {margs.n_heads}/{margs.n_kv_heads}, vocab {margs.vocab_size}")
    log(f"data {data_dir}: {loader.num_tokens:,} train tokens; {tokens_per_step:,} tokens/step "
        f"({args.micro_batch} x {args.seq_len} x {args.grad_accum} accumulation)")
    log(f"device {device}, {precision}; MFU uses the PaLM convention 6N+12LdT = {flops_tok / 1e6:.1f} MFLOP/token "
        f"against {peak / 1e12:.2f} TFLOP/s ({peak_src})")

    def write(record):
        metrics.write(json.dumps(record) + "\n")
        metrics.flush()

    model.train()
    t_log, tokens_since, loss_acc = time.perf_counter(), 0, torch.zeros((), device=device)
    train_time = 0.0
    step = start_step
    for step in range(start_step, args.max_steps):
        t0 = time.perf_counter()
        # 1. data loading: every micro-batch of this step, so the global target count is known up front
        batches = [tuple(t.to(device, non_blocking=True) for t in loader.next()) for _ in range(args.grad_accum)]
        n_targets = sum((y != IGNORE_INDEX).sum() for _, y in batches)  # parallel.py: summed over dp
        loss_total = torch.zeros((), device=device)
        for x, y in batches:
            # 2. forward
            logits = fwd_model(x)  # (B, T, vocab)
            # 3. loss: summed over tokens, divided by the global target count, so accumulation is exact
            loss = loss_sum(logits, y) / n_targets
            loss_total += loss.detach()
            # 4. backward (fp16: scaled so small gradients survive)
            (loss * scaler.scale if scaler else loss).backward()
        # 5. gradient synchronization: a single process has nothing to reduce; parallel.py hooks in here
        # 6. optimizer step
        lr = O.lr_at(step, args.lr, args.warmup, args.max_steps, args.min_lr_ratio)
        if scaler and not scaler.unscale_and_check(opt):
            log(f"step {step + 1}: fp16 gradient overflow, step skipped, loss scale -> {scaler.scale:g}")
            grad_norm = torch.tensor(float("nan"))
        else:
            grad_norm = opt.clip_grad_norm(args.grad_clip)
            opt.step(lr)
        opt.zero_grad()
        sync(device)
        train_time += time.perf_counter() - t0
        loss_acc += loss_total
        tokens_since += tokens_per_step
        done = step + 1
        if done % args.log_every == 0 or done == args.max_steps:
            dt = time.perf_counter() - t_log
            n_logged = (done - start_step - 1) % args.log_every + 1
            tps = tokens_since / dt
            rec = {"step": done, "loss": loss_acc.item() / n_logged, "lr": lr, "grad_norm": grad_norm.item(),
                   "tokens_per_s": tps, "mfu": tps * flops_tok / peak, "peak_mem_gb": peak_memory_gb(device),
                   "time_s": train_time}
            log(f"step {done:6d} | loss {rec['loss']:.4f} | lr {lr:.2e} | grad norm {rec['grad_norm']:.3f} | "
                f"{tps:,.0f} tok/s | MFU {100 * rec['mfu']:.2f}% | mem {rec['peak_mem_gb']:.2f} GB")
            write(rec)
            t_log, tokens_since, loss_acc = time.perf_counter(), 0, torch.zeros((), device=device)
        if (args.eval_every and done % args.eval_every == 0) or done == args.max_steps:
            t_eval = time.perf_counter()
            val = evaluate(fwd_model, data_dir, args, device, tok.name)
            log(f"step {done:6d} | val loss {val:.4f} | train time {train_time:.1f} s | eval {time.perf_counter() - t_eval:.1f} s")
            write({"step": done, "val_loss": val, "time_s": train_time})
            t_log += time.perf_counter() - t_eval  # evaluation time is not training throughput
        # 7. checkpoint
        if done % args.ckpt_every == 0 or done == args.max_steps:
            t_ck = time.perf_counter()
            save_checkpoint(out_dir, done, model, opt, scaler, loader, args, margs, args.keep_ckpts)
            t_log += time.perf_counter() - t_ck
    metrics.close()

    if args.sample_tokens > 0:
        prompt = [data.bos_id(tok)] + tok.encode_ordinary("\n")
        g = torch.Generator(device=device).manual_seed(args.seed)
        new = M.generate(model, prompt, min(args.sample_tokens, args.seq_len - len(prompt)),
                         temperature=0.8, top_k=200, generator=g, n_vocab=tok.n_vocab)
        log("-" * 60 + "\n" + tok.decode(new[0].tolist()) + "\n" + "-" * 60)


if __name__ == "__main__":
    try:
        main()
    except (ConfigError, data.DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
