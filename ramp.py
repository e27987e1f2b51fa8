"""Llama 3's batch and sequence-length ramp (--ramp), which the training loop steps through.

Llama 3 405B (Dubey et al. 2024, section 3.4.1) began with 4M-token steps of 4,096-token sequences,
went to 8M tokens of 8,192 after 252M tokens and to 16M after 2.87T. A stage sets --seq-len and
--grad-accum (--micro-batch stays); each step's loss is normalized over its own targets. The learning
rate follows steps, as the paper's schedule does (8,000 warmup steps, cosine over 1.2M), and the ramp
fixes each stage's steps, so the schedule is known from the start.

  Stage, parse       the stages of "0:4096x1024,252M:8192x1024,...", each with the step it begins at
  stage_at           the stage a step belongs to; tokens_before, what the steps before it read
  enter              a stage's settings on args (checks.check_ramp checks every stage before the run)
  switch             at a stage's first step (the loop asks at every step): its settings, fresh loaders
"""

from __future__ import annotations

import math
from typing import NamedTuple


class RampError(ValueError):
    """A malformed --ramp, or a stage the run's flags cannot make: config says it in one line."""


class Stage(NamedTuple):
    tokens: int  # the ramp's threshold: the stage begins at the first step after this many tokens
    seq_len: int
    sequences: int  # per optimizer step, over every dp rank
    start: int  # its first step
    seen: int  # tokens trained on (over the whole job) before that step


def parse_count(text: str) -> int:
    """"252M" -> 252,000,000 (K, M, B, T: thousands to trillions)."""
    scale = {"K": 10 ** 3, "M": 10 ** 6, "B": 10 ** 9, "T": 10 ** 12}.get(text[-1:].upper(), 1)
    number = float(text[:-1] if scale > 1 else text)
    if not (math.isfinite(number) and number >= 0):
        raise ValueError(text)
    return round(number * scale)


def parse(text: str) -> list[Stage]:
    """--ramp -> its stages with their first steps; one line for a malformed or out-of-order one."""
    stages, step, seen = [], 0, 0
    for part in text.split(","):
        try:
            tokens, shape = part.split(":")
            seq_len, sequences = (int(v) for v in shape.lower().split("x"))
            tokens = parse_count(tokens)
        except ValueError:
            raise RampError(f"--ramp stage {part!r}: expected TOKENS:SEQ_LENxSEQUENCES, e.g. 252M:8192x1024"
                            ) from None
        if seq_len < 1 or sequences < 1:
            raise RampError(f"--ramp stage {part!r}: a sequence length and a count of sequences >= 1")
        if not stages and tokens != 0:
            raise RampError(f"--ramp must start at 0 tokens; its first stage starts at {tokens:,}")
        if stages:
            last = stages[-1]
            if tokens <= last.tokens:
                raise RampError(f"--ramp stages must be in order of tokens: {part!r} after {last.tokens:,}")
            steps = math.ceil((tokens - last.seen) / (last.seq_len * last.sequences))
            step, seen = last.start + steps, last.seen + steps * last.seq_len * last.sequences
        stages.append(Stage(tokens, seq_len, sequences, step, seen))
    return stages


def stage_at(stages: list[Stage], step: int) -> Stage:
    return [s for s in stages if s.start <= step][-1]


def tokens_before(stages: list[Stage], step: int) -> int:
    """Tokens trained on in steps 0 .. step-1."""
    s = stage_at(stages, step)
    return s.seen + (step - s.start) * s.seq_len * s.sequences


def enter(args, stage: Stage, dp: int):
    """Set --seq-len and --grad-accum to the stage's (the run's settings for its steps)."""
    if stage.sequences % (args.micro_batch * dp):
        raise RampError(f"--ramp stage at {stage.tokens:,} tokens: {stage.sequences} sequences a step do not "
                        f"divide into micro-batches of {args.micro_batch} on {dp} dp ranks")
    args.seq_len, args.grad_accum = stage.seq_len, stage.sequences // (args.micro_batch * dp)


def switch(run, recipe, step: int):
    """At a stage's first step (and only then): its settings, and fresh loaders of its length; the
    training one goes on at global sequence ceil(tokens read / seq_len), as far into its epochs as
    the run has read. run is train.Run, recipe its Pretraining (whose data() makes the loaders)."""
    stage = stage_at(run.ramp, step)
    if step == 0 or stage.start != step:
        return False
    enter(run.args, stage, run.mesh.dp)
    run.loader, run.make_val, _ = recipe.data(run.tok, run.mesh)
    first = -(-tokens_before(run.ramp, step) // stage.seq_len)  # (a global sequence number)
    run.loader.load_state_dict({**run.loader.state_dict(), "consumed": first})
    if run.mesh.rank == 0:
        print(f"ramp: step {step}, {tokens_before(run.ramp, step):,} tokens: {stage.sequences} sequences of "
              f"{stage.seq_len} tokens a step ({run.args.grad_accum} accumulation)", flush=True)
    return True
