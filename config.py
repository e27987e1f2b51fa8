"""A run's configuration: the command line's flags, their checks, the device and the process.

train.py, sft.py, dpo.py, reward.py, rl.py and distill.py share one parser (get_parser; each script adds its own
flags) and one gate, check_config, which refuses every bad input (a flag out of range, a tokenizer
larger than the model, a layout that does not divide the world or the heads, a model too large for
the device's memory) on every rank, in one line, before any process talks or the output folder is
touched. configure_process then has launch.py make the process-wide settings once, from the command
line, never from a library function. --ramp's stages (Llama 3's growing batch and sequence length,
ramp.py) are checked here too.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import re
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

import torch

import checkpoint
import costs
import data
import launch
import loss
import model as M
import parallel as P
import ramp


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


def check_lora(args, margs, recipe):
    """LoRA's flags against the recipe and the model: one line for each that cannot work."""
    lora = lora_of(args)
    if lora is None:
        return
    if recipe.kind == "pretraining":
        raise ConfigError("--lora-rank: LoRA adapts a trained model; use it with sft.py, dpo.py, reward.py or "
                          "rl.py (train.py trains every weight)")
    check_lora_shape(*lora, margs)
    if args.zero == 3:
        raise ConfigError("--zero 3 shards the weights the optimizer trains, which under LoRA are the adapters "
                          "alone: use --zero 1 or 2 (the frozen model stays whole on each rank)")


def check_experts(args, margs, layout: P.Layout):
    """Expert parallelism against the model and the layout, and what a mixture of experts does not
    train with yet: refused in one line."""
    if layout.ep > 1 and not margs.n_experts:
        raise ConfigError(f"--ep {layout.ep}: model {args.model} is dense; expert parallelism cuts a mixture "
                          "of experts' experts (e.g. --model moe-tiny)")
    if layout.ep > 1 and (margs.n_experts % layout.ep or layout.dp % layout.ep):
        raise ConfigError(f"--ep {layout.ep} must divide the {margs.n_experts} experts and dp {layout.dp} (the "
                          "expert-parallel ranks are dp ranks)")
    if not margs.n_experts:
        return
    for flag, given in ((f"--tp {layout.tp}", layout.tp > 1), (f"--cp {layout.cp}", layout.cp > 1),
                        ("--zero 3", layout.zero == 3), ("--lora-rank", args.lora_rank is not None),
                        (f"--zero {layout.zero} with --ep", layout.ep > 1 and layout.zero > 1)):
        if given:
            raise ConfigError(f"{flag}: a mixture of experts does not train with it yet (it does with dp, pp, ep, "
                              "ZeRO-1, ZeRO-2 without ep, activation checkpointing and --compile)")


def check_lora_shape(rank: int, alpha: float, targets, margs):
    """The targets name linears of a block, and the rank fits every one of them."""
    unknown = [t for t in targets if t not in M.LORA_TARGETS]
    if unknown or not targets:
        raise ConfigError(f"--lora-targets {','.join(targets)!r}: {', '.join(unknown) or 'nothing'} matches no "
                          f"linear of a block; they are {', '.join(M.LORA_TARGETS)}")
    smallest = min(min(costs.lora_shapes(margs)[t]) for t in targets)
    if not 1 <= rank <= smallest:
        raise ConfigError(f"--lora-rank {rank}: must be at least 1 and at most the smallest side of a targeted "
                          f"matrix ({smallest})")
    if not 0 < alpha < math.inf:
        raise ConfigError(f"--lora-alpha {alpha}: must be a positive number")


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


# ----------------------------------------------------------------------------------------------------
# Their checks: everything a run cannot use, refused before anything is read, written or allocated


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


TRACKERS = {"wandb": "wandb", "tensorboard": "tensorboard"}  # flag -> what `pip install` needs


def check_trackers(args):
    """A tracker flag without its package, refused before the run (logs.Trackers imports it)."""
    for flag, package in TRACKERS.items():
        if getattr(args, flag) and importlib.util.find_spec(package) is None:
            raise ConfigError(f"--{flag} needs the {package} package: pip install {package}")


class Spec(NamedTuple):
    """What check_config found: device, precision, tokenizer, model shape, --ramp's stages, layout."""
    device: torch.device
    precision: str
    tok: object  # a tiktoken Encoding
    margs: M.ModelArgs
    attention: str  # the kernel that computes the attention: flex, flash, cudnn, efficient or math
    ramp: list | None = None
    loss_chunk: int = 0  # tokens the loss takes at a time (0: the whole micro-batch's logits; loss_chunk_of)
    layout: P.Layout = P.Layout()  # the parallel layout (layout_of), which the mesh is made of


def check_config(args, recipe) -> Spec:
    """The module docstring's gate: the flags, the device, the tokenizer, the layout, the memory."""
    validate(args)
    for flag, why in recipe.unused_flags.items():  # given all the same, they would do nothing
        value = getattr(args, flag)
        if value is not None:
            given = f"--{'no-' * (value is False)}{flag.replace('_', '-')}" + ("" if isinstance(value, bool)
                                                                              else f" {value}")
            raise ConfigError(f"{given}: {why}")
    world = launch.launch_env()[1]
    device, precision = pick_device_and_precision(args)
    masked = check_attention(args, device, recipe.masked_attention())
    check_trackers(args)
    tok = recipe.tokenizer()
    margs = recipe.model_args(tok)
    check_lora(args, margs, recipe)
    layout = layout_of(args, world)
    check_experts(args, margs, layout)
    fits = layout.world == world  # (else check_layout says why)
    stages = check_ramp(args, layout.dp) if args.ramp and fits else None
    for stage in stages or [None]:  # each stage's shape must fit: the layout, and the memory of the largest
        if stage:
            ramp.enter(args, stage, layout.dp)
        check_shape(args, layout, world, margs, device, precision, recipe,
                    bool(masked) or recipe.documents_masked())
    if stages:
        ramp.enter(args, stages[0], layout.dp)
    kernel = attention_kernel(args, margs, device, precision, masked, recipe.documents_masked())
    check_anneal(args, layout.dp)
    checkpoint.check_out_dir(Path(args.out_dir))
    check_overwrite(args)
    return Spec(device, precision, tok, margs, kernel, stages, loss_chunk_of(args, recipe, stages), layout)


def layout_of(args, world: int) -> P.Layout:
    """The run's parallel layout, from its flags: dp is what the world leaves (check_layout refuses a
    world that tp x cp x pp does not divide)."""
    cut = args.tp * args.cp * args.pp
    return P.Layout(tp=args.tp, cp=args.cp, pp=args.pp, dp=world // cut if cut > 0 else 0, sp=args.sp,
                    zero=args.zero, schedule=args.schedule, virtual=args.virtual_stages,
                    split=parse_pp_layers(args.pp_layers) if args.pp > 1 else None, ep=args.ep)


def loss_chunk_of(args, recipe, stages) -> int:
    """The run's --loss-chunk as its loss applies it (loss.loss_chunk_used), decided once for the whole run:
    under --ramp, for its longest sequences, so a run resumed in a later stage computes its loss as the
    run that started it did."""
    if not recipe.head_in_loss:
        return 0
    seq_len = max(s.seq_len for s in stages) if stages else args.seq_len
    return loss.loss_chunk_used(args.loss_chunk, args.micro_batch * seq_len // args.cp, args.zero)


def check_shape(args, layout: P.Layout, world: int, margs, device, precision: str, recipe,
                masked: bool = False):
    """Sequence length, layout and memory for these settings (masked: check_attention's verdict)."""
    if args.seq_len > margs.max_seq_len:
        raise ConfigError(f"--seq-len {args.seq_len} exceeds the model's max_seq_len {margs.max_seq_len}")
    parse_pp_layers(args.pp_layers)  # a malformed --pp-layers is refused here, whatever --pp is
    try:
        check_layout(layout, world, margs, args.grad_accum, args.seq_len)
        if layout.pp > 1:  # interleaved: --pp-layers counts each model chunk's layers, pp x virtual of them
            P.stage_layers(margs.n_layers, layout.pp * layout.virtual, layout.split)
    except P.LayoutError as e:
        raise ConfigError(f"invalid parallel layout{ramp_stage(args)}: {e}") from None
    if args.precision == "fp8" and device.type == "cuda":
        check_fp8_shapes(margs, layout, args.micro_batch * recipe.rows_per_example * args.seq_len // layout.cp)
    check_memory(margs, args, layout, device, precision, recipe.rows_per_example, recipe.frozen_copies,
                 args.loss_chunk if recipe.head_in_loss else 0, masked)


def check_fp8_shapes(margs, layout: P.Layout, tokens: int):
    """CUDA's float8 matmul takes sides that are multiples of 16: a micro-batch's tokens on a rank and
    every side of a block's linears on a tp rank."""
    tp, kv = layout.tp, margs.n_kv_heads * margs.head_dim
    sides = {"tokens in a micro-batch on a rank (--micro-batch x --seq-len / cp)": tokens, "dim": margs.dim,
             "the heads' width / tp": margs.n_heads * margs.head_dim // tp, "the kv heads' width / tp": kv // tp,
             "the FFN's hidden size / tp": margs.hidden_dim // tp, "the experts' hidden size": margs.expert_dim}
    bad = [f"{name} {n}" for name, n in sides.items() if n % 16]
    if bad:
        raise ConfigError(f"--precision fp8 on CUDA needs multiples of 16, and {', '.join(bad)} are not")


def check_attention(args, device, masked: str | None) -> str | None:
    """Refuse an --attn-backend this device lacks, or one a masked attention (by the recipe or --cp)
    never reaches. Returns why it is masked (None: plain causal)."""
    backend = args.attn_backend
    masked = masked or ("--cp gives each rank's queries their keys by a mask" if args.cp > 1 else None)
    if backend in ("cudnn", "efficient") and device.type != "cuda":
        raise ConfigError(f"--attn-backend {backend} runs on CUDA GPUs only, and this run is on {device.type}: "
                          "use auto, flash or math")
    if masked and backend != "auto":
        raise ConfigError(f"--attn-backend {backend} computes an unmasked causal attention, and this run's is "
                          f"masked in every batch ({masked}): leave it at auto (FlexAttention on a GPU)")
    return masked


def attention_kernel(args, margs: M.ModelArgs, device, precision: str, masked: str | None,
                     documents: bool = False) -> str:
    """The run's attention kernel, asked of costs.attention_kernel with this rank's heads at up to
    1,024 positions (flex where masked on a GPU); refuses an --attn-backend that cannot run it.
    documents (--doc-mask, not masked in every batch): then that of the batches where documents meet."""
    if documents and not masked:
        where = attention_kernel(args, margs, device, precision, "documents meet")
        return f"{attention_kernel(args, margs, device, precision, None)} ({where} where documents meet)"
    if masked and device.type in M.BLOCK_MASK_DEVICES:
        return "flex"
    T, dtype = min(args.seq_len, 1024), M.DTYPES[precision]
    q = torch.empty(1, margs.n_heads // args.tp, T, margs.head_dim, device=device, dtype=dtype)
    kv = torch.empty(1, margs.n_kv_heads // args.tp, T, margs.head_dim, device=device, dtype=dtype)
    mask = torch.ones(T, T, dtype=torch.bool, device=device).tril() if masked else None
    try:
        return costs.attention_kernel(q, kv, kv, mask, not masked, args.attn_backend)
    except ValueError as e:
        raise ConfigError(f"--attn-backend {args.attn_backend} cannot compute this run's attention ({precision}, "
                          f"head_dim {margs.head_dim}) on {device}: {e}") from None


def check_layout(layout: P.Layout, world: int, args: M.ModelArgs, micro_batches: int, seq_len: int):
    """Every reason a layout cannot work in a job of `world` processes, in one message naming the
    numbers. Pure arithmetic: each rank reaches the same verdict without talking to the others."""
    tp, cp, pp, sp = layout.tp, layout.cp, layout.pp, layout.sp
    virtual, schedule = layout.virtual, layout.schedule
    errors = []
    if tp < 1 or pp < 1 or cp < 1:
        errors.append(f"--tp {tp}, --cp {cp} and --pp {pp} must be at least 1")
    elif world % (tp * cp * pp):
        errors.append(f"world size {world} is not divisible by tp*cp*pp = {tp}*{cp}*{pp} = {tp * cp * pp}")
    if cp > 1 and seq_len % (2 * cp):
        errors.append(f"context parallelism needs --seq-len {seq_len} divisible by 2*cp = {2 * cp} (each "
                      "rank holds two of 2*cp equal chunks)")
    if tp >= 1 and args.n_heads % tp:
        errors.append(f"n_heads {args.n_heads} is not divisible by tp {tp}")
    if tp >= 1 and args.n_kv_heads % tp:
        errors.append(f"n_kv_heads {args.n_kv_heads} is not divisible by tp {tp}")
    if pp > args.n_layers:
        errors.append(f"pp {pp} stages need at least {pp} layers, the model has {args.n_layers}")
    if pp > 1 and args.tie_embeddings:
        errors.append("tied embeddings across pipeline stages are not supported (the embedding lives on the "
                      "first stage, the head on the last); use pp 1 or an untied model")
    if pp > 1 and schedule == "1f1b" and micro_batches < pp:
        errors.append(f"1F1B needs at least as many micro-batches (--grad-accum {micro_batches}) as stages "
                      f"(pp {pp})")
    if (schedule == "interleaved") != (virtual > 1):
        errors.append(f"--schedule {schedule} with --virtual-stages {virtual}: the interleaved schedule, and "
                      "only it, needs 2 or more model chunks per rank")
    elif virtual > 1 and pp > 1 and micro_batches % pp:
        errors.append(f"the interleaved schedule needs --grad-accum {micro_batches} divisible by pp {pp} "
                      "(micro-batches go through each chunk in groups of pp)")
    if virtual > 1 and pp * virtual > args.n_layers:
        errors.append(f"pp {pp} x {virtual} virtual stages need at least {pp * virtual} layers, the model "
                      f"has {args.n_layers}")
    if sp and cp >= 1 and (seq_len // cp) % tp:
        errors.append(f"sequence parallelism needs each rank's --seq-len / cp = {seq_len}/{cp} tokens "
                      f"divisible by tp {tp}")
    if errors:
        raise P.LayoutError("; ".join(errors))


def ramp_stage(args) -> str:
    return f" at --ramp's stage of {args.seq_len}-token sequences" if args.ramp else ""


def check_memory(margs, args, layout: P.Layout, device, precision: str, rows_per_example: int = 1,
                 frozen_copies: float = 0, chunk: int = 0, masked: bool = False):  # chunk: --loss-chunk's
    """Refuse a model that cannot fit, before any of it is allocated: one process's busiest pipeline
    stage (costs.memory_estimate, rows_per_example rows an example, kept as costs.kept_by says; plus
    frozen copies of its weights: DPO's reference, 1; distill.py's teacher, its size in the student's),
    or the model while built (costs.build_bytes) if that is more, against what the device has free."""
    lora = lora_of(args)
    est_lora = (lora[0], lora[2]) if lora else None  # (rank, targets)
    kept = costs.kept_by(device.type, precision, args.attn_backend, masked, args.compile, args.dropout > 0)
    shape = costs.Shape(args.micro_batch * rows_per_example, args.seq_len, precision, args.grad_accum,
                        args.act_ckpt, chunk)
    est = costs.memory_estimate(margs, layout, shape, bucket_mb=args.bucket_mb, lora=est_lora, kept=kept)
    if frozen_copies:  # in the training precision, cut as the trained model is
        est["frozen"] = frozen_copies * costs.BYTES[precision] * max(costs.stage_params(margs, layout, s)
                                                                      for s in range(layout.pp))
        est["total"] += est["frozen"]
    build = max(costs.build_bytes(margs, layout, precision, s, est_lora) for s in range(layout.pp))
    have, need = costs.available_memory(device), max(est["total"], build)
    if have is not None and need > have and args.memory_check:
        parts = ", ".join(f"{k} {v / 1e9:.1f}" for k, v in est.items() if k != "total" and v >= 0.05e9)
        built = f"; {build / 1e9:.1f} GB while it is built" if build > est["total"] else ""
        what = f"--init {args.init}" if getattr(args, "init", None) else f"model {args.model}"  # (what is built)
        raise ResourceError(f"{what} ({costs.count_params(margs) / 1e6:,.1f}M parameters) needs about "
                            f"{need / 1e9:.1f} GB per process "
                            f"({parts} GB{built}) but {device.type} has {have / 1e9:.1f} GB available, "
                            f"{(need - have) / 1e9:.1f} GB short; use a smaller model or micro-batch, shard it "
                            "over more processes (--tp, --pp, --zero 1-3), a device with more memory, or "
                            "--no-memory-check to try it all the same")


# Flags a node may give its own value: paths on its own disks (what they hold is compared once read: the
# data's fingerprint, the vocabulary), its own device, its logging. Every other flag shapes the run; and a
# multi-node launch runs one command per node, which nothing else makes equal (check_ranks_agree).
PER_NODE = {"data", "anneal_data", "mirror", "out_dir", "init", "tokenizer", "eval_tasks", "tensorboard", "wandb",
            "device", "prompts", "reward", "reward_fn"}


def check_ranks_agree(args, device):
    """Refuse a job whose ranks were given different run-shaping flags: a rank at another --micro-batch,
    --lr or --tp would train on, or hang in a group its peers never build. It joins the job (the world
    group) and compares every rank's flags before any other group exists; every rank refuses alike."""
    rank, world = launch.launch_env()
    if world == 1:
        return
    if not torch.distributed.is_initialized():
        launch.join_job(rank, world, device, args.dist_timeout)
    everyone = [None] * world
    torch.distributed.all_gather_object(everyone, {k: v for k, v in vars(args).items() if k not in PER_NODE})
    refuse_differences(everyone)


def refuse_differences(everyone: list[dict]):
    """ConfigError naming the first setting that differs between ranks (everyone: each rank's, in rank
    order), and which ranks have which value."""
    for key in everyone[0]:
        ranks: dict[str, list[int]] = {}
        for r, settings in enumerate(everyone):
            ranks.setdefault(repr(settings.get(key)), []).append(r)
        if len(ranks) > 1:
            name = key if " " in key else f"--{key.replace('_', '-')}"  # (a flag, or a value read: "the data's ...")
            values = " and ".join(f"{value} on rank{'s' * (len(rs) > 1)} {', '.join(map(str, rs))}"
                                  for value, rs in ranks.items())
            raise ConfigError(f"the ranks of this job differ in {name}: {values}; every rank needs the same "
                              "settings (one command on every node, paths aside)")


def check_overwrite(args):
    """--overwrite deletes an earlier run's checkpoints and metrics in --out-dir, so what this run
    reads (--init, --data, --anneal-data) may not lie inside it."""
    if not args.overwrite:
        return
    out = Path(args.out_dir).expanduser().resolve()
    reads = [("init", getattr(args, "init", None))] + [
        (flag, source) for flag in ("data", "anneal_data") if getattr(args, flag, None)
        for source, _ in data.parse_mixture(getattr(args, flag))]
    for flag, path in reads:
        where = Path(str(path)).expanduser() if path else None
        if where is not None and where.exists() and (out == where.resolve() or out in where.resolve().parents):
            raise ConfigError(f"--overwrite would delete what --{flag.replace('_', '-')} {path} reads: it is "
                              f"inside --out-dir {args.out_dir}; write this run to another --out-dir")


def check_anneal(args, dp: int):
    if args.anneal_tokens < 0:
        raise ConfigError(f"--anneal-tokens {args.anneal_tokens} must be 0 (no annealing) or more")
    if args.anneal_data and not args.anneal_tokens:
        raise ConfigError("--anneal-data needs --anneal-tokens: how many of the run's last tokens to "
                          "anneal on")
    start = anneal_start(args, dp)
    if start is not None and start < 0:
        total = args.max_steps * args.micro_batch * args.grad_accum * dp * args.seq_len
        raise ConfigError(f"--anneal-tokens {args.anneal_tokens:,} is more than the run's {total:,} tokens "
                          f"(--max-steps {args.max_steps} x {total // args.max_steps:,} tokens a step)")


# ----------------------------------------------------------------------------------------------------
# The batch and sequence-length ramp (--ramp, ramp.py): its flags and stages checked


def check_ramp_flags(args, given: set[str]):
    """Refuse --seq-len or --grad-accum given beside --ramp (given_flags: whatever their values)."""
    both = [f"--{f.replace('_', '-')} {getattr(args, f)}" for f in ("seq_len", "grad_accum") if f in given]
    if args.ramp is not None and both:
        raise ConfigError(f"--ramp sets the sequence length and the accumulation stage by stage: leave out "
                          f"{' and '.join(both)}")


def check_ramp(args, dp: int) -> list[ramp.Stage]:
    """--ramp's stages, each checked against the flags (its layout and memory: check_config)."""
    try:
        stages = ramp.parse(args.ramp)
        beyond = [s for s in stages if s.start >= args.max_steps]
        if beyond:
            total = ramp.tokens_before(stages, args.max_steps)
            raise ConfigError(f"--ramp stage at {beyond[0].tokens:,} tokens would start at step "
                              f"{beyond[0].start}, not within the run's --max-steps {args.max_steps} "
                              f"({total:,} tokens): lower it or train longer")
        if args.anneal_tokens:
            raise ConfigError("--anneal-tokens counts steps of one size; with --ramp, end the run with a last "
                              "stage instead")
        for stage in stages:
            ramp.enter(args, stage, dp)
    except ramp.RampError as e:
        raise ConfigError(str(e)) from None
    return stages


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
