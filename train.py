"""Pretrain a Llama 3 model: `python train.py` (or `torchrun --standalone --nproc_per_node=1 train.py`).

With no arguments it trains a small Llama on TinyShakespeare with the byte tokenizer, bf16 on a GPU and
fp32 on a CPU, and prints a sample at the end. Every optimizer step is the same seven phases (train_step):

  1 data loading      grad_accum micro-batches (B, T) from the Loader
  2 forward           tokens -> logits, one micro-batch at a time
  3 loss              sum of token losses / number of target tokens in the whole global batch
  4 backward          gradients accumulate, in fp32, in the optimizer's flat gradient buffer
  5 gradient sync     dp reduces the gradients (zero.py); the Tally, the step's one host-device sync
  6 optimizer step    unless the SkipGuard rejects the step: clip by global norm, AdamW on fp32 masters
  7 checkpoint        checkpoint.Checkpointer: atomic write to a step directory, `latest` pointer last

Read in this order: train_step, then train() (checks the configuration, sets the run up, loops); the
recipe (Pretraining, whose task is loss.py's LMTask; FromInit, where post-training starts); the
pieces around the steps that each decide their own "when" (validation here; checkpoint.py's
Checkpointer, launch.py's StopFlag); setting up; the command line. The flags are config.py's, their
checks checks.py's, --ramp's stages ramp.py's, the log logs.py's, the measuring instruments costs.py's;
sft.py, dpo.py, reward.py and rl.py bring their own recipes.
"""

from __future__ import annotations

import argparse
import hashlib
import math
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable, NamedTuple
from pathlib import Path

import torch

import chat
import checkpoint
import checks
import config
import costs
import data
import evaluate
import logs
import launch
import loss
import model as M
import optim as O
import parallel as P
import ramp
import zero as Z


class TrainingError(config.ConfigError):
    """Training cannot go on (too many bad steps): one line, exit 1."""


# ----------------------------------------------------------------------------------------------------
# One step


@dataclass
class Run:
    """A training run's pieces: what train_step works on, and what train() returns to its callers."""
    args: argparse.Namespace
    mesh: P.Mesh
    device: torch.device
    precision: str
    tok: object  # the tiktoken Encoding
    margs: M.ModelArgs
    model: M.Transformer
    opt: O.AdamW
    sync: Z.GradSync
    scaler: O.LossScaler | None  # fp16 only
    task: loss.LMTask
    loader: data.Loader
    make_val: Callable  # a fresh validation loader, from its start
    timer: costs.PhaseTimer
    attention: str = "auto"  # the kernel that computes the attention (checks.check_attention)
    anneal_from: int | None = None  # the step --anneal-tokens' annealing starts at (None: none)
    ramp: list | None = None  # --ramp's stages (ramp.switch)
    benchmarks: list = ()  # --eval-tasks: [(name, items)], scored at each validation
    saves: list = field(default_factory=list)  # per checkpoint {step, stall_s, write_s, host_alloc_s} (bench)

    @property
    def dtype(self) -> torch.dtype:
        return M.DTYPES[self.precision]

    @property
    def phases(self) -> list:
        return self.timer.steps

    @property
    def metric_names(self) -> tuple:
        """What a step's metrics are: the task's, then a mixture of experts' load balance (Tally)."""
        return tuple(self.task.metric_names) + (MOE_METRICS if self.margs.n_experts else ())


# the load-balancing loss, and the busiest expert's share of token-expert pairs over the even share
# (1: balanced; n_experts / top_k: all to one), each a mean over the MoE layers and micro-batches
MOE_METRICS = ("moe_aux", "moe_load")


class StepResult(NamedTuple):
    """A finished step, as the host knows it (see Tally)."""
    loss: float  # the global batch's mean loss
    lr: float
    grad_norm: float  # global, before clipping
    metrics: list  # the task's metric sums over the global batch
    stop: bool  # some rank caught a stop signal, or failed to write its log (then `failed` too)
    failed: bool


def train_step(run: Run, guard: SkipGuard, stop: launch.StopFlag, step: int) -> StepResult | None:
    """One optimizer step, phases 1 to 6 (the loop does 7). None if the guard rejected it: weights,
    optimizer state and loader position are then as they were."""
    args, mesh, timer = run.args, run.mesh, run.timer
    timer.start(step)
    seed_dropout(run, step)
    weigh_moe_aux(run)
    rewind = run.loader.state_dict()
    batches, total = load_batches(run, step)  # the whole step's micro-batches, and the loss's normalizer
    timer.mark("1 data")
    if mesh.pp > 1:  # forward, loss and backward of every micro-batch, interleaved across stages
        loss = P.pipeline_step(run.model, batches, mesh, args.seq_len, lambda *a: scaled_loss(run, *a, total),
                               before_last_backward=run.sync.start, dtype=run.dtype, head=not run.task.takes_hidden)
        timer.mark("2-4 pipeline")
    else:
        loss = torch.zeros((), device=run.device)
        for i, (inputs, targets, *doc_ids) in enumerate(batches):  # (doc_ids: packed documents', if any)
            # the logits (B, T / cp, vocab / tp) of this rank's tokens, or the final norm's output
            out = run.model(inputs, *doc_ids, seq_len=args.seq_len, head=not run.task.takes_hidden)
            timer.mark("2 forward")
            micro_loss = scaled_loss(run, out, targets, total)  # its share of the global batch's mean
            loss += micro_loss.detach()
            timer.mark("3 loss")
            if i == len(batches) - 1:  # the last micro-batch's gradients are reduced over dp as they come
                run.sync.start()
            micro_loss.backward()  # gradients accumulate in the optimizer's fp32 buffer
            timer.mark("4 backward")
    run.sync.finish()  # wait for the dp buckets (ZeRO-1: reduce-scatter), SP norms over tp
    if run.scaler:  # fp16: the loss and gradients back to their true size
        loss /= run.scaler.scale
        run.scaler.unscale(run.opt)
    tally = Tally.of(run, loss, stop)  # the step's numbers over the whole job: one all-reduce, one sync
    timer.mark("5 grad sync")
    if not guard.accepts(run, tally, step):  # the guard found the step bad
        run.opt.zero_grad()  # then nothing changes, and the same data comes again
        run.loader.load_state_dict(rewind)
        return None
    lr = O.lr_at(step, args.lr, args.warmup, args.max_steps, args.min_lr_ratio, run.anneal_from)
    run.opt.step(lr, grad_scale=O.clip_scale(args.grad_clip, tally.norm))  # clipped as it is read
    run.sync.all_gather_params()  # ZeRO-1: every rank's updated shard back into everyone's weights
    run.opt.zero_grad()
    timer.end("6 optimizer")
    return StepResult(tally.loss, lr, tally.grad_norm, tally.metrics, tally.stops + tally.failures > 0,
                      tally.failures > 0)


class Tally(NamedTuple):
    """What every rank must agree on after the backward, and the numbers the log wants: ONE
    all-reduce over the whole job, read by the host in the step's ONE synchronization (on a GPU the
    host otherwise runs ahead, queueing kernels). Summed over every rank: its part of the squared
    gradient norm; the loss and the task's metric sums, counted once per (pp, dp) place (tp ranks
    hold equal values, earlier stages zeros); and the counts of non-finite gradient copies, stop
    signals and failed log writes (StopFlag.fail)."""
    norm: torch.Tensor  # () the global gradient norm on the device: the clip factor never leaves it
    grad_norm: float
    loss: float
    metrics: list
    bad_copies: int
    stops: int
    failures: int

    @classmethod
    def of(cls, run: Run, loss: torch.Tensor, stop: launch.StopFlag) -> Tally:
        mesh, device = run.mesh, run.device
        once = float(mesh.tp_rank == 0)
        copy = run.opt.grad_norm() if run.sync.checks_copies else torch.zeros((), device=device)
        flags = torch.stack([(~torch.isfinite(copy)).float(),
                             torch.full((), float(stop.signal is not None), device=device),
                             torch.full((), float(stop.failure is not None), device=device)])
        v = torch.cat([Z.grad_sq(run.sync, run.model).view(1), loss.view(1) * once, flags,
                       run.task.metrics() * once, moe_sums(run) * once])
        P.all_reduce(v, mesh, "world")
        host = v.tolist()  # the step's one host-device synchronization
        metrics = host[5:]
        if run.margs.n_experts:  # (aux, load, count) summed over the MoE layers of every rank: means
            *metrics, aux, load, count = metrics
            metrics += [aux / max(count, 1), load / max(count, 1)]
        return cls(v[0].clamp(min=0).sqrt(), math.sqrt(max(host[0], 0.0)), host[1], metrics, int(host[2]),
                   int(host[3]), int(host[4]))


def moe_sums(run: Run) -> torch.Tensor:
    """This rank's (aux loss, load, count) sums over its MoE layers' forwards this step (model.moe_stats);
    none for a dense model."""
    if not run.margs.n_experts:
        return torch.zeros(0, device=run.device)
    sums = M.moe_stats(run.model)  # (None: this pipeline stage holds no MoE layer)
    return sums.to(run.device) if sums is not None else torch.zeros(3, device=run.device)


def weigh_moe_aux(run: Run):
    """--moe-aux-coef x the load-balancing loss, as a mean over the MoE layers, the step's micro-batches
    and the dp replicas (whose gradients are summed), in fp16's scaled units: its weight in backward."""
    if run.margs.n_experts:
        scale = run.scaler.scale if run.scaler else 1.0
        micro_batches = run.args.grad_accum * run.mesh.dp
        M.set_moe_aux(run.model, run.args.moe_aux_coef * scale / (run.margs.moe_layers * micro_batches))


def seed_dropout(run: Run, step: int):
    """--dropout's masks for this step, drawn from torch's RNG seeded by (--seed, step, this rank's
    place): a resumed run drops what an unbroken one drops. tp ranks hold the same residual stream
    (B, T, dim), so they draw alike, except under sp, where each holds its own part of the sequence;
    replicas, stages and cp ranks draw their own. Activation checkpointing's recompute replays them."""
    if not run.args.dropout:
        return
    m = run.mesh
    place = (m.dp_rank, m.pp_rank, m.cp_rank, m.tp_rank if m.sp else 0)
    torch.manual_seed(int.from_bytes(hashlib.sha256(f"{run.args.seed}/{step}/{place}".encode()).digest()[:8],
                                     "little") >> 1)


def load_batches(run: Run, step: int) -> tuple[list, torch.Tensor]:
    """Phase 1: the step's --grad-accum micro-batches on the device, prepared by the task (DPO adds the
    reference's log-probs), and the task's normalizer over the global batch. A task that cannot prepare
    them (RL's dynamic sampling finding no signal) stops the run with a line that names the step."""
    # From pinned (page-locked) host memory a copy to the GPU is asynchronous: the host goes on queueing
    # kernels. From ordinary memory, non_blocking=True would still wait for each copy.
    pinned = (lambda t: t.pin_memory()) if run.device.type == "cuda" else (lambda t: t)
    batches = [tuple(pinned(t).to(run.device, non_blocking=True) for t in run.loader.next())
               for _ in range(run.args.grad_accum)]
    try:
        batches = [P.context_chunks(b, run.mesh) for b in run.task.prepare(batches)]  # cp: this rank's chunks
    except TrainingError as e:
        raise TrainingError(f"step {step + 1}: {e}") from None
    return batches, global_total(run.task, batches, run.mesh, run.device)


def scaled_loss(run: Run, logits, targets, total) -> torch.Tensor:
    """Phase 3: the task's loss over `total`, scaled up under fp16 so small gradients survive."""
    loss = run.task.loss(logits, targets, total)
    return loss * run.scaler.scale if run.scaler else loss


class SkipGuard:
    """Phase 6's gate: no rank applies a step with non-finite gradients (fp16 overflows too) or a
    loss spike (--skip-spikes); --max-skips such steps in a row stop the run."""

    def __init__(self, args, meter: logs.Meter, checkpointer: checkpoint.Checkpointer):
        self.max_skips, self.spike_factor = args.max_skips, args.skip_spikes
        self.meter, self.checkpointer = meter, checkpointer
        self.recent, self.skipped, self.in_a_row = [], 0, 0

    def accepts(self, run: Run, tally: Tally, step: int) -> bool:
        """Whether the step may be applied; if not, it is said and counted."""
        bad = self.problem(run, tally)
        if bad is None:
            self.in_a_row = 0
            return True
        # An fp16 overflow is the loss scaler searching for its scale (normal while it settles down from
        # 2^16): it counts toward --max-skips only once the scale is below 1, where gradients overflow alone.
        searching = bad.startswith("fp16") and run.scaler.scale >= 1
        self.skipped, self.in_a_row = self.skipped + 1, self.in_a_row + (not searching)
        launch.say(f"step {step + 1}: skipped ({bad}); {self.in_a_row} in a row, {self.skipped} in all")
        self.meter.write({"step": step + 1, "skipped": bad, "skipped_total": self.skipped})
        if self.in_a_row >= self.max_skips:
            last = self.checkpointer.last_good
            kept = (f"the last checkpoint, {last.name}, is intact (lower --lr, check the data, or --resume)"
                    if last else "no checkpoint was written (lower --lr, or check the data)")
            raise TrainingError(f"stopped: {self.in_a_row} consecutive steps skipped, the last for {bad}; {kept}")
        return False

    def problem(self, run: Run, tally: Tally) -> str | None:
        finite = math.isfinite(tally.grad_norm) and not tally.bad_copies
        if run.scaler is not None and not run.scaler.update(finite):
            return f"fp16 gradient overflow, loss scale -> {run.scaler.scale:g}"
        if not finite:
            return (f"non-finite gradient norm ({tally.grad_norm})" if not math.isfinite(tally.grad_norm) else
                    f"non-finite gradients in {tally.bad_copies} rank(s)' copy of the reduced gradients")
        if self.spike_factor > 0:
            mean = sum(self.recent) / len(self.recent) if len(self.recent) >= 10 else None
            if mean is not None and tally.loss > self.spike_factor * mean:
                return f"loss spike: {tally.loss:.4f} > {self.spike_factor} x recent mean {mean:.4f}"
            self.recent = (self.recent + [tally.loss])[-50:]
        return None


# ----------------------------------------------------------------------------------------------------
# The loop


def train(args, recipe: Pretraining | None = None, time_phases: str | None = None) -> Run:
    """The training loop of every recipe. time_phases: bench.py's PhaseTimer mode. check_config
    refuses bad input before the processes talk or --out-dir (locked for the run) is touched."""
    recipe = recipe or Pretraining(args)
    spec = checks.check_config(args, recipe)
    evaluate.check_benchmarks(args, recipe.kind)
    checks.check_ranks_agree(args, spec.device)
    mesh = P.init_mesh(spec.layout, spec.device, args.dist_timeout, args.io_timeout)
    lock, meter, stop = checkpoint.lock_out_dir(Path(args.out_dir), mesh, launch.say), None, None
    try:
        run, step, data_desc = set_up(args, recipe, spec, mesh, time_phases)
        stop = launch.StopFlag()
        meter = logs.Meter(run, stop)
        logs.banner(run, meter, recipe.name(), data_desc)
        run.model.train()
        first = step
        lora = config.lora_of(args)  # (the checkpoint records it)
        with checkpoint.Checkpointer(run, step, recipe, stop, lora) as checkpointer:  # left once saved
            guard = SkipGuard(args, meter, checkpointer)
            while step < args.max_steps:
                if run.ramp and ramp.switch(run, recipe, step):  # a --ramp stage's first step
                    meter.restage()
                with launch.patient(mesh) if step == first else nullcontext():  # it compiles
                    result = train_step(run, guard, stop, step)  # phases 1-6
                if result is None:  # skipped by the guard
                    continue
                step += 1
                meter.step(step, result)
                if validation_due(step, args):
                    with meter.paused():
                        meter.validation(step, *validation(run), evaluate.benchmarks(run))
                if checkpointer.due(step):
                    with meter.paused():
                        checkpointer.save(step)  # 7. checkpoint: a copy in host memory; the disk later
                if result.stop:  # preemption or a failed write, on any rank: this step is finished; save, leave
                    checkpointer.save(step, wait=True)  # (a failed background save: its error, here)
                    stopped(stop, step, result.failed)
                    break
        run.timer.close()  # (a trace of the last step is written now)
        run.sync.wait_params()  # the model's weights are current for whoever uses them next
        if logs.mixture_seen(run):
            launch.say(logs.mixture_seen(run))
    finally:
        if meter:
            meter.close()
        if stop:
            stop.release()
        lock.release()
    return run


def stopped(stop: launch.StopFlag, step: int, failed: bool):
    """After an early stop's checkpoint: say why (a signal), or end the run with the failure's line."""
    saved = f"checkpoint step_{step:06d} written, --resume continues from it"
    if failed:
        raise TrainingError(f"stopped after step {step}: {stop.failure or 'another rank could not write'}; "
                            f"{saved}")
    launch.say(f"stopped by signal {stop.signal or '(on another rank)'} after step {step}; {saved}")


# ----------------------------------------------------------------------------------------------------
# The recipe: what a run trains. The loop asks it six things, in this order: the tokenizer and the
# model's shape (before any process talks, so a wrong one fails fast); the initial weights and the
# data (once the processes can talk); what it trains beside the model (extend); the task, a
# micro-batch's loss (once the model is built; rl.py's generates with the model it is handed).


class Pretraining:
    """The preset (or --dim ...) seeded at random, token shards, next-token prediction (loss.LMTask)."""

    kind = "pretraining"  # which recipe wrote a checkpoint (meta.json): --resume continues the same one
    chat = False  # trains on the chat format: checkpoints say so, and exports then stop at <|eot_id|>
    rows_per_example = 1  # model input rows per example of the loader (check_memory; DPO: a pair's two)
    frozen_copies = 0  # frozen copies of the model held beside the trained one (check_memory; DPO: 1)
    # (distill.py: its teacher's size in the model's)
    head_in_loss = True  # LMTask applies the head in its loss, --loss-chunk tokens at a time (check_memory)
    trained_whole = ()  # under LoRA, the parameters (by name prefix) trained whole all the same (a new head)
    unused_flags: dict = {}  # flag -> why this recipe has no use for it (refused when given)
    resume_flags = ()  # flags a --resume must repeat: the checkpoint's parameters depend on them
    init_folder = None  # where the initial weights came from (weights()): --init, or the step it named

    def __init__(self, args):
        self.args = args

    def name(self) -> str:
        return self.args.model

    def tokenizer(self):
        self.tok = data.get_tokenizer(self.args.tokenizer)
        return self.tok

    def model_args(self, tok) -> M.ModelArgs:
        return config.model_args_from(self.args, tok.n_vocab)

    def weights(self, mesh) -> dict | None:
        """The full initial state dict (each rank reads only what it keeps), or None: from --seed."""
        return None

    def data(self, tok, mesh):
        """(train loader, make_val_loader, description). Token shards are prepared (and cached) by one
        process per cache folder, never by two at once (parallel.on_rank0_first)."""
        args = self.args
        mixture = data.parse_mixture(args.data)
        final = data.parse_mixture(args.anneal_data) if args.anneal_data else None
        if len(mixture) > 1 or final:
            return self.mixture(tok, mesh, mixture, final)
        prepare = lambda: data.resolve_data(mixture[0][0], args.tokenizer, mirror=args.mirror)
        data_dir = P.on_rank0_first(prepare, mesh)
        bos = data.bos_id(tok) if doc_mask_on(args) else None  # (document ids where a batch has a boundary)
        make = lambda split, seed: data.Loader(data_dir, split, args.micro_batch, args.seq_len, seed=seed,
                                               dp_rank=mesh.dp_rank, dp_size=mesh.dp, tokenizer=tok, bos=bos)
        train = make("train", args.seed)
        make("val", 0)  # fail now, not at the first evaluation
        return train, lambda source=None: make("val", 0), f"{data_dir}: {train.num_tokens:,} train tokens"

    def mixture(self, tok, mesh, mixture, final):
        """The loaders of a mixture (and of the one annealing switches to): every source prepared with the
        run's tokenizer; validation on the mixture, or (source=name) on one source's own split."""
        args = self.args
        names = list(dict.fromkeys(name for name, _ in mixture + (final or [])))
        prepare = lambda name: data.resolve_data(name, args.tokenizer, mirror=args.mirror)
        folders = [P.on_rank0_first(lambda name=name: prepare(name), mesh) for name in names]
        weights = lambda mix: [dict(mix).get(name, 0.0) for name in names]
        start = config.anneal_start(args, mesh.dp)
        anneal = (start * args.micro_batch * args.grad_accum * mesh.dp, weights(final)) if final else None
        bos = data.bos_id(tok) if doc_mask_on(args) else None
        make = lambda split, seed, anneal=None: data.MixtureLoader(
            list(zip(names, folders, weights(mixture))), split, args.micro_batch, args.seq_len, mesh.dp_rank,
            mesh.dp, seed, tok, anneal, bos)
        train, folder = make("train", args.seed, anneal), dict(zip(names, folders))
        make_val = lambda source=None: make("val", 0) if source is None else data.Loader(
            folder[source], "val", args.micro_batch, args.seq_len, dp_rank=mesh.dp_rank, dp_size=mesh.dp,
            tokenizer=tok, bos=bos)
        for name in names:
            make_val(name)  # fail now, not at the first evaluation
        shares = ", ".join(f"{name} {w:.0%}" for name, w in mixture)
        return train, make_val, f"a mixture of {shares}: {train.num_tokens:,} train tokens"

    def masked_attention(self) -> str | None:
        """Why this recipe's attention is masked in every batch (None: it is the plain causal one, but
        in the batches documents_masked() names)."""
        return None

    def documents_masked(self) -> bool:
        """Whether a batch with a document boundary inside a row is masked there (--doc-mask, the llama
        presets' default): the loader gives it document ids (data.with_documents)."""
        return doc_mask_on(self.args)

    def extend(self, model, device, dtype):
        """Modules trained beside the model's own, added to it before the optimizer takes its parameters
        (rl.py's PPO: a value head). Pretraining adds none."""

    def task(self, spec: checks.Spec, mesh, dtype, model):
        """The head and its loss, spec.loss_chunk tokens at a time (checks.loss_chunk_of: when)."""
        return loss.LMTask(spec.margs, mesh, model.output, spec.loss_chunk, self.args.compile)


class FromInit(Pretraining):
    """The post-training recipes' model (sft.py, dpo.py, reward.py, rl.py), from --init: a train.py
    or sft.py checkpoint, a Hugging Face or a Meta folder, with the tokenizer it was trained with
    (one with more ids grows the embedding and head). They read whole examples (unused_flags)."""

    chat = True
    unused_flags = {"ramp": "--ramp stages pretraining's token stream; fine-tuning reads whole examples",
                    "doc_mask": "fine-tuning gives each example of a row its own document always",
                    "anneal_data": "fine-tuning reads one dataset, --data (--anneal-tokens alone anneals the "
                                   "learning rate)"}
    scoring_init = False  # whether --init may be a reward model (reward.py's recipe: it starts from either)

    def tokenizer(self):
        """The one --init was trained with (--tokenizer may only repeat it); without --init, byte."""
        if self.args.init is None:
            self.tok = data.get_tokenizer(self.args.tokenizer or "byte", self.args.mirror)
        else:
            self.tok = checkpoint.tokenizer_for(self.args.init, self.args.tokenizer, self.args.mirror, grows=True)
        return self.tok

    def name(self) -> str:
        return self.args.init or self.args.model

    def documents_masked(self) -> bool:
        return False  # whole examples: each recipe's masked_attention() says how its rows are

    def model_args(self, tok) -> M.ModelArgs:
        """The shape at once; the weights (below) once the processes can talk. A checkpoint's shape
        comes from meta.json alone; no shard is opened until the ranks have checked the files
        against the manifest, each a share (one rank hashing a 405B checkpoint would take hours),
        and each rank then reads only the weights it keeps, lazily."""
        args, self.state = self.args, None
        if args.init is None:
            print("no --init: fine-tuning a randomly initialized --model (useful for tests only)", flush=True)
            return super().model_args(tok)
        if not self.scoring_init:
            checkpoint.check_head(args.init, "--init")
        rows = checkpoint.recorded(args.init).get("vocab_size")
        if config.lora_of(args) and rows and tok.n_vocab > rows:
            raise config.ConfigError(f"--lora-rank: the tokenizer {tok.name} has {tok.n_vocab:,} ids, --init "
                                     f"{args.init} {rows:,} rows; LoRA keeps the embedding and the head "
                                     "frozen, so the rows added for them could never learn: fine-tune without "
                                     "LoRA")
        if not checkpoint.is_checkpoint(args.init):  # a Hugging Face or Meta folder: no manifest to check
            margs, self.state = checkpoint.load_init(args.init, tok)
            self.init_folder = args.init
            return config.init_model_args(args, margs)
        # rank 0 says what it skips, later
        self.picked = checkpoint.resolve(args.init, say=lambda msg: None, verify=False)
        try:
            self.margs = checkpoint.with_room_for(checkpoint.checkpoint_args(self.picked), tok.n_vocab)
        except ValueError as e:
            raise config.ConfigError(f"cannot read --init {self.picked}: {type(e).__name__}: "
                                     f"{data.one_line(e)}") from None
        return config.init_model_args(args, self.margs)

    def weights(self, mesh) -> dict | None:
        """The --init weights; kept where a frozen copy is built from them too (reference)."""
        state = self.state
        if self.args.init is not None and checkpoint.is_checkpoint(self.args.init):
            # every rank checks a share of the shards; may fall back past a damaged step
            verified = checkpoint.resolve(self.args.init, say=launch.say, check=checkpoint.shared_check(mesh))
            verified_margs, state = checkpoint.load_init(verified, self.tok, verify=False)
            self.init_folder = verified  # (a LoRA run's checkpoints name this step, not an out-dir that grows)
            if verified_margs != self.margs:
                raise config.ConfigError(f"--init {self.args.init}: the intact checkpoint {verified.name} has "
                                         f"another model shape than {self.picked.name}; name the step folder "
                                         "to start from")
        self.initial = state if self.frozen_copies else None
        return state

    def reference(self, spec, mesh, dtype, model):
        """DPO's and RL's frozen reference: a copy of the --init weights, cut as the policy is; under LoRA
        the policy's own model, its adapters off where it is read (M.without_lora), so no copy."""
        if config.lora_of(self.args):
            return model
        return build_model(spec.margs, self.initial, self.args, mesh, spec.device, dtype).eval().requires_grad_(
            False)



def doc_mask_on(args) -> bool:
    """--doc-mask, or by default: on for the llama presets (Llama 3 masked across documents: section 3.4.1
    of Dubey et al. 2024), off for the small ones, whose default data is one document (TinyShakespeare)."""
    return args.doc_mask if args.doc_mask is not None else args.model.startswith("llama")


def global_total(task, batches, mesh, device) -> torch.Tensor:
    """The task's normalizer over the global batch: every rank counts its own targets (under cp, those of
    its chunks), summed over dp x cp."""
    total = sum(task.count(b) for b in batches).float().to(device)
    P.all_reduce(total, mesh, mesh.grad_dim)
    return total


def sum_over_replicas(tensors: list[torch.Tensor], mesh):
    """Sum in place over pp (the loss is on the last stage) and dp x cp (each saw its own data)."""
    for dim in ("pp", mesh.grad_dim):
        for t in tensors:
            P.all_reduce(t, mesh, dim)


# ----------------------------------------------------------------------------------------------------
# Around the steps: logging, validation, checkpoints, preemption. Each decides its own "when".


def validation(run: Run) -> tuple[float, list, dict]:
    """The validation loss and metrics, and for a mixture each source's loss on its own split."""
    loss, metrics = validation_loss(run)
    names = run.loader.names if isinstance(run.loader, data.MixtureLoader) else []
    return loss, metrics, {name: validation_loss(run, name)[0] for name in names}


def validation_due(step: int, args) -> bool:
    """Every --eval-every steps and at the last (0: only at the last, -1: never)."""
    every = args.eval_every
    return every >= 0 and ((every and step % every == 0) or step == args.max_steps)


@torch.no_grad()
def validation_loss(run: Run, source: str | None = None) -> tuple[float, list]:
    """Mean loss over the first --eval-batches validation micro-batches (the same ones each time, so
    values are comparable; at most one pass over the split), split over dp ranks and run through the
    pipeline. They are read twice, --grad-accum at a time, to count the targets (the normalizer, as
    in training), then for the losses: memory never holds more."""
    args, mesh, task, device = run.args, run.mesh, run.task, run.device
    run.model.eval()
    counting, scoring = (run.make_val() if source is None else run.make_val(source) for _ in range(2))
    one_pass = math.ceil(len(counting) / (counting.batch_size * mesh.dp))
    n = max(1, min(args.eval_batches // mesh.dp, one_pass))
    total = global_total(task, (P.context_chunks(counting.next(), mesh) for _ in range(n)), mesh, device)
    task.metrics()  # start the metric sums afresh
    loss = torch.zeros((), device=device)
    for size in [min(args.grad_accum, n - i) for i in range(0, n, args.grad_accum)]:
        batches = task.prepare([tuple(t.to(device) for t in scoring.next()) for _ in range(size)])
        batches = [P.context_chunks(b, mesh) for b in batches]
        for chunk_loss in P.pipeline_forward(run.model, batches, mesh, args.seq_len,
                                             lambda out, targets: task.loss(out, targets, total),
                                             run.dtype, head=not task.takes_hidden):
            loss = loss + chunk_loss
    metrics = task.metrics().to(device)
    sum_over_replicas([loss, metrics], mesh)
    run.model.train()
    loss, *metrics = torch.cat([loss.view(1), metrics]).tolist()
    return loss, metrics


# ----------------------------------------------------------------------------------------------------
# Setting up: the model, the optimizer, the resume point


def build_model(margs, state, args, mesh, device, dtype, lazy: bool = False, lora=None, train=()):
    """The model on the meta device (shapes, no storage), sharded (tp), cut (pp) and cast there;
    then this rank's pieces get storage and values, from the seed or `state` (a full state dict):
    every layout starts from bit-identical weights, and a rank holds only its own. lazy (ZeRO-3 over
    dp x cp > 1): no values or storage here (parallel.materialize_empty); the optimizer writes each
    rank's pieces straight into its shard (AdamW(initial=initial_values(...))). lora (rank, alpha,
    targets): adapters on the sharded linears (drawn from the seed), all else frozen but `train`."""
    with torch.device("meta"):
        model = M.Transformer(margs)
    P.apply_tensor_parallel(model, mesh)
    P.apply_context_parallel(model, mesh)
    P.apply_expert_parallel(model, mesh)
    P.apply_pipeline(model, mesh)
    if lora:
        M.add_lora(model, *lora, train)
    model.to(dtype)  # still on the meta device: each piece is cast as it is written, no fp32 model exists
    if state is not None:
        missing = sorted({n for n, _ in model.named_parameters() if not M.is_lora(n)} - set(state))
        if missing:
            raise ValueError("the initial state has no "
                             f"{', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}")
    if lazy:
        P.materialize_empty(model, device)
    else:
        P.materialize(model, mesh, device, full_values(margs, state, args.seed))
    model.act_ckpt = args.act_ckpt
    M.set_attn_backend(model, args.attn_backend)
    M.set_dropout(model, args.dropout)
    M.set_fp8(model, args.precision == "fp8")
    return model


def full_values(margs, state, seed: int):
    """full_value(name, full shape) -> its initial tensor: M.init_tensor's, or `state`'s."""
    if state is None:
        return lambda name, shape: M.init_tensor(margs, name, shape, seed)
    return lambda name, shape: M.init_tensor(margs, name, shape, seed) if M.is_lora(name) else \
        read_initial(state, name)


def initial_values(model, margs, state, args, mesh):
    """For a lazily built model (build_model(lazy=True)): initial(name, shape) -> this rank's piece."""
    full_value = full_values(margs, state, args.seed)
    return lambda name, shape: P.local_value(model, mesh, full_value, name, shape)


def read_initial(state, name: str) -> torch.Tensor:
    """One initial weight from a (lazy) state dict: a truncated or unreadable file is read only now."""
    try:
        return state[name]
    except Exception as e:
        raise config.ConfigError(f"cannot read initial weight {name}: {type(e).__name__}: "
                                 f"{data.one_line(e)}") from None


def compile_blocks(model, backend="inductor"):
    """--compile: torch.compile each block (as torchtitan does), not the whole model: the model's
    forward runs a different part of it on each pipeline stage and model chunk; and every block has the
    same code, so it is compiled once. A mixture's routing and load log stay eager: traced, each step's
    group sizes (read on the host; under ep, uneven all-to-alls) and the log's start would be new graphs."""
    for moe in M.moe_layers(model):
        moe.dispatch, moe.record = torch.compiler.disable(moe.dispatch), torch.compiler.disable(moe.record)
    model.compiled_blocks = {key: torch.compile(layer, backend=backend)
                             for key, layer in model.layers.items()}


def set_up(args, recipe: Pretraining, spec: checks.Spec, mesh, time_phases: str | None) -> tuple[Run, int, str]:
    """The run's pieces, in the order they may fail: the checkpoint to resume (the ranks verify it),
    the initial weights, the data, the model, its optimizer and gradient sync, the task; then the
    resumed state. The earlier run's files (--overwrite) go only once all that worked."""
    out_dir = Path(args.out_dir)
    resume, meta = checkpoint.resume_point(out_dir, args, spec.margs, mesh, launch.say)
    if meta and args.trace_step is not None and args.trace_step <= meta["step"]:
        raise config.ConfigError(f"--trace-step {args.trace_step}: this run resumes after step {meta['step']}; "
                                 "trace one of the steps it will run")
    initial = recipe.weights(mesh)  # --init: verified by the ranks likewise
    if spec.ramp:  # the stage of the checkpoint's last step: the loop moves on to the next at its start
        ramp.enter(args, ramp.stage_at(spec.ramp, max(meta["step"] - 1, 0) if meta else 0), mesh.dp)
    loader, make_val, data_desc = recipe.data(spec.tok, mesh)
    check_enough_data(loader, args, mesh)
    read = {"the data's contents (their fingerprint)": data_contents(loader),
            "the tokenizer's vocabulary": spec.tok.n_vocab}
    checks.refuse_differences(P.all_gather_objects(read, mesh))  # (paths may differ per node; this may not)
    dtype, zero = M.DTYPES[spec.precision], Z.needs(args.zero, mesh.dp_cp, mesh.ep)
    try:  # the model's storage is handed to the optimizer; the dp gradient reduction hooks into both
        model = build_model(spec.margs, initial, args, mesh, spec.device, dtype, zero.lazy, config.lora_of(args),
                            recipe.trained_whole)
        recipe.extend(model, spec.device, dtype)
        trained = Z.laid_out([(name, p) for name, p in model.named_parameters() if p.requires_grad],  # (LoRA:
                             mesh)  # adapters; under ep the experts, whose gradients sum over edp, apart)
        opt = O.AdamW(trained, lr=args.lr, betas=(args.beta1, args.beta2),
                      weight_decay=args.weight_decay, pad_to=mesh.dp_cp,
                      allocate_state=False,  # GradSync shards
                      full_grad=zero.full_grad, unit_of=zero.unit_of,
                      initial=initial_values(model, spec.margs, initial, args, mesh) if zero.lazy else None)
        partial = partial_over_tp(opt.names, model, mesh)
        sync = Z.grad_sync(opt, mesh, args.bucket_mb, args.zero, partial_tp=partial)  # (lazy: values now)
    except ValueError as e:  # an initial state that does not fit the model (missing names, other shapes)
        raise config.ConfigError(f"cannot build the model from the initial weights: {e}") from None
    scaler = O.LossScaler() if spec.precision == "fp16" else None
    task = recipe.task(spec, mesh, dtype, model)
    timer = costs.PhaseTimer(spec.device, time_phases, costs.tracer_for(args, mesh, spec.device))
    run = Run(args, mesh, spec.device, spec.precision, spec.tok, spec.margs, model, opt, sync, scaler, task,
              loader, make_val, timer, spec.attention, anneal_from=config.anneal_start(args, mesh.dp),
              ramp=spec.ramp, benchmarks=evaluate.load_benchmarks(args, spec.tok, mesh))
    start_step = restore(run, resume, meta, recipe) if resume else 0
    if args.compile:
        compile_blocks(model)
        opt.compile()
    sync.prefetch_into(model)  # ZeRO-1: the next forward waits for each bucket's all-gather only when due
    if mesh.rank == 0 and resume is None and args.overwrite:  # the first write of this run: the old one goes
        gone = checkpoint.clear_run(out_dir)
        if gone:
            launch.say(f"--overwrite: removed {', '.join(gone)} of the earlier run in {out_dir}")
    P.barrier(mesh, long=True)  # (deleting a TB-sized run takes longer than a collective may wait)
    return run, start_step, data_desc


def check_enough_data(loader, args, mesh):
    """Refuse less data than one global batch: steps would repeat sequences, surely a mistake."""
    per_step = loader.batch_size * args.grad_accum * mesh.dp
    if len(loader) < per_step:
        raise data.DataError(f"the training data holds {len(loader):,} sequences of up to seq_len "
                             f"{args.seq_len}, fewer than one global batch of {per_step:,} "
                             f"(--micro-batch {loader.batch_size} x --grad-accum {args.grad_accum} x "
                             f"dp {mesh.dp}); use more data or a smaller batch")


def data_contents(loader) -> str:
    """What the training data holds, whatever path each node reads it under: a fingerprint of its shards
    (of a mixture: of each source's, with its weight)."""
    if isinstance(loader, data.MixtureLoader):
        return str([[weight, part.fingerprint()] for weight, part in zip(loader.weights, loader.loaders)])
    return loader.fingerprint()


def partial_over_tp(names: list[str], model, mesh) -> list[int]:
    """The parameters (indices into names) whose gradients are partial sums over tp: of the weights tp does
    not cut, the norms' under SP and LoRA's factors beside a cut linear (M.add_lora)."""
    return [i for i, n in enumerate(names) if n not in model.tp_placement and (mesh.sp or M.is_lora(n))]


def restore(run: Run, ckpt: Path, meta: dict, recipe: Pretraining) -> int:
    """Load a checkpoint (written under any layout) into the run; returns its step."""
    check_continues(ckpt, meta, recipe, run)
    try:
        extra = checkpoint.load_shards(ckpt, run.model, run.opt, run.mesh)
    except Exception as e:  # truncated, corrupt, or not ours: say which checkpoint, not a traceback
        raise config.ConfigError(f"cannot read checkpoint {ckpt}: {type(e).__name__}: {data.one_line(e)}")
    if run.scaler and extra.get("scaler"):
        run.scaler.load_state_dict(extra["scaler"])
    checkpoint.restore_rng(extra["rng"], run.device)
    old = meta.get("layout", {"tp": 1, "pp": 1, "dp": 1})
    launch.say(f"resumed from {ckpt} at step {meta['step']} (written at tp {old['tp']}, cp {old.get('cp', 1)}, "
               f"pp {old['pp']}, dp {old['dp']})")
    return meta["step"]


SCRIPTS = {"pretraining": "train.py", "sft": "sft.py", "dpo": "dpo.py", "reward": "reward.py", "rl": "rl.py"}


def check_continues(ckpt: Path, meta: dict, recipe: Pretraining, run: Run):
    """--resume continues the run in --out-dir: the same recipe on the same data (--init starts from
    a checkpoint otherwise). It refuses another script's checkpoint (dpo.py resuming an SFT run
    would go on with SFT's optimizer state and step count) and other data (the loader position means
    nothing there)."""
    args = meta["args"]
    kind = meta.get("recipe") or ("dpo" if "beta" in args else "sft" if "init" in args else "pretraining")
    if kind != recipe.kind:
        script = SCRIPTS.get(kind, kind)
        raise config.ConfigError(f"checkpoint {ckpt} was written by {script} ({kind}); {SCRIPTS[recipe.kind]} "
                                 f"--resume would continue it as {recipe.kind}: resume it with {script}, or "
                                 "start from it with --init and another --out-dir")
    lora = checkpoint.lora_record(config.lora_of(run.args), recipe.init_folder, run.args.seed)
    settings = lambda record: record and {k: v for k, v in record.items() if k not in checkpoint.BASE_RECORD}
    if settings(meta.get("lora")) != settings(lora):  # the adapters, their settings, the model they adapt
        raise config.ConfigError(f"checkpoint {ckpt} was trained with LoRA {settings(meta.get('lora')) or 'off'}"
                                 f", this run has {settings(lora) or 'LoRA off'}: resume it with the same "
                                 "--lora-rank, --lora-alpha, --lora-targets and --init")
    if lora:
        try:
            checkpoint.unchanged_base(meta["lora"])  # (its weight files as they were: said so if not)
        except checkpoint.CheckpointError as e:
            raise config.ConfigError(f"checkpoint {ckpt}: {e}") from None
    for flag in recipe.resume_flags:  # the checkpoint's parameters depend on them (PPO's value head)
        if args.get(flag) != getattr(run.args, flag):
            raise config.ConfigError(f"checkpoint {ckpt} was trained with --{flag} {args.get(flag)}, this run "
                                     f"has --{flag} {getattr(run.args, flag)}: resume it with --{flag} "
                                     f"{args.get(flag)}, or start from it with --init and another --out-dir")
    run.loader.load_state_dict(meta["loader"])  # the loader's settings (seq_len, seed, mixture) first
    if "data" in meta and meta["data"] != run.loader.fingerprint():
        start = " (--init from it)" if kind != "pretraining" else ""
        raise config.ConfigError(f"checkpoint {ckpt} was trained on other data (--data {args.get('data')!r} "
                                 f"then, {run.args.data!r} now, whose contents differ); --resume needs the "
                                 f"same data: start a new run in another --out-dir{start}")


# ----------------------------------------------------------------------------------------------------
# The command line


def samples_here(run: Run) -> bool:
    """Whether this rank generates the end-of-run sample: rank 0, if it holds the whole model. Under
    ZeRO-3 its dp_cp peers generate the same tokens beside it (same weights, same seed), as each
    layer's weights are gathered from all of them."""
    mesh = run.mesh
    return mesh.whole_model and (mesh.rank == 0 or run.sync.weights is not None)


def post_train(args, recipe_of) -> Run:
    """The entry of sft.py and dpo.py, beside main: the process set up, the training loop run with the recipe
    recipe_of(args) makes, then the answer to --sample-prompt (rank 0 prints it)."""
    config.configure_process(args)
    run = train(args, recipe_of(args))
    if args.sample_prompt and samples_here(run):
        reply = chat.reply(run.model, run.tok, [{"role": "user", "content": args.sample_prompt}],
                           seed=args.seed)
        if run.mesh.rank == 0:
            print(f"user: {args.sample_prompt}\nassistant: {reply}", flush=True)
    if run.mesh.world > 1:
        launch.leave_job()
    return run


def main(argv=None):
    parser = config.get_parser()
    args, given = parser.parse_args(argv), config.given_flags(parser, argv)
    sized = config.sized_for_the_device(args, given, config.pick_device_and_precision(args)[0].type)
    config.check_ramp_flags(args, given)
    config.fit_defaults(args, given)
    config.configure_process(args)
    if sized:
        launch.say(sized)
    run = train(args)
    model, tok, mesh, device = run.model, run.tok, run.mesh, run.device
    if args.sample_tokens > 0 and samples_here(run):
        prompt = [data.bos_id(tok)] + tok.encode_ordinary("\n")
        g = torch.Generator(device=device).manual_seed(args.seed)
        new = M.generate(model, prompt, min(args.sample_tokens, args.seq_len - len(prompt)),
                         temperature=0.8, top_k=200, generator=g, n_vocab=tok.n_vocab)
        if mesh.rank == 0:
            print("-" * 60 + "\n" + tok.decode(new[0].tolist()) + "\n" + "-" * 60, flush=True)
    elif args.sample_tokens > 0 and mesh.rank == 0:
        print(f"(no sample under tp/cp/pp: `evaluate.py --init {args.out_dir} --prompt ...` samples from the "
              "checkpoint)")
    if mesh.world > 1:
        launch.leave_job()


if __name__ == "__main__":
    config.run(main)
