"""A run's configuration: the command line's flags, what they make, the device and the process.

train.py, sft.py, dpo.py, reward.py, rl.py and distill.py share one parser (get_parser; each script adds its own
flags). parse fits the defaults a user did not give to the run; validate refuses a value no run can use
(a count below 1, a rate out of range, a path too long); model_args_from and layout_of make the model's
shape and the parallel layout of them. checks.py's gate, check_config, then refuses what this machine,
model and layout cannot do. configure_process has launch.py make the process-wide settings once, from
the command line, never from a library function; run turns a refusal into one line and exit code 1.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

import checkpoint
import data
import launch
import model as M
import parallel as P


class ConfigError(Exception):
    """A user-facing error: printed as one line, exit code 1."""


class ResourceError(ConfigError):
    """This machine cannot run the job (too little memory): every rank that finds it says so."""


# ----------------------------------------------------------------------------------------------------
# The flags


def get_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Pretrain a Llama 3 model: `python train.py` (or `torchrun "
                                            "--standalone --nproc_per_node=1 train.py`).",
                                formatter_class=launch.HelpFormatter)
    add_model_flags(p)
    add_data_flags(p)
    add_optimization_flags(p)
    add_lora_flags(p)
    add_memory_and_speed_flags(p)
    add_parallel_flags(p)
    add_run_flags(p)
    return p


# The default run (`python train.py`) is sized for a laptop's CPU: mini, 8 x 128 tokens a step, 2,400
# steps. On a CUDA GPU, with none of the flags that size a run given, it is nanoGPT's GPU recipe for the
# same text in shape (6 layers of 384, 64 sequences of 256 characters a step, dropout 0.2) sized to the
# data: its cosine schedule ends after 900 steps (about fourteen passes over the 1M training tokens), with
# dropout and a weight decay of 0.5 against memorizing them (Llama 3's 0.1 is for tokens seen once: at 0.1
# the same run ended at 1.4785, at 0.5 at 1.4700). The README gives its curve, measured on an H200.
SIZE_FLAGS = {"model", "dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "data", "tokenizer", "seq_len",
              "micro_batch", "grad_accum", "ramp", "lr", "warmup", "max_steps", "dropout", "weight_decay"}
GPU_DEFAULT = dict(model="small", seq_len=256, micro_batch=64, lr=1e-3, warmup=60, max_steps=900, dropout=0.2,
                   weight_decay=0.5)


def given_flags(p: argparse.ArgumentParser, argv=None) -> set[str]:
    """The flags (as args' names) that argv names, spelled in full, abbreviated or with '='."""
    unset = object()  # argparse sets a default only where the namespace has no value yet
    seen = p.parse_args(argv, argparse.Namespace(**{a.dest: unset for a in p._actions}))
    return {name for name, value in vars(seen).items() if value is not unset}


def parse(p: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """A script's command line: its args, with the defaults it did not give fitted to the run."""
    args, given = p.parse_args(argv), given_flags(p, argv)
    check_ramp_flags(args, given)
    fit_defaults(args, given)
    return args


def fit_defaults(args, given: set[str]):
    """A default the user did not give never refuses a run: --warmup, unless given, is at most a tenth
    of --max-steps (train.py's 100 of 2,400 steps stand; --max-steps 20 warms up for 2 steps). A
    given --warmup longer than the run is still refused (validate)."""
    if "warmup" not in given:
        args.warmup = min(args.warmup, args.max_steps // 10)


def sized_for_the_device(args, given: set[str], device_type: str) -> str | None:
    """GPU_DEFAULT on a CUDA device where no SIZE_FLAGS were given; returns the line that says so."""
    if device_type != "cuda" or given & SIZE_FLAGS:
        return None
    vars(args).update(GPU_DEFAULT)
    return ("no flag sizes this run, and it is on a GPU: " + ", ".join(f"--{k.replace('_', '-')} {v}"
                                                                       for k, v in GPU_DEFAULT.items()))


def flag_group(p: argparse.ArgumentParser, title: str, only=None):
    """A group's add_argument; with only (a set of flags), one that adds just those, as train.py has
    them: bench.py takes the train.py flags it passes on from here."""
    g = p.add_argument_group(title)
    return lambda flag, **kw: g.add_argument(flag, **kw) if only is None or flag in only else None


def add_data_flags(p: argparse.ArgumentParser, only=None):
    add = flag_group(p, "data", only)
    add("--data", default="tinyshakespeare",
        help="registry name, text/JSONL file or glob, or a folder of prepared shards; or a "
             "mixture of them, e.g. c4_demo:0.5,wiki_demo:0.3,tinyshakespeare:0.2 (weights "
             "normalized; a part naming an existing file or folder whole is that source, so the "
             "file x:2 at weight 0.5 is x:2:0.5; each source once, under any spelling)")
    add("--anneal-tokens", type=int, default=0,
        help="anneal over the run's last N tokens: the learning rate falls linearly to 0 from "
             "wherever the schedule is, and the data switches to --anneal-data if given")
    add("--anneal-data", default=None, help="the mixture to anneal on (same form as --data)")
    add("--tokenizer", default="byte",
        help="byte, gpt2, cl100k_base, o200k_base, llama3, or a path to a Llama 3 tokenizer.model "
             "(sft.py, dpo.py: the one --init was trained with)")
    add("--mirror", default=None, help="local mirror folder for downloads (default: $DATA_MIRROR)")
    add("--seq-len", type=int, default=128, help="tokens per sequence (T)")
    add("--doc-mask", action=argparse.BooleanOptionalAction, default=None,
        help="attend only within each document of a sequence (they start at <|begin_of_text|>), "
             "positions restarting per document (default: on for the llama presets)")
    add("--micro-batch", type=int, default=8, help="sequences per micro-batch")
    add("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    add("--ramp", default=None,
        help="batch and sequence-length stages TOKENS:SEQ_LENxSEQUENCES, e.g. Llama 3 405B's "
             "0:4096x1024,252M:8192x1024,2.87T:8192x2048 (K, M, B, T suffixes; the first at 0): "
             "from TOKENS seen on, each step is SEQUENCES of SEQ_LEN tokens; it sets --seq-len and "
             "--grad-accum (SEQUENCES / (micro-batch x dp)) stage by stage")


def add_model_flags(p: argparse.ArgumentParser, only=None):
    add = flag_group(p, "model", only)
    add("--model", default="mini", help=f"preset: {', '.join(M.PRESETS)}")
    for flag in ("dim", "n-layers", "n-heads", "n-kv-heads", "vocab-size"):
        add(f"--{flag}", type=int, default=None, help="override the preset")
    add("--rope-scaling", default=None, metavar="FACTOR:LOW:HIGH:ORIGINAL",
        help="Llama 3.1's RoPE frequency scaling, e.g. 8:1:4:8192 (factor, low and high frequency "
             "factors, original context), or none; default: the preset's (the context grows to "
             "factor x original)")


def add_optimization_flags(p: argparse.ArgumentParser, only=None):
    add = flag_group(p, "optimization", only)
    add("--lr", type=float, default=3e-3, help="peak learning rate")
    add("--min-lr-ratio", type=float, default=0.1, help="cosine floor, as a fraction of --lr")
    add("--warmup", type=int, default=100,
        help="linear warmup steps (not given: at most a tenth of --max-steps)")
    add("--max-steps", type=int, default=2400,
        help="optimizer steps in all (the cosine ends here)")
    add("--weight-decay", type=float, default=0.1, help="AdamW decoupled decay (matrices only)")
    add("--dropout", type=float, default=0.0,
        help="probability of dropping each element of the embedding's and every block branch's "
             "output while training (0: none, as Llama 3)")
    add("--beta1", type=float, default=0.9, help="AdamW first-moment decay")
    add("--beta2", type=float, default=0.95, help="AdamW second-moment decay")
    add("--grad-clip", type=float, default=1.0, help="max global gradient norm (0: off)")
    add("--moe-aux-coef", type=float, default=0.01,
        help="a mixture of experts' load-balancing loss (Switch Transformer's) enters the loss times this")
    add("--precision", default="auto", choices=["auto", "fp32", "bf16", "fp16", "fp8"],
        help="auto: bf16 on CUDA, fp32 elsewhere; fp8: bf16 training whose blocks' linears multiply in "
             "float8 (an FP8 GPU: sm_89 or newer; a CPU)")


def add_lora_flags(p: argparse.ArgumentParser, only=None):
    add = flag_group(p, "LoRA (sft.py, dpo.py, reward.py, rl.py; bench.py --plan)", only)
    add("--lora-rank", type=int, default=None, metavar="R",
        help="train low-rank updates of rank R beside the frozen model (LoRA), not every weight")
    add("--lora-alpha", type=float, default=None, metavar="A",
        help="the updates are scaled by A / R (default: A = 2R)")
    add("--lora-targets", default=None,
        help=f"the linears of every block that get an update (default: {','.join(M.LORA_TARGETS)})")


def lora_of(args) -> tuple[int, float, tuple[str, ...]] | None:
    """(rank, alpha, targets), or None without --lora-rank (then the other two are refused)."""
    if args.lora_rank is None:
        if args.lora_alpha is not None or args.lora_targets is not None:  # (None: not given)
            raise ConfigError("--lora-alpha and --lora-targets shape LoRA's updates: they need --lora-rank R")
        return None
    alpha = args.lora_alpha if args.lora_alpha is not None else 2.0 * args.lora_rank
    targets = args.lora_targets if args.lora_targets is not None else ",".join(M.LORA_TARGETS)
    return args.lora_rank, alpha, tuple(t.strip() for t in targets.split(",") if t.strip())


def add_memory_and_speed_flags(p: argparse.ArgumentParser, only=None):
    add = flag_group(p, "memory and speed", only)
    add("--act-ckpt", nargs="?", const="full", default=None, choices=["full", "selective"],
        help="activation checkpointing: full (the flag alone) recomputes each block in backward; "
             "selective keeps its matmuls' and attention's outputs and recomputes only the "
             "element-wise work, for less memory saved at a fraction of the recomputation")
    add("--compile", action="store_true", help="torch.compile each transformer block and the loss's "
        "arithmetic on each chunk of logits")
    add("--attn-backend", default="auto", choices=list(M.ATTN_BACKENDS),
        help="the causal attention's kernel: auto (SDPA's choice; K and V grouped on CUDA), flash "
             "(FlashAttention-2), cudnn (cuDNN's, CUDA only; K and V repeated), efficient (CUDA "
             "only), math (reference); an attention masked in every batch (fine-tuning's packed "
             "examples, --cp) is FlexAttention's on a GPU and refuses another kernel; under --doc-mask "
             "only the batches where documents meet are")
    add("--memory-check", action=argparse.BooleanOptionalAction, default=True,
        help="refuse a run whose estimated memory exceeds what the device has available "
             "(--no-memory-check: start it all the same)")
    add("--loss-chunk", type=int, default=1024,
        help="tokens whose logits the next-token loss makes at a time, its gradients with them: the "
             "logits of a whole micro-batch never exist at once (0: they do; --zero 3 always)")


def add_parallel_flags(p: argparse.ArgumentParser, only=None):
    add = flag_group(p, "parallelism (launch with torchrun --nproc_per_node=N; dp = N / (tp * cp * pp))", only)
    add("--tp", type=int, default=1, help="tensor-parallel size (innermost: one NVLink domain)")
    add("--cp", type=int, default=1,
        help="context-parallel size: each sequence cut along its length over cp ranks")
    add("--pp", type=int, default=1, help="pipeline-parallel stages")
    add("--pp-layers", default=None, help="layers per stage, e.g. 3,3,2 (default: balanced)")
    add("--schedule", default="1f1b", choices=["1f1b", "afab", "interleaved"],
        help="pipeline schedule (interleaved: 1F1B over --virtual-stages model chunks per rank)")
    add("--virtual-stages", type=int, default=1,
        help="model chunks per pipeline rank for --schedule interleaved (2 or more)")
    add("--sp", action="store_true", help="sequence parallelism inside the TP group")
    add("--ep", type=int, default=1,
        help="expert parallelism: a mixture of experts' experts cut over this many of the dp ranks, each "
             "token sent to its experts' ranks and back by all-to-all (it divides dp and the experts)")
    add("--zero", type=int, default=0, choices=[0, 1, 2, 3],
        help="1: shard the optimizer state over dp (ZeRO-1); 2: the fp32 gradients too (ZeRO-2); "
             "3: the weights too, gathered a layer at a time when used (ZeRO-3, FSDP)")
    add("--bucket-mb", type=float, default=25.0, help="gradient all-reduce bucket size")
    add("--dist-timeout", type=float, default=300.0,
        help="seconds before a stuck collective fails; the first step's wait as long as "
             "--io-timeout (each rank compiles it as it first runs it, some slower than others)")
    add("--io-timeout", type=float, default=3600.0,
        help="seconds ranks wait for others' disk work "
        "(data preparation, checkpoint writes and checks) before the job fails")


def add_run_flags(p: argparse.ArgumentParser, only=None):
    add = flag_group(p, "run", only)
    add("--out-dir", default="out", help="checkpoints and metrics.jsonl")
    add("--resume", action="store_true", help="continue from the latest checkpoint in --out-dir")
    add("--overwrite", action="store_true", help="start afresh even if --out-dir has checkpoints")
    add("--eval-every", type=int, default=600,
        help="validation every N steps (0: only at the end, -1: never)")
    add("--eval-batches", type=int, default=100, help="micro-batches per validation")
    add("--eval-tasks", default="", metavar="TASK[:N],...",
        help="multiple-choice benchmarks scored at each validation, as evaluate.py scores them "
             "(e.g. hellaswag:200,piqa; N: the first N items)")
    add("--ckpt-every", type=int, default=1000,
        help="checkpoint every N steps and at the end (0: never)")
    add("--ckpt-sync", action="store_true",
        help="the step waits for each checkpoint to reach the disk (default: only for its copy in host "
             "memory; a background thread writes it)")
    add("--keep-ckpts", type=int, default=2, help="how many step directories to keep")
    add("--log-every", type=int, default=100, help="log the mean of the last N steps")
    add("--sample-tokens", type=int, default=300,
        help="length of the sample printed at the end "
             "(at most --seq-len: RoPE was trained on no more)")
    add("--seed", type=int, default=1337, help="initialization and data order")
    add("--deterministic", action="store_true",
        help="bit-identical reruns: deterministic kernels on CUDA (slower); CPU runs already are")
    add("--max-skips", type=int, default=5,
        help="stop after this many consecutive skipped steps "
             "(non-finite loss or gradient, spikes)")
    add("--skip-spikes", type=float, default=0.0,
        help="skip updates whose loss exceeds this multiple of the recent mean (0: off)")
    add("--device", default=None, help="cuda, cpu, ... (default: cuda if available)")
    add("--wandb", metavar="PROJECT", help="also send metrics.jsonl's records to Weights & Biases")
    add("--tensorboard", metavar="DIR", help="also write metrics.jsonl's records for TensorBoard")
    add("--trace-step", type=int, default=None, metavar="N",
        help="record step N on every rank: --out-dir/trace_step_N.json, a Chrome trace (open it in "
             "ui.perfetto.dev) of its phases, micro-batches and collectives, and a picture of it "
             "(.png, with matplotlib)")


def model_args_from(args, vocab_size: int) -> M.ModelArgs:
    """Preset + overrides. The small presets adapt their vocabulary to the tokenizer (rounded up to
    a multiple of 64 for efficient matmuls); the published Llama 3 presets keep theirs."""
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
        margs = with_rope_scaling(replace(margs, **over), args.rope_scaling)
    except ValueError as e:
        raise ConfigError(f"invalid model dimensions: {e}") from None
    if vocab_size > margs.vocab_size:
        raise ConfigError(f"tokenizer {args.tokenizer!r} has {vocab_size} ids but model {args.model!r} has a "
                          f"vocabulary of {margs.vocab_size}")
    return margs


SHAPE_FLAGS = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size")


def init_model_args(args, margs: M.ModelArgs) -> M.ModelArgs:
    """--init's model args with --rope-scaling, which changes no weight (fine-tuning for a longer
    context is where it is set); the shape flags would change the weights, so they are refused."""
    given = [f"--{f.replace('_', '-')}" for f in SHAPE_FLAGS if getattr(args, f) is not None]
    if given:
        raise ConfigError(f"{', '.join(given)}: the model's shape is --init {args.init}'s; leave the shape "
                          "flags out (--rope-scaling may change)")
    try:
        return with_rope_scaling(margs, args.rope_scaling)
    except ValueError as e:
        raise ConfigError(f"--rope-scaling {args.rope_scaling}: {e}") from None


def with_rope_scaling(margs: M.ModelArgs, text: str | None) -> M.ModelArgs:
    """--rope-scaling applied (None: unchanged). The context grows to factor x the original one
    where that is longer than the model's: what the scaling is for."""
    if text is None:
        return margs
    scaling = parse_rope_scaling(text)
    longer = int(scaling["factor"] * scaling["original_max_seq_len"]) if scaling else 0
    return replace(margs, rope_scaling=scaling, max_seq_len=max(margs.max_seq_len, longer))


def parse_rope_scaling(text: str) -> dict | None:
    """--rope-scaling "8:1:4:8192" -> ModelArgs.rope_scaling (checked there); "none" -> None."""
    if text.strip().lower() == "none":
        return None
    try:
        factor, low, high, original = text.split(":")
        return {"factor": float(factor), "low_freq_factor": float(low), "high_freq_factor": float(high),
                "original_max_seq_len": int(original)}
    except ValueError:
        raise ConfigError(f"--rope-scaling {text!r}: expected FACTOR:LOW:HIGH:ORIGINAL (e.g. 8:1:4:8192) or "
                          "none") from None


def parse_pp_layers(text: str | None) -> list[int] | None:
    if not text:
        return None
    try:
        return [int(s) for s in text.split(",")]
    except ValueError:
        raise ConfigError(f"--pp-layers {text!r}: expected the layers of each stage, e.g. 3,3,2") from None


def anneal_start(args, dp: int) -> int | None:
    """Annealing's first step (None: off): the run's last --anneal-tokens tokens, in whole steps."""
    if not args.anneal_tokens:
        return None
    return args.max_steps - math.ceil(args.anneal_tokens / (args.micro_batch * args.grad_accum * dp *
                                                             args.seq_len))


def layout_of(args, world: int) -> P.Layout:
    """The run's parallel layout, from its flags: dp is what the world leaves (check_layout refuses a
    world that tp x cp x pp does not divide)."""
    cut = args.tp * args.cp * args.pp
    return P.Layout(tp=args.tp, cp=args.cp, pp=args.pp, dp=world // cut if cut > 0 else 0, sp=args.sp,
                    zero=args.zero, schedule=args.schedule, virtual=args.virtual_stages,
                    split=parse_pp_layers(args.pp_layers) if args.pp > 1 else None, ep=args.ep)


# ----------------------------------------------------------------------------------------------------
# Their values checked: what no run can use, whatever the machine (checks.py: against the machine, the
# model and the layout)


def validate(args):
    """Every flag value a run cannot use; NaN fails every comparison below, so ranges refuse it."""
    def need(ok: bool, name: str, rule: str):
        if not ok:
            raise ConfigError(f"--{name.replace('_', '-')} must be {rule}, got {getattr(args, name)}")
    for name in ("seq_len", "micro_batch", "grad_accum", "max_steps", "log_every", "keep_ckpts",
                 "eval_batches", "max_skips"):
        need(getattr(args, name) >= 1, name, "at least 1")
    for name in ("warmup", "ckpt_every", "sample_tokens", "loss_chunk"):
        need(getattr(args, name) >= 0, name, "at least 0")
    need(args.eval_every >= -1, "eval_every", "-1 (never), 0 (at the end) or a number of steps")
    eval_tasks(args.eval_tasks)
    need(0 < args.lr < math.inf, "lr", "a positive number")
    need(0 <= args.min_lr_ratio <= 1, "min_lr_ratio", "in [0, 1]")
    need(0 <= args.beta1 < 1, "beta1", "in [0, 1)")
    need(0 <= args.beta2 < 1, "beta2", "in [0, 1)")
    need(0 <= args.weight_decay < math.inf, "weight_decay", "a number >= 0")
    need(0 <= args.dropout < 1, "dropout", "in [0, 1)")
    need(0 <= args.grad_clip < math.inf, "grad_clip", "a number >= 0 (0: off)")
    need(0 <= args.moe_aux_coef < math.inf, "moe_aux_coef", "a number >= 0")
    need(args.skip_spikes == 0 or 1 < args.skip_spikes < math.inf, "skip_spikes",
         "0 (off) or a factor above 1")
    need(0 < args.dist_timeout < math.inf, "dist_timeout", "a positive number of seconds")
    need(0 < args.io_timeout < math.inf, "io_timeout", "a positive number of seconds")
    need(0 < args.bucket_mb < math.inf, "bucket_mb", "a positive number")
    need(0 <= args.seed < 2 ** 63, "seed", "in [0, 2^63)")
    need(args.virtual_stages >= 1, "virtual_stages", "at least 1 (2 or more with --schedule interleaved)")
    need(args.ep >= 1, "ep", "at least 1")
    need(args.trace_step is None or 1 <= args.trace_step <= args.max_steps, "trace_step",
         f"a step of the run, 1 to --max-steps {args.max_steps}")
    need(args.warmup <= args.max_steps, "warmup", f"at most --max-steps {args.max_steps} (a longer warmup "
         "never reaches --lr)")
    if args.eval_tasks and args.eval_every == -1:
        raise ConfigError(f"--eval-tasks {args.eval_tasks} is scored at each validation, and --eval-every -1 "
                          "turns validation off: give --eval-every N (0: at the end)")
    if getattr(args, "val_fraction", None) == 0 and args.eval_every != -1:
        raise ConfigError("--val-fraction 0 holds nothing out to validate on: add --eval-every -1 (no "
                          "validation), or hold out a share")
    if not str(args.out_dir).strip():
        raise ConfigError("--out-dir '' names no folder; give one (an empty name would write into the "
                          "current folder)")
    if args.resume and args.overwrite:
        raise ConfigError("--resume continues the run in --out-dir and --overwrite deletes it: pass one of "
                          "them")
    if args.act_ckpt == "selective" and args.compile:  # the policy sees a compiled block as one opaque call
        raise ConfigError("--act-ckpt selective does not work with --compile yet (it would recompute every "
                          "compiled block whole): use --act-ckpt full, or leave out --compile")
    check_path_lengths(args)


def eval_tasks(spec: str) -> list[tuple[str, int | None]]:
    """--eval-tasks "hellaswag:200,piqa" -> [("hellaswag", 200), ("piqa", None)]: a benchmark (or a
    file of items) and how many of its first items to score (None: all)."""
    tasks = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, sep, limit = part.rpartition(":") if re.fullmatch(r".+:\w*", part) else (part, "", "")
        if sep and not (limit.isdigit() and int(limit) >= 1):
            raise ConfigError(f"--eval-tasks {part!r}: the number after ':' is how many items, at least 1")
        same = [n for n, _ in tasks if task_key(n) == task_key(name)]  # (a file under two spellings too)
        if same:
            twice = name if same[0] == name else f"{same[0]} and {name}, one file,"
            raise ConfigError(f"--eval-tasks names {twice} twice: one entry a benchmark (NAME:N scores its "
                              "first N items)")
        tasks.append((name, int(limit) if limit else None))
    return tasks


def task_key(name: str) -> str:
    """What an --eval-tasks entry names: a file by its real path (./x.jsonl, x.jsonl, a link to it), else
    the benchmark."""
    path = Path(name).expanduser()
    return os.path.realpath(path) if os.path.isfile(path) else name


NAME_MAX = 255  # bytes in one file or folder name, on every common file system


def check_path_lengths(args):
    """A path component over NAME_MAX makes every look at it fail (even Path.exists raises)."""
    paths = [(flag, getattr(args, flag, None)) for flag in ("out_dir", "init", "tokenizer", "mirror",
                                                             "tensorboard")]
    paths += [(flag, part) for flag in ("data", "anneal_data")
              for part in str(getattr(args, flag) or "").split(",")]
    for flag, path in paths:
        long = [c for c in Path(str(path or "")).parts if len(c.encode()) > NAME_MAX]
        if long:
            raise ConfigError(f"--{flag.replace('_', '-')}: the name {long[0][:40]}... is "
                              f"{len(long[0].encode())} bytes long; file systems allow {NAME_MAX}")


def check_ramp_flags(args, given: set[str]):
    """Refuse --seq-len or --grad-accum given beside --ramp (given_flags: whatever their values)."""
    both = [f"--{f.replace('_', '-')} {getattr(args, f)}" for f in ("seq_len", "grad_accum") if f in given]
    if args.ramp is not None and both:
        raise ConfigError(f"--ramp sets the sequence length and the accumulation stage by stage: leave out "
                          f"{' and '.join(both)}")


# ----------------------------------------------------------------------------------------------------
# The device and the process


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
    if device.type == "cuda" and device.index is None:  # one GPU per process: torchrun's LOCAL_RANK
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    if device.type == "cuda" and device.index >= torch.cuda.device_count():
        raise ConfigError(f"GPU {device.index} asked for (--device or LOCAL_RANK), but this process sees "
                          f"{torch.cuda.device_count()}; start at most that many processes per node")
    precision = args.precision
    if precision == "auto":
        precision = "bf16" if device.type == "cuda" else "fp32"
    if precision == "fp8":  # bf16 training but for the blocks' matmuls (train.py: model.set_fp8)
        check_fp8(device)
        precision = "bf16"
    return device, precision


def check_fp8(device):
    """Float8 matmuls (torch._scaled_mm) run on a CPU and on CUDA GPUs from sm_89 (Ada, Hopper) on."""
    if device.type == "mps":
        raise ConfigError("--precision fp8: MPS has no float8 matmul; use bf16")
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        raise ConfigError(f"--precision fp8: {torch.cuda.get_device_name(device)} (sm_{major}{minor}) has no "
                          "float8 matmul (sm_89 or newer: Ada, Hopper, Blackwell); use bf16")


def configure_process(args):
    """Before train(): the flags checked, torchrun's variables too, then launch.configure_process's
    process-wide settings (seeds, this process's GPU, TF32, --deterministic) for the chosen device."""
    validate(args)
    launch.launch_env()
    launch.configure_process(pick_device_and_precision(args)[0], args.seed, args.deterministic)


def run(main_fn, argv=None):
    """main_fn() with user errors as one line on stderr (from rank 0, the rank whose input is bad,
    or each rank whose collective failed) and a non-zero exit; torchrun then stops the others."""
    rank = launch.env_rank()
    try:
        main_fn(argv)
    except (ConfigError, checkpoint.CheckpointError, launch.LaunchError) as e:
        if rank == 0 or isinstance(e, (ResourceError, launch.LaunchError)):
            print(f"error: {e}" if rank == 0 else f"error (rank {rank}): {e}", file=sys.stderr)
        else:  # rank 0 says it; leave after it does, or torchrun (which stops the job at the first exit)
            time.sleep(5)  # may kill rank 0 before its line is out
        sys.exit(1)
    except data.DataError as e:
        print(f"error: {e}" if rank == 0 else f"error (rank {rank}): {e}", file=sys.stderr)
        sys.exit(1)
    except launch.CommError as e:  # every rank that saw it says so: the ranks named are the ones to look at
        print(f"error (rank {rank}): {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
