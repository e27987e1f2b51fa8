"""The gate every script passes before it runs: check_config refuses what a run cannot do here.

config.py reads the flags and refuses values no run can use. check_config takes them with the recipe
and this machine, and refuses everything else a run cannot do, on every rank, in one line, before any
process talks or the output folder is touched. Contents, in reading order:

  check_config        the flags' values, the recipe's unused flags, the device, the trackers, the
                      tokenizer and the model it sizes, then what follows; its verdicts as a Spec
  the model           LoRA's rank and targets, a mixture of experts' layout
  the shape           --ramp's stages, and at each one: the sequence length, the parallel layout
                      (check_layout: every reason in one message), FP8's multiples of 16, the memory
                      (check_memory: costs.memory_estimate against what the device has free)
  the attention       an --attn-backend the device lacks or the run never reaches; the kernel used
  the run             annealing's tokens; what --overwrite would delete
  the ranks           a job whose ranks were given different run-shaping flags (check_ranks_agree)
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import NamedTuple

import torch

import checkpoint
import config
import costs
import data
import launch
import loss
import model as M
import parallel as P
import ramp
from config import ConfigError, ResourceError


class Spec(NamedTuple):
    """What check_config found: device, precision, tokenizer, model shape, --ramp's stages, layout."""
    device: torch.device
    precision: str
    tok: object  # a tiktoken Encoding
    margs: M.ModelArgs
    attention: str  # the kernel that computes the attention: flex, flash, cudnn, efficient or math
    ramp: list | None = None
    loss_chunk: int = 0  # tokens the loss takes at a time (0: the whole micro-batch's logits; loss_chunk_of)
    layout: P.Layout = P.Layout()  # the parallel layout (config.layout_of), which the mesh is made of


def check_config(args, recipe) -> Spec:
    """The module docstring's gate: the flags, the device, the tokenizer, the layout, the memory."""
    config.validate(args)
    for flag, why in recipe.unused_flags.items():  # given all the same, they would do nothing
        value = getattr(args, flag)
        if value is not None:
            given = f"--{'no-' * (value is False)}{flag.replace('_', '-')}" + ("" if isinstance(value, bool)
                                                                              else f" {value}")
            raise ConfigError(f"{given}: {why}")
    world = launch.launch_env()[1]
    device, precision = config.pick_device_and_precision(args)
    masked = check_attention(args, device, recipe.masked_attention())
    check_trackers(args)
    tok = recipe.tokenizer()
    margs = recipe.model_args(tok)
    check_lora(args, margs, recipe)
    layout = config.layout_of(args, world)
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


def loss_chunk_of(args, recipe, stages) -> int:
    """The run's --loss-chunk as its loss applies it (loss.loss_chunk_used), decided once for the whole run:
    under --ramp, for its longest sequences, so a run resumed in a later stage computes its loss as the
    run that started it did."""
    if not recipe.head_in_loss:
        return 0
    seq_len = max(s.seq_len for s in stages) if stages else args.seq_len
    return loss.loss_chunk_used(args.loss_chunk, args.micro_batch * seq_len // args.cp, args.zero)


TRACKERS = {"wandb": "wandb", "tensorboard": "tensorboard"}  # flag -> what `pip install` needs


def check_trackers(args):
    """A tracker flag without its package, refused before the run (logs.Trackers imports it)."""
    for flag, package in TRACKERS.items():
        if getattr(args, flag) and importlib.util.find_spec(package) is None:
            raise ConfigError(f"--{flag} needs the {package} package: pip install {package}")


# ----------------------------------------------------------------------------------------------------
# The model: LoRA's updates, a mixture's experts


def check_lora(args, margs, recipe):
    """LoRA's flags against the recipe and the model: one line for each that cannot work."""
    lora = config.lora_of(args)
    if lora is None:
        return
    if recipe.kind == "pretraining":
        raise ConfigError("--lora-rank: LoRA adapts a trained model; use it with sft.py, dpo.py, reward.py or "
                          "rl.py (train.py trains every weight)")
    check_lora_shape(*lora, margs)
    if args.zero == 3:
        raise ConfigError("--zero 3 shards the weights the optimizer trains, which under LoRA are the adapters "
                          "alone: use --zero 1 or 2 (the frozen model stays whole on each rank)")


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


# ----------------------------------------------------------------------------------------------------
# The shape: --ramp's stages, and at each the layout, FP8's sides and the memory


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


def check_shape(args, layout: P.Layout, world: int, margs, device, precision: str, recipe,
                masked: bool = False):
    """Sequence length, layout and memory for these settings (masked: check_attention's verdict)."""
    if args.seq_len > margs.max_seq_len:
        raise ConfigError(f"--seq-len {args.seq_len} exceeds the model's max_seq_len {margs.max_seq_len}")
    config.parse_pp_layers(args.pp_layers)  # a malformed --pp-layers is refused here, whatever --pp is
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


def ramp_stage(args) -> str:
    return f" at --ramp's stage of {args.seq_len}-token sequences" if args.ramp else ""


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


def check_memory(margs, args, layout: P.Layout, device, precision: str, rows_per_example: int = 1,
                 frozen_copies: float = 0, chunk: int = 0, masked: bool = False):  # chunk: --loss-chunk's
    """Refuse a model that cannot fit, before any of it is allocated: one process's busiest pipeline
    stage (costs.memory_estimate, rows_per_example rows an example, kept as costs.kept_by says; plus
    frozen copies of its weights: DPO's reference, 1; distill.py's teacher, its size in the student's),
    or the model while built (costs.build_bytes) if that is more, against what the device has free."""
    lora = config.lora_of(args)
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


# ----------------------------------------------------------------------------------------------------
# The attention, the run's end and its output folder


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


def check_anneal(args, dp: int):
    if args.anneal_tokens < 0:
        raise ConfigError(f"--anneal-tokens {args.anneal_tokens} must be 0 (no annealing) or more")
    if args.anneal_data and not args.anneal_tokens:
        raise ConfigError("--anneal-data needs --anneal-tokens: how many of the run's last tokens to "
                          "anneal on")
    start = config.anneal_start(args, dp)
    if start is not None and start < 0:
        total = args.max_steps * args.micro_batch * args.grad_accum * dp * args.seq_len
        raise ConfigError(f"--anneal-tokens {args.anneal_tokens:,} is more than the run's {total:,} tokens "
                          f"(--max-steps {args.max_steps} x {total // args.max_steps:,} tokens a step)")


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


# ----------------------------------------------------------------------------------------------------
# The ranks: one command on every node


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
