"""Reinforcement learning from feedback: the policy writes replies, a reward scores them, and the policy is
updated to raise the reward while a KL penalty holds it near the model it started from.

    python rl.py sums --out-dir sums                       # worked sums for SFT, prompts for RL and a test
    python rl.py --init out-sft --algo grpo --reward-fn arithmetic --prompts sums/prompts.jsonl --out-dir out-rl
    python rl.py eval --init out-rl --reward-fn arithmetic --prompts sums/test.jsonl    # greedy accuracy
    python rl.py rollouts --init out-sft --prompts sums/prompts.jsonl     # rollout tokens/s, batched or not

Each step first rolls out (phase 1): every prompt gets --group replies from the current policy, a
micro-batch's prompts and their groups in one generate batch (left-padded, one KV cache:
model.sample_groups), each prompt's drawn from its own random stream seeded by --seed and the
prompt's global sequence number (the same rollouts under any dp and after --resume, and the same
tokens as the prompt sampled alone), scored by --reward-fn (a rule:
`arithmetic`, 1 for the right answer; or FILE.py:FUNCTION) or --reward (a reward.py model, read at
the reply's <|eot_id|> as trained). Then one optimizer step: one update per rollout, so the sampling
policy is the one updated and the ratio starts at exactly 1 (TRL's default num_iterations=1); the
clipped objective is written out in full all the same.

  GRPO (Shao et al. 2024, --algo grpo): no value model. The advantage of reply i of a group is
      A_i = (r_i - mean(r)) / (std(r) + 1e-4)        (the group's rewards; std with Bessel's correction)
  for every token of the reply, and with the ratio rho_t = p(y_t) / p_old(y_t) and the KL estimate
      k3_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1        (Schulman's k3, unbiased and >= 0)
  the token loss is  -min(rho_t A, clip(rho_t, 1 - eps, 1 + eps) A) + beta k3_t  (beta: --kl-coef),
  averaged over each reply's tokens, then over the global batch's replies: the paper's
  1/G sum_i 1/|o_i| sum_t, TRL's loss_type="grpo" with use_bias_correction_kl=False.
  Logged as TRL's GRPOTrainer: reward, reward_std (within groups), kl, completion_length, clip_ratio
  (kl, clip_ratio: means over all reply tokens of the global batch).

  The GRPO family, each as TRL 1.16's GRPOTrainer defines it (tests/test_rl_trl.py runs TRL on the same
  rollouts): --loss-type (LOSS_TYPES: what the token losses are averaged over: grpo, bnpo, dr_grpo, dapo),
  --epsilon-high (DAPO's clip-higher: clip(rho, 1 - eps, 1 + eps_high)), --scale-rewards (the std an
  advantage is divided by: the group's, the global batch's, or none as in Dr. GRPO), --importance-sampling
  sequence (GSPO: one ratio per reply, exp(1/|o_i| sum_t (logp_t - old_t))), --mask-truncated (replies cut
  at --max-new-tokens are not trained on), --kl-bias-correction (each k3_t weighted by rho_t: the KL
  estimated from p_old's samples) and --dynamic-sampling N (DAPO: groups whose rewards are all equal carry
  no signal; they are dropped and the micro-batch refilled from the prompt stream, at most N more
  micro-batches drawn; logged per step as dropped_groups and refills). TRL's defaults: --loss-type dapo
  --kl-coef 0 (its epsilon_high is its epsilon, and use_bias_correction_kl weighs nothing at beta 0).

  PPO (Ouyang et al. 2022's InstructGPT, --algo ppo): a value head V (a linear map of the policy's last
  hidden state; its gradient stops there, so the critic's loss never moves the policy, where InstructGPT
  kept a separate value model of the reward model's size). The KL is in the reward, per token:
      r_t = -beta (logp_old_t - ref_t), plus the score at the reply's last token,
  advantages by GAE (--gamma, --lam) from V, whitened over the global batch, returns R_t = A_t + V_t;
  token loss  max(-A rho_t, -A clip(rho_t)) + vf_coef * 0.5 max((V - R)^2, (clip(V, V_old +- eps_v) - R)^2),
  averaged per reply, then over replies (TRL's PPOTrainer: over all tokens). Logged as TRL's PPOTrainer:
  reward, objective/kl (per reply, summed over its tokens), objective/entropy (likewise, the sampled
  -logp), policy/clipfrac_avg and loss/value_avg (means over every reply token), completion_length.

Every log-prob (the policy's, the reference's, PPO's rollout's) is of the sampling distribution,
log softmax(logits / --temperature) over the tokenizer's ids (a head padded past them is never drawn
from), as TRL computes them; validation's greedy replies are read at the same temperature, so val_kl is
the quantity kl is. --temperature 0 (greedy PPO rollouts) has no distribution: the model's own
(temperature 1) is read. The sampler keeps each drawn token's log-prob; the log's
sampling/sampling_logp_difference/max is a step's largest difference from the trainer's (float error,
unless the sampler's forward and the trainer's differ).

Prompts with an "answer" also log `accuracy`, the share of replies whose last number is the answer
(as numbers: 2.0 is 2), whatever the reward says (a flawed reward can rise while accuracy falls:
reward hacking). Validation replies greedily to the held-out prompts: val_reward, val_accuracy.

It is train.py's loop with another recipe: the model from --init (an SFT checkpoint), a frozen
reference from the same weights (none at --kl-coef 0), the prompts as the data, the rollout in the
task's prepare(). Layouts: dp (each replica rolls out its own prompts), tp (a tp group samples the
same tokens: vocabulary slices are gathered first), ZeRO-1 and 2. Refused: pp (generation would pass
each decoded token through every stage), cp and --sp (one decoded token cannot be cut over ranks),
ZeRO-3 (each forward gathers weights from every replica, and rollouts end at different lengths).
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import math
import os
import re
import sys
import time
from decimal import Decimal
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

import chat
import checkpoint
import config
import data
import evaluate
import launch
import loss
import model as M
import parallel as P
import train


# ----------------------------------------------------------------------------------------------------
# The losses, per token, and their mean as the loop wants it


def clipped_ratio(logp, old_logp, clip_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rho, clip(rho, 1 - eps, 1 + eps)), rho = p / p_old per token."""
    rho = torch.exp(logp - old_logp)
    return rho, rho.clamp(1 - clip_eps, 1 + clip_eps)


def importance_ratio(logp, old_logp, mask, level: str) -> torch.Tensor:
    """rho = p / p_old: per token (rows, T), or (level "sequence", GSPO) one per reply (rows, 1), the
    geometric mean of its tokens' ratios, exp(1/|o| sum_t (logp_t - old_t))."""
    log_ratio = logp - old_logp
    return torch.exp(log_ratio if level == "token" else reply_mean(log_ratio, mask)[:, None])


def grpo_token_losses(logp, old_logp, ref_logp, adv, mask, clip: tuple[float, float], beta: float,
                      level: str = "token", kl_times_ratio: bool = False):
    """GRPO per token (rows, T): -min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A) + beta k3, with k3
    the KL estimate (0 where there is no reference: ref_logp None), weighted by rho where kl_times_ratio
    (the importance-sampling correction of a KL estimated from p_old's samples). Also returns k3 and
    where the clipped term won (no gradient there)."""
    rho = importance_ratio(logp, old_logp, mask, level)
    adv = adv[:, None] if adv.dim() == 1 else adv
    plain, safe = rho * adv, rho.clamp(1 - clip[0], 1 + clip[1]) * adv
    losses = -torch.min(plain, safe)
    kl = torch.zeros_like(logp) if ref_logp is None else torch.exp(ref_logp - logp) - (ref_logp - logp) - 1
    kl = kl * rho if kl_times_ratio else kl
    return losses + beta * kl, kl, (safe < plain).expand_as(logp)


def ppo_token_losses(logp, old_logp, adv, values, old_values, returns, a):
    """PPO per token (rows, T): the clipped policy loss plus vf_coef times the clipped value loss.
    Also returns the value loss and where the clipped policy term won."""
    rho, clipped = clipped_ratio(logp, old_logp, a.clip_eps)
    plain, safe = -adv * rho, -adv * clipped
    v_clipped = old_values + (values - old_values).clamp(-a.clip_value, a.clip_value)
    value_loss = 0.5 * torch.max((values - returns) ** 2, (v_clipped - returns) ** 2)
    return torch.max(plain, safe) + a.vf_coef * value_loss, value_loss, safe > plain


def reply_mean(x, mask) -> torch.Tensor:
    """(rows, T) -> (rows,): the mean over each reply's tokens."""
    return (x * mask).sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)


# --loss-type: how the token losses l_it (reply i's tokens t, |o_i| of them) of a global batch of N replies
# become one number. Each gives a micro-batch's share (l, mask: (rows, T); n: N); the loop adds the shares.
LOSS_TYPES = {
    # the paper's GRPO: each reply's mean, then the replies'            1/N sum_i 1/|o_i| sum_t l_it
    "grpo": lambda l, mask, e, a, n: reply_mean(l, mask).sum() / n,
    # BNPO: each micro-batch's mean over its tokens, then the micro-batches' mean (so it depends on
    # --micro-batch: TRL's per-device batch of --micro-batch x --group replies)
    "bnpo": lambda l, mask, e, a, n: (l * mask).sum() / mask.sum().clamp(min=1) * mask.shape[0] / n,
    # Dr. GRPO (Liu et al. 2025): no length in the weights, L = --max-new-tokens   1/(N L) sum_it l_it
    "dr_grpo": lambda l, mask, e, a, n: (l * mask).sum() / a.max_new_tokens / n,
    # DAPO (Yu et al. 2025): every token of the global batch alike          sum_it l_it / sum_i |o_i|
    # (e's counts are of the replies rolled out together: the step's global batch)
    "dapo": lambda l, mask, e, a, n: (l * mask).sum() / e["tokens"] * e["replies"] / n,
}


class ValueHead(nn.Module):
    """PPO's critic: V = w . h + b at every position, on the policy's final normed hidden state h,
    read as the policy computes it (a hook on model.norm) with the gradient stopped there."""

    def __init__(self, model: M.Transformer, device, dtype):
        super().__init__()
        self.proj = nn.Linear(model.args.dim, 1, device=device, dtype=dtype)
        with torch.no_grad():
            self.proj.weight.zero_()
            self.proj.bias.zero_()
        self.hidden = None
        model.norm.register_forward_hook(self.keep)  # (under tp the norm's output: the whole h, every rank)

    def keep(self, module, inputs, out):
        self.hidden = out

    def forward(self) -> torch.Tensor:
        return self.proj(self.hidden.detach()).squeeze(-1).float()  # (rows, T)


# ----------------------------------------------------------------------------------------------------
# Rollouts: replies sampled, scored, laid out as training rows


def reply_rows(prompts: list[list[int]], replies: list[list[int]], seq_len: int, pad: int, end=None):
    """Prompt and reply token lists (a pair per row) -> int64 inputs and targets (rows, seq_len): a
    row is prompt + reply shifted by one; targets are the reply's tokens (<|eot_id|> included),
    IGNORE_INDEX elsewhere. end (--mask-truncated: <|eot_id|>): a reply that does not end with it (cut
    at the length limit) has no targets, so it is not trained on."""
    x = torch.full((len(replies), seq_len), pad, dtype=torch.long)
    y = torch.full((len(replies), seq_len), data.IGNORE_INDEX, dtype=torch.long)
    for i, (prompt, reply) in enumerate(zip(prompts, replies)):
        row = prompt + reply
        x[i, :len(row) - 1] = torch.tensor(row[:-1])
        if end is None or reply[-1:] == [end]:
            y[i, len(prompt) - 1:len(row) - 1] = torch.tensor(reply)
    return x, y


def reply_values(prompts: list[list[int]], values: list[list[float]], seq_len: int) -> torch.Tensor:
    """A number per reply token (the sampler's log-probs) laid out as reply_rows lays out the targets:
    (rows, seq_len) fp32, 0 elsewhere."""
    out = torch.zeros(len(values), seq_len)
    for i, (prompt, row) in enumerate(zip(prompts, values)):
        out[i, len(prompt) - 1:len(prompt) - 1 + len(row)] = torch.tensor(row)
    return out


def group_advantages(rewards: torch.Tensor, group: int, scale: str = "group", batch_std=None) -> torch.Tensor:
    """(rows,) rewards in consecutive groups of `group` replies -> (rows,) GRPO advantages: each reward less
    its group's mean, over a std (Bessel's) + 1e-4: its group's (scale "group"), the global batch's
    (batch_std, "batch"), or none ("none", Dr. GRPO: a group of nearly equal rewards is not blown up)."""
    r = rewards.view(-1, group)
    centered = r - r.mean(dim=1, keepdim=True)
    if scale == "none":
        return centered.view(-1)
    std = r.std(dim=1, keepdim=True) if scale == "group" else batch_std
    return (centered / (std + 1e-4)).view(-1)


def global_std(x: torch.Tensor, mesh) -> torch.Tensor:
    """The std (Bessel's) of x's values on every dp rank together, as fp32 (the sums in fp64)."""
    x = x.double()
    stats = torch.stack([x.sum(), (x * x).sum(), torch.ones_like(x).sum()])
    P.all_reduce(stats, mesh, "dp")
    mean = stats[0] / stats[2]
    return ((stats[1] - stats[2] * mean ** 2).clamp(min=0) / (stats[2] - 1).clamp(min=1)).sqrt().float()


def gae(rewards, values, mask, gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation over each row's reply tokens (mask: contiguous, (rows, T)):
    delta_t = r_t + gamma V_{t+1} - V_t (V past the reply's end is 0), A_t = delta_t + gamma lam A_{t+1}.
    -> (advantages, returns = A + V), both 0 outside the reply."""
    adv, last = torch.zeros_like(values), torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        after = values[:, t + 1] * mask[:, t + 1] if t + 1 < values.shape[1] else 0.0
        last = (rewards[:, t] + gamma * after - values[:, t] + gamma * lam * last) * mask[:, t]
        adv[:, t] = last
    return adv, (adv + values) * mask


def whiten(x: torch.Tensor, mask: torch.Tensor, mesh) -> torch.Tensor:
    """x standardized over the masked tokens of the whole global batch (sums over dp): the same numbers
    under any layout."""
    stats = torch.stack([(x * mask).sum(), (x * x * mask).sum(), mask.sum()])
    P.all_reduce(stats, mesh, "dp")
    mean = stats[0] / stats[2]
    var = (stats[1] / stats[2] - mean ** 2).clamp(min=0)
    return (x - mean) * torch.rsqrt(var + 1e-8) * mask


def varied(rewards: torch.Tensor, group: int) -> torch.Tensor:
    """(rows,) rewards in groups -> (groups,) bool: whether a group's rewards differ (else its advantages are 0)."""
    r = rewards.view(-1, group)
    return r.amax(dim=1) > r.amin(dim=1)


def take_rows(xs: list, targets: list, rows: torch.Tensor):
    """The rows `rows` (indices into the concatenation) of rolled-out parts: inputs (rows, T) and
    (targets, extras), each extra a tensor with a row per reply or None."""
    cat = lambda ts: None if ts[0] is None else torch.cat(ts)[rows]
    return cat(xs), (cat([y for y, _ in targets]), {k: cat([e[k] for _, e in targets]) for k in targets[0][1]})


# ----------------------------------------------------------------------------------------------------
# The algorithms, one small class each (ALGOS, --algo): their defaults and refusals, what they add to
# the rollouts (targets: advantages), their token losses and the metrics they log


class GRPO:
    """Group-relative advantages, no critic (the module docstring's formulas)."""

    group, kl_coef = 8, 0.04  # --group and --kl-coef when not given
    critic = False  # a value head trained beside the policy (RL.extend)
    rollout_forwards = 0  # forwards of the policy per row besides the trained one (memory, FLOPs)
    metric_names = ("reward", "reward_std", "kl", "completion_length", "clip_ratio")

    @staticmethod
    def check(a, given):
        if a.group < 2:
            raise config.ConfigError(f"--group {a.group}: GRPO's advantage compares the replies to one prompt; "
                                     "a group needs at least 2")
        if a.temperature == 0:
            raise config.ConfigError("--temperature 0: every reply of a group would be the same, and its "
                                     "advantages 0")
        if "kl_bias_correction" in given and a.kl_coef == 0:
            raise config.ConfigError("--kl-bias-correction weights the KL penalty, and --kl-coef 0 has none")
        if not 0 < a.epsilon_high < math.inf or a.dynamic_sampling < 0:
            raise config.ConfigError("need --epsilon-high > 0 and --dynamic-sampling >= 0")

    @staticmethod
    def targets(task, rolled):
        """Each reply's advantage within its group of --group replies to one prompt (over the global batch's
        std under --scale-rewards batch), and the count of replies and of their tokens rolled out together
        on all dp ranks (dapo's normalizer)."""
        a, rewards = task.args, torch.cat([e["reward"] for _, (_, e) in rolled])
        batch_std = global_std(rewards, task.mesh) if a.scale_rewards == "batch" else None
        counts = torch.stack([sum((y != data.IGNORE_INDEX).sum() for _, (y, _) in rolled).float(),
                              torch.tensor(float(rewards.numel()), device=rewards.device)])
        P.all_reduce(counts, task.mesh, "dp")
        for _, (_, e) in rolled:
            e["adv"] = group_advantages(e["reward"], task.group, a.scale_rewards, batch_std)
            e["tokens"], e["replies"] = counts
        return rolled

    @staticmethod
    def token_losses(task, logp, e, mask) -> tuple[torch.Tensor, dict]:
        # one update per rollout: the sampling policy is this one, so p_old is p's own value (ratio 1)
        a = task.args
        losses, kl, clipped = grpo_token_losses(logp, logp.detach(), e["ref"], e["adv"], mask,
                                                (a.clip_eps, a.epsilon_high), task.beta, a.importance_sampling,
                                                a.kl_bias_correction)
        return losses, {"reward_std": e["reward_std"], "kl": kl, "clip_ratio": clipped}


class PPO:
    """A critic (ValueHead), the KL in the per-token reward, GAE advantages (the module docstring)."""

    group, kl_coef = 1, 0.05
    critic = True
    rollout_forwards = 1  # the rollout's log-probs and values
    metric_names = ("reward", "objective/kl", "objective/entropy", "policy/clipfrac_avg", "loss/value_avg",
                    "completion_length")

    @staticmethod
    def check(a, given):
        mine = [f for f in GRPO_FLAGS if f in given]
        if mine:
            raise config.ConfigError(f"--{mine[0].replace('_', '-')}: a setting of GRPO's loss, which --algo ppo "
                                     "does not use")

    @staticmethod
    @torch.no_grad()
    def targets(task, rolled):
        """The rollout's log-probs and values, the per-token rewards (the KL penalty at every reply token,
        the score at its last), GAE advantages whitened over the global batch, and returns."""
        a, out = task.args, []
        for x, (y, e) in rolled:
            mask = (y != data.IGNORE_INDEX).float()
            e["old"] = task.token_logps(task.policy, x, y)  # the policy's forward sets the value head's input
            e["values"] = task.value_head() * mask
            kl = (e["old"] - e["ref"]) * mask if e["ref"] is not None else torch.zeros_like(mask)
            last = (mask * torch.arange(mask.shape[1], device=mask.device)).argmax(dim=-1, keepdim=True)
            rewards = (-task.beta * kl).scatter_add(1, last, e["reward"][:, None])
            e["adv"], e["returns"] = gae(rewards, e["values"], mask, a.gamma, a.lam)
            e["kl_sum"], e["entropy"] = kl.sum(dim=-1), -(e["old"] * mask).sum(dim=-1)
            out.append((x, (y, e), mask))
        advs = whiten(torch.cat([e["adv"] for _, (_, e), _ in out]), torch.cat([m for *_, m in out]), task.mesh)
        for (_, (_, e), _), adv in zip(out, advs.split([x.shape[0] for x, *_ in out])):
            e["adv"] = adv
        return [(x, target) for x, target, _ in out]

    @staticmethod
    def token_losses(task, logp, e, mask) -> tuple[torch.Tensor, dict]:
        losses, value_loss, clipped = ppo_token_losses(logp, e["old"], e["adv"], task.value_head(), e["values"],
                                                       e["returns"], task.args)
        return losses, {"objective/kl": e["kl_sum"], "objective/entropy": e["entropy"],
                        "policy/clipfrac_avg": clipped, "loss/value_avg": value_loss}


ALGOS = {"grpo": GRPO, "ppo": PPO}
GRPO_FLAGS = ("loss_type", "epsilon_high", "scale_rewards", "importance_sampling", "mask_truncated",
              "dynamic_sampling", "kl_bias_correction")  # (refused under --algo ppo)


# ----------------------------------------------------------------------------------------------------
# The task: phase 1's rollouts in prepare(), phase 3's loss


TOKEN_MEANS = ("kl", "clip_ratio", "policy/clipfrac_avg", "loss/value_avg")  # TRL's: over all reply tokens
STEP_COUNTS = ("dropped_groups", "refills")  # --dynamic-sampling's, over the global batch: counts a step
# the largest difference of a step between a reply token's log-prob as the sampler drew it (KV cache, batched,
# eval mode) and as the trainer recomputes it: 0 up to float error, unless the two forwards differ (TRL's name)
GAP = "sampling/sampling_logp_difference/max"


class RLTask:
    """train.py's task for RL: prepare() rolls each micro-batch of prompts out into --group replies
    each (greedy in eval mode: validation), as rows with what the loss needs beside the targets:
    rewards, advantages, the reference's log-probs and, for PPO, the rollout's log-probs and values.
    The normalizer is the global reply count."""

    takes_hidden = False  # the loss is given the logits

    def __init__(self, mesh, args, policy, tok, prompts, score, reference=None, value_head=None, refill=None):
        self.mesh, self.args, self.policy, self.tok, self.prompts = mesh, args, policy, tok, prompts
        self.refill = refill  # --dynamic-sampling: the training prompts' loader, to draw more from
        self.score, self.reference, self.value_head = score, reference, value_head
        # the sampler draws the tokenizer's ids only: log-probs are over them, not the head's padding rows
        self.vocab_size, self.group, self.beta = tok.n_vocab, args.group, args.kl_coef
        self.temperature = args.temperature or 1.0  # (0: greedy, no distribution to divide by)
        self.rows_per_example, self.algo = args.group, ALGOS[args.algo]
        # forwards besides the trained one's: the reference's, and the algorithm's rollout forwards
        self.reference_forwards = (reference is not None) + self.algo.rollout_forwards
        self.with_answers = all("answer" in p for p in prompts)
        self.metric_names = (self.algo.metric_names + (("accuracy",) if self.with_answers else ()) + (GAP,)
                             + (STEP_COUNTS if refill is not None else ()))
        self.per_token = torch.tensor([n in TOKEN_MEANS for n in self.metric_names], device=mesh.device)
        self._sums = torch.zeros(len(self.metric_names), device=mesh.device)  # (tally)
        self._tokens, self._gap = (torch.zeros((), device=mesh.device) for _ in range(2))

    def count(self, batch) -> torch.Tensor:
        """Replies: G per prompt of a loader's batch, or the rows of a rolled-out one."""
        rows = batch[0].shape[0] * (self.group if batch[0].dim() == 1 else 1)
        return torch.full((), rows, device=batch[0].device)

    def prepare(self, batches):
        rolled = [self.roll_out(seqs, items) for seqs, items in batches]
        if self.refill is not None and self.policy.training:
            rolled, counts = zip(*(with_signal(self, part) for part in rolled))
            first = self.metric_names.index(STEP_COUNTS[0])
            self._sums[first:first + len(STEP_COUNTS)] += torch.tensor(counts, device=self._sums.device).sum(0)
        return self.algo.targets(self, list(rolled))

    def sample(self, seqs: list[int], prompts: list[dict]) -> tuple[list, list]:
        """G replies to each prompt of a micro-batch, all in one generate batch (model.sample_groups), each
        prompt's from its own random stream, seeded by --seed and the prompt's global sequence number (the
        same replies under any dp, and after --resume); or (eval mode) one greedy reply each, G times.
        -> per prompt, its G replies and their tokens' log-probabilities as the sampler drew them."""
        a, G = self.args, self.group
        ids = [p["ids"] for p in prompts]
        rooms = [min(a.max_new_tokens, a.seq_len + 1 - len(i)) for i in ids]
        eot, n_vocab = data.eot_id(self.tok), self.tok.n_vocab
        whole_vocab = lambda logits: P.gather_vocab(logits, self.mesh)  # (tp: every rank draws the same)
        if not self.policy.training:
            replies, lps = M.sample_groups(self.policy, ids, 1, rooms, [None] * len(ids), eot, n_vocab, 0.0,
                                           whole_vocab=whole_vocab)
            return [r * G for r in replies], [lp * G for lp in lps]
        streams = [M.replies_stream(a.seed, seq, self.policy.tok_embeddings.weight.device) for seq in seqs]
        return M.sample_groups(self.policy, ids, G, rooms, streams, eot, n_vocab, a.temperature, a.top_p,
                               whole_vocab)

    @torch.no_grad()
    def roll_out(self, seqs, items):
        """One micro-batch of prompts -> (inputs, (targets, extras)) of its B x G replies."""
        a, G, device, eot = self.args, self.group, seqs.device, data.eot_id(self.tok)
        records = [self.prompts[i] for i in items.tolist()]
        groups, sampled = self.sample(seqs.tolist(), records)
        prompts, replies, rewards, correct = [], [], [], []
        for prompt, rows in zip(records, groups):
            texts = [self.tok.decode(r[:-1] if r[-1:] == [eot] else r) for r in rows]
            prompts += [prompt["ids"]] * G
            replies += rows
            rewards += self.score(prompt, texts)
            correct += [float(is_correct(prompt, t)) for t in texts] if self.with_answers else []
        x, y = (t.to(device) for t in reply_rows(prompts, replies, a.seq_len, data.pad_id(self.tok),
                                                 eot if a.mask_truncated else None))
        r = torch.tensor(rewards, device=device)
        grouped = r.view(-1, G)
        extras = {"reward": r, "length": torch.tensor([float(len(row)) for row in replies], device=device),
                  "reward_std": grouped.std(dim=1).repeat_interleave(G) if G > 1 else torch.zeros_like(r),
                  "correct": torch.tensor(correct, device=device) if self.with_answers else None,
                  "ref": self.reference_logps(x, y) if self.reference is not None else None,
                  "sampled": reply_values(prompts, [lp for g in sampled for lp in g], a.seq_len).to(device)
                  if self.policy.training else None}
        return x, (y, extras)

    def logps(self, logits, y) -> torch.Tensor:
        """log p(target) per token (rows, T) of the sampling distribution, softmax(logits / temperature) over
        the tokenizer's ids; 0 where the target is IGNORE_INDEX."""
        if self.temperature != 1:
            logits = logits / self.temperature
        return -loss.token_losses(logits, y, self.vocab_size, self.mesh)

    def token_logps(self, model, x, y) -> torch.Tensor:
        return self.logps(model(x, seq_len=self.args.seq_len), y)

    def reference_logps(self, x, y) -> torch.Tensor:
        """token_logps under the reference: under LoRA, the policy's own frozen model, its adapters off."""
        with M.without_lora(self.reference):
            return self.token_logps(self.reference, x, y)

    def loss(self, logits, targets, total):
        y, e = targets
        mask = (y != data.IGNORE_INDEX).float()
        logp = self.logps(logits, y)  # (rows, T), 0 outside the replies
        losses, stats = self.algo.token_losses(self, logp, e, mask)
        if e.get("sampled") is not None:  # (None: validation's greedy replies, drawn from no distribution)
            self._gap = torch.maximum(self._gap, ((logp.detach() - e["sampled"]).abs() * mask).max())
        self.tally({**stats, "reward": e["reward"], "completion_length": e["length"], "accuracy": e["correct"]},
                   mask, total)
        return LOSS_TYPES[self.args.loss_type](losses, mask, e, self.args, total)

    @torch.no_grad()
    def tally(self, stats: dict, mask, total):
        """Add a micro-batch to the metric sums: a reply's metric (rows,) over the global reply count; a token
        metric (TOKEN_MEANS, (rows, T)) summed over the reply tokens, whose count is kept beside."""
        sums = [(stats[n].float() * mask).sum() if n in TOKEN_MEANS else
                torch.zeros((), device=mask.device) if n in STEP_COUNTS + (GAP,) else stats[n].float().sum() / total
                for n in self.metric_names]
        self._sums += torch.stack(sums).to(self._sums.device)
        self._tokens += mask.sum().to(self._tokens.device)

    def metrics(self) -> torch.Tensor:
        """Each metric's share of its global mean since the last call, which the loop's sum over
        replicas completes: reply metrics over the global reply count, token metrics over the global
        count of reply tokens (summed over dp here: one small all-reduce); GAP, the max over dp, a dp-th
        of it from each replica."""
        tokens, gap = self._tokens.clone(), self._gap.clone()
        P.all_reduce(tokens, self.mesh, "dp")
        P.all_reduce(gap, self.mesh, "dp", op=torch.distributed.ReduceOp.MAX)
        out = torch.where(self.per_token, self._sums / tokens.clamp(min=1), self._sums)
        out[self.metric_names.index(GAP)] = gap / self.mesh.dp
        self._sums, self._tokens, self._gap = (torch.zeros_like(t) for t in (self._sums, self._tokens, self._gap))
        return out


def with_signal(task: RLTask, rolled):
    """--dynamic-sampling (DAPO): a micro-batch's groups whose rewards are all equal (advantages 0, no
    signal) dropped, and groups with one drawn in their place from the next micro-batches of the
    prompt stream, at most --dynamic-sampling of them. Every dp rank draws as many as the neediest,
    so that their loaders stay at one position (a checkpoint holds one). -> the micro-batch, and
    [groups dropped, micro-batches drawn]."""
    G, want, parts = task.group, task.args.micro_batch, [rolled]
    while True:
        keep = [varied(e["reward"], G) for _, (_, e) in parts]
        kept = sum(int(k.sum()) for k in keep)
        short = torch.tensor([float(kept < want), float(kept == 0)], device=task.mesh.device)
        P.all_reduce(short, task.mesh, "dp")
        if short[0] == 0 or len(parts) > task.args.dynamic_sampling:
            break
        parts.append(task.roll_out(*(t.to(rolled[0].device) for t in task.refill.next())))
    if short[1] > 0:
        seen = sorted({round(r, 4) for _, (_, e) in parts for r in e["reward"].tolist()})
        raise train.TrainingError(
            f"--dynamic-sampling {task.args.dynamic_sampling}: {int(short[1])} dp rank(s) found no group of "
            f"replies whose rewards differ in {len(parts)} micro-batches of prompts (the rewards here: "
            f"{', '.join(map(str, seen[:8]))}{' ...' if len(seen) > 8 else ''})")
    rows = torch.cat([k.repeat_interleave(G) for k in keep]).nonzero().view(-1)[:want * G]
    counts = [sum(len(k) for k in keep) - kept, len(parts) - 1]  # (STEP_COUNTS: groups dropped, refills)
    return take_rows([x for x, _ in parts], [t for _, t in parts], rows), counts


# ----------------------------------------------------------------------------------------------------
# Rewards: rules a reply can be checked by


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")  # 12, -3, 2.50 (thousands separators are dropped first: 1,000)
# a thousands separator: a comma between a digit and exactly three digits (1,000 and 12,345,678; not the
# list "3,4" or "3, 4", nor "1,0000")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")


def last_number(text: str) -> Decimal | None:
    """The last number written in text, exactly (a Decimal: 2.0 == 2, and no binary rounding)."""
    found = _NUMBER.findall(_THOUSANDS.sub("", text))
    return Decimal(found[-1]) if found else None


def as_number(answer) -> Decimal | None:
    """A record's "answer" as a number, if it is one and nothing else ("1,000", "3.5", 2.0), else None."""
    text = _THOUSANDS.sub("", str(answer).strip())
    return Decimal(text) if _NUMBER.fullmatch(text) else None


def is_correct(record: dict, reply: str) -> bool:
    """Whether the reply's last number equals the record's "answer", compared as numbers."""
    got = last_number(reply)
    return got is not None and got == as_number(record.get("answer"))


def arithmetic(record: dict, reply: str) -> float:
    """1 for the right answer (the reply's last number), else 0."""
    return float(is_correct(record, reply))


def arithmetic_length(record: dict, reply: str) -> float:
    """A deliberately flawed reward: the right answer's 1, plus 0.1 per character of the reply. Longer is
    always better, whatever it says: what RL without a KL penalty learns to exploit."""
    return arithmetic(record, reply) + 0.1 * len(reply)


REWARD_FNS = {"arithmetic": arithmetic, "arithmetic-length": arithmetic_length}
ANSWER_RULES = ("arithmetic", "arithmetic-length")  # the rules that check a prompt's "answer"


def load_reward_fn(name: str):
    """--reward-fn: a built-in rule, or FILE.py:FUNCTION taking (prompt record, reply text). An
    import failure, even by sys.exit, is one line: a SystemExit would end the run with its code (0
    for sys.exit()) and nothing written."""
    if name in REWARD_FNS:
        return REWARD_FNS[name]
    path, _, fn = name.rpartition(":")
    if not (path.endswith(".py") and fn and Path(path).is_file()):
        raise config.ConfigError(f"--reward-fn {name}: not one of {', '.join(REWARD_FNS)} nor FILE.py:FUNCTION "
                                 "of an existing file")
    spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # (SystemExit included)
        what = f"sys.exit({e.code!r})" if isinstance(e, SystemExit) else f"{type(e).__name__}: {data.one_line(e)}"
        raise config.ConfigError(f"--reward-fn {name}: importing {path} raised {what}") from None
    rule = getattr(module, fn, None)
    if rule is None:
        raise config.ConfigError(f"--reward-fn {name}: {path} defines no {fn}")
    if not callable(rule):
        raise config.ConfigError(f"--reward-fn {name}: {fn} is a {type(rule).__name__}, not a function")
    try:
        inspect.signature(rule).bind({}, "")
    except TypeError as e:
        raise config.ConfigError(f"--reward-fn {name}: {fn} must take (prompt record, reply text): "
                                 f"{data.one_line(e)}") from None
    except ValueError:  # no signature to read (some builtins): it is tried at the first rollout
        pass
    return rule


def check_answers(prompts: list[dict], rule: str | None):
    """A rule that checks the prompt's "answer" needs every prompt to carry one, a number: without, its reward
    could never be right (every reward 0, and GRPO's advantages 0: a run that learns nothing)."""
    if rule not in ANSWER_RULES:
        return
    wrong = [p for p in prompts if as_number(p.get("answer")) is None]
    if wrong:
        why = (f"its answer {wrong[0]['answer']!r} is not a number" if "answer" in wrong[0]
               else 'it has no "answer"')
        raise data.DataError(f"--reward-fn {rule} compares a reply's last number with the prompt's \"answer\", "
                             f"and {len(wrong):,} of {len(prompts):,} prompt(s) have none that is a number (the "
                             f"first, {wrong[0]['where']}: {why})")


def apply_reward_fn(fn, name: str, record: dict, replies: list[str]) -> list[float]:
    """fn on each reply; a rule that raises or gives no finite number stops the run with one line
    (the last checkpoint stays the good one). Finite in fp32, where rewards are held: 1e39 is a
    finite Python float but inf as a tensor."""
    out = []
    for reply in replies:
        try:
            value = float(fn(record, reply))
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # (a SystemExit too: the run stops with one line and exit 1)
            raise train.TrainingError(f"--reward-fn {name} raised {type(e).__name__}: {data.one_line(e)} (on the "
                                  f"prompt {record['where']})") from None
        if not math.isfinite(torch.tensor(value, dtype=torch.float32).item()):
            raise train.TrainingError(f"--reward-fn {name} returned {value} for a reply to {record['where']}: a "
                                  f"reward must be a finite number that fits in fp32 (at most "
                                  f"{torch.finfo(torch.float32).max:.4g} in size)")
        out.append(value)
    return out


# ----------------------------------------------------------------------------------------------------
# The prompts: the data of phase 1


def read_rl_prompts(path: str, tok, seq_len: int, say) -> list[dict]:
    """--prompts -> [{"where", "messages", "ids", "answer"?}], ids the chat-formatted prompt with
    the assistant's header. Prompts without room for a reply under seq_len are left out and counted
    (chat.with_room); none left is an error."""
    records = []
    for where, record in data.json_records(path):
        try:
            messages = chat.prompt_of(record)
        except data.DataError as e:
            raise data.DataError(f"{where}: {e}") from None
        extra = {"answer": str(record["answer"])} if isinstance(record, dict) and "answer" in record else {}
        records.append({"where": where, "messages": messages, **extra})
    if not records:
        raise data.DataError(f"{path}: no prompts")
    kept = chat.with_room([(r["where"], r["messages"]) for r in records], tok, seq_len, say)
    return [{**records[i], "ids": chat.encode_chat(tok, records[i]["messages"], True)[0]} for i in kept]


class PromptLoader(data.Positions):
    """(global sequence numbers (B,), prompt indices (B,)) of this dp rank's next B prompts, in an order
    drawn per epoch as every loader's (data.Positions). The sequence number seeds the prompt's rollout; the
    index, plus index_offset, finds it in the task's list of prompts (validation's follow training's)."""

    def __init__(self, prompts, batch_size, seq_len, dp_rank=0, dp_size=1, seed=0, index_offset=0):
        self.prompts, self.index_offset = prompts, index_offset
        super().__init__(len(prompts), batch_size, seq_len, dp_rank, dp_size, seed, empty="no prompts")

    def next(self):
        seqs = self._next_seqs()
        items, _ = self._items(seqs)
        return torch.from_numpy(seqs), torch.from_numpy(items + self.index_offset)

    def fingerprint(self) -> str:
        return chat.rows_fingerprint(*(np.asarray(p["ids"], dtype=np.int64) for p in self.prompts))


# ----------------------------------------------------------------------------------------------------
# The arithmetic task: a whole loop small enough for a CPU (rl.py sums)


def sums(n: int, seed: int, high: int = 30) -> list[dict]:
    """n sums a + b with 0 <= a, b < high, drawn without repeats: {"prompt", "answer", "a", "b"}."""
    pairs = np.random.default_rng(seed).permutation(high * high)[:n]
    return [{"prompt": f"What is {a} + {b}?", "answer": str(a + b), "a": int(a), "b": int(b)}
            for a, b in (divmod(int(i), high) for i in pairs)]


def sums_main(argv) -> int:
    p = argparse.ArgumentParser(prog="rl.py sums", description="Sums a + b as SFT data, RL prompts and a test.",
                                formatter_class=launch.HelpFormatter)
    p.add_argument("--out-dir", default="sums", help="the folder for sft.jsonl, prompts.jsonl, test.jsonl")
    p.add_argument("--high", type=int, default=30, help="a and b are below this")
    p.add_argument("--sft", type=int, default=300, help="worked sums for SFT (sft.jsonl)")
    p.add_argument("--rl", type=int, default=500, help="prompts for RL (prompts.jsonl)")
    p.add_argument("--test", type=int, default=100, help="held-out prompts (test.jsonl)")
    p.add_argument("--seed", type=int, default=0, help="which pairs go where")
    a = p.parse_args(argv)
    total = a.sft + a.rl + a.test
    if min(a.sft, a.rl, a.test) < 1 or total > a.high ** 2:
        raise config.ConfigError("--sft, --rl and --test must be >= 1 and add up to at most --high^2 = "
                                 f"{a.high ** 2}")
    problems, out = sums(total, a.seed, a.high), Path(a.out_dir)
    if os.path.exists(out) and not os.path.isdir(out):
        raise config.ConfigError(f"--out-dir {out} exists and is not a folder")
    with data.writing(out, out):
        out.mkdir(parents=True, exist_ok=True)
    worked = [{"messages": [{"role": "user", "content": s["prompt"]},
                            {"role": "assistant", "content": f"{s['a']} + {s['b']} = {s['answer']}"}]}
              for s in problems[:a.sft]]
    checkpoint.write_jsonl(out / "sft.jsonl", worked)
    checkpoint.write_jsonl(out / "prompts.jsonl", problems[a.sft:a.sft + a.rl])
    checkpoint.write_jsonl(out / "test.jsonl", problems[a.sft + a.rl:])
    print(json.dumps({"out_dir": str(out), "sft": a.sft, "rl": a.rl, "test": a.test}))
    return 0


# ----------------------------------------------------------------------------------------------------
# The recipe: train.py's loop with the policy from --init, prompts as the data, and RLTask


def make_scorer(a, rule, tok, device, dtype, mesh, seq_len: int):
    """score(prompt, reply texts) -> [rewards]: --reward-fn's rule, or --reward's model (whole on
    every rank, read at each reply's <|eot_id|>). A rollout is up to seq_len + 1 tokens (the last a
    target only, in the policy's rows): the reward model reads all of them where its context allows,
    so a reply filling the room is read at its <|eot_id|> too."""
    if rule is not None:
        return lambda prompt, texts: apply_reward_fn(rule, a.reward_fn, prompt, texts)
    model, _ = evaluate.load_reward_model(a.reward, device, a.mirror, dtype, mesh)
    seq_len = min(seq_len + 1, model.args.max_seq_len)
    return lambda prompt, texts: evaluate.score_replies(model, tok, prompt["messages"], texts,
                                                      seq_len).float().cpu().tolist()


class RL(train.FromInit):
    """The policy from --init (PPO adds a value head) and a frozen reference of the same weights."""

    kind = "rl"
    head_in_loss = False  # RLTask's loss is given the logits
    value_head = None  # PPO's critic (extend)
    resume_flags = ("algo",)  # PPO's checkpoints hold a value head, GRPO's none
    unused_flags = {**train.FromInit.unused_flags, "data": "rl.py reads its prompts from --prompts"}

    def __init__(self, args):
        super().__init__(args)
        self.rows_per_example = args.group  # replies per prompt: rows per example (memory, tokens, FLOPs)
        # the reference, none under LoRA: the policy's frozen model, its adapters off (reference_logps)
        self.frozen_copies = int(args.kl_coef > 0 and not config.lora_of(args))
        self.rule = load_reward_fn(args.reward_fn) if args.reward_fn else None  # before any model is built

    def tokenizer(self):
        """The policy's (as SFT's); a reward model must read the same ids."""
        self.tok = super().tokenizer()
        if self.args.reward:
            checkpoint.check_head(self.args.reward, "--reward", reward=True)
            theirs = checkpoint.tokenizer_for(self.args.reward, None, self.args.mirror)
            if theirs.name != self.tok.name:
                raise config.ConfigError(f"--reward {self.args.reward} reads the tokenizer {theirs.name}, the "
                                         f"policy writes {self.tok.name}: train the reward model from the "
                                         "policy's SFT model")
        return self.tok

    def data(self, tok, mesh):
        a = self.args
        say = lambda msg: print(msg, flush=True) if mesh.rank == 0 else None
        prompts = P.on_rank0_first(lambda: read_rl_prompts(a.prompts, tok, a.seq_len, say), mesh)
        check_answers(prompts, a.reward_fn)
        fit, val = chat.split_examples(prompts, a.val_fraction, a.seed)
        self.prompts = fit + val  # the loaders' indices point here, validation's after training's
        make = lambda part, seed, offset: PromptLoader(part, a.micro_batch, a.seq_len, mesh.dp_rank, mesh.dp,
                                                       seed, offset)
        self.loader = make(fit, a.seed, 0)  # (--dynamic-sampling draws more from it: RLTask.with_signal)
        return (self.loader, lambda: make(val, 0, len(fit)),
                f"{len(fit):,} prompts ({len(val):,} held out) x {a.group} replies")

    def extend(self, model, device, dtype):
        """PPO's critic: a submodule of the policy, so it is trained, sharded and checkpointed with it."""
        if ALGOS[self.args.algo].critic:
            self.value_head = ValueHead(model, device, dtype)
            model.add_module("value_head", self.value_head)

    def task(self, spec, mesh, dtype, model):
        a = self.args
        reference = self.reference(spec, mesh, dtype, model) if a.kl_coef > 0 else None
        score = make_scorer(a, self.rule, self.tok, spec.device, dtype, mesh, a.seq_len)
        return RLTask(mesh, a, model, self.tok, self.prompts, score, reference, self.value_head,
                      refill=self.loader if a.dynamic_sampling else None)


def check_flags(a, given=frozenset()):
    """One line for each setting that cannot work, before anything starts (given: the flags the command
    line named, config.given_flags)."""
    if not a.prompts or bool(a.reward) == bool(a.reward_fn):
        raise config.ConfigError("rl.py needs --prompts FILE and one of --reward (a reward model) or "
                                 "--reward-fn")
    algo = ALGOS[a.algo]
    a.group = a.group if a.group is not None else algo.group
    a.kl_coef = a.kl_coef if a.kl_coef is not None else algo.kl_coef
    a.epsilon_high = a.epsilon_high if a.epsilon_high is not None else a.clip_eps  # (symmetric clipping)
    if a.group < 1 or a.max_new_tokens < 1:
        raise config.ConfigError("--group and --max-new-tokens must be at least 1")
    algo.check(a, given)
    if not (0 <= a.kl_coef < math.inf and 0 < a.clip_eps < 1 and 0 <= a.gamma <= 1 and 0 <= a.lam <= 1
            and 0 <= a.vf_coef < math.inf and 0 < a.clip_value < math.inf):
        raise config.ConfigError("need --kl-coef >= 0, --clip-eps in (0, 1), --gamma and --lam in [0, 1], "
                                 "--vf-coef >= 0 and --clip-value > 0")
    try:
        M.check_sampling(a.temperature, None, a.top_p)
    except ValueError as e:
        raise config.ConfigError(f"--temperature / --top-p: {e}") from None
    refused = {"pp": "generation runs the whole model one token at a time; a pipeline would pass each token "
                     "through every stage", "cp": "a reply's log-probability needs the whole sequence, "
                                              "which no cp rank holds",
               "sp": "sequence parallelism cuts a sequence over the tp ranks; one decoded token cannot be cut",
               "zero": "ZeRO-3 gathers every layer from all replicas at each forward, and replicas' rollouts "
                       "end at different lengths",
               "dropout": "the replies are sampled and their log-probabilities read from the policy in "
                          "training mode: with dropout each would come from another model"}
    for flag, on in (("pp", a.pp > 1), ("cp", a.cp > 1), ("sp", a.sp), ("zero", a.zero == 3),
                     ("dropout", a.dropout > 0)):
        if on:
            raise config.ConfigError(f"--{flag} {getattr(a, flag)}: rl.py does not support it "
                                     f"({refused[flag]})")


# ----------------------------------------------------------------------------------------------------
# rl.py eval: a model's greedy replies to prompts, scored


def eval_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rl.py eval", description="Greedy replies to prompts: mean reward and "
                                                               "accuracy (the share with the answer).",
                                formatter_class=launch.HelpFormatter)
    p.add_argument("--init", required=True, help="the policy: a checkpoint, HF or Meta folder")
    p.add_argument("--prompts", required=True, help="JSON/JSONL prompts, as rl.py reads them")
    p.add_argument("--reward", default=None, help="a reward model")
    p.add_argument("--reward-fn", default=None,
                   help="a rule: " + ", ".join(REWARD_FNS) + " or FILE.py:FUNCTION")
    p.add_argument("--max-new-tokens", type=int, default=64, help="the longest reply")
    p.add_argument("--seq-len", type=int, default=256, help="prompt and reply together")
    p.add_argument("--device", default=None, help="cuda, cpu, ... (default: cuda if available)")
    p.add_argument("--mirror", default=None, help="local mirror folder for downloads")
    return p


def eval_main(argv) -> int:
    a = eval_parser().parse_args(argv)
    if bool(a.reward) == bool(a.reward_fn) or a.max_new_tokens < 1 or a.seq_len < 2:
        raise config.ConfigError("rl.py eval needs one of --reward or --reward-fn, --max-new-tokens >= 1 and "
                                 "--seq-len >= 2")
    checkpoint.check_head(a.init, "--init")  # (everything a flag can get wrong is refused before a model is loaded)
    if a.reward:
        checkpoint.check_head(a.reward, "--reward", reward=True)
    rule = load_reward_fn(a.reward_fn) if a.reward_fn else None
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    tok = checkpoint.tokenizer_for(a.init, None, a.mirror)
    prompts = read_rl_prompts(a.prompts, tok, a.seq_len, say=lambda msg: print(msg, file=sys.stderr))
    check_answers(prompts, a.reward_fn)
    policy = evaluate.load_model(a.init, tok, device, torch.float32, P.Mesh())
    score = make_scorer(a, rule, tok, device, torch.float32, P.Mesh(), a.seq_len)
    rewards, correct, eot = [], [], data.eot_id(tok)
    for prompt in prompts:
        room = min(a.max_new_tokens, a.seq_len + 1 - len(prompt["ids"]))
        (row,) = M.sample(policy, prompt["ids"], 1, room, None, eot, tok.n_vocab, 0.0)
        text = tok.decode(row[:-1] if row[-1:] == [eot] else row)
        rewards += score(prompt, [text])
        correct.append(is_correct(prompt, text))
    out = {"init": str(a.init), "prompts": len(prompts), "reward": round(sum(rewards) / len(prompts), 4)}
    if all("answer" in p for p in prompts):
        out["accuracy"] = round(sum(correct) / len(prompts), 4)
    print(json.dumps(out), flush=True)
    return 0


# ----------------------------------------------------------------------------------------------------
# rl.py rollouts: the rollout's speed, one prompt at a time against a micro-batch at once


def rollouts_main(argv) -> int:
    p = argparse.ArgumentParser(prog="rl.py rollouts", description="Generation tokens/s of GRPO's rollouts: "
                                "each prompt's --group replies as one batch, against a micro-batch's prompts "
                                "and their groups as one (model.sample_groups), on the same streams.",
                                formatter_class=launch.HelpFormatter)
    p.add_argument("--init", required=True, help="the policy: a checkpoint, HF or Meta folder")
    p.add_argument("--prompts", required=True, help="JSON/JSONL prompts, as rl.py reads them")
    for flag, default, what in (("--group", 8, "replies a prompt"), ("--micro-batch", 8, "prompts a batch"),
                                ("--max-new-tokens", 32, "the longest reply"),
                                ("--seq-len", 64, "prompt and reply together"),
                                ("--batches", 16, "micro-batches measured"), ("--seed", 1337, "the replies' streams")):
        p.add_argument(flag, type=int, default=default, help=what)
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    p.add_argument("--mirror", default=None, help="local mirror folder for downloads")
    a = p.parse_args(argv)
    tok = checkpoint.tokenizer_for(a.init, None, a.mirror)
    prompts = read_rl_prompts(a.prompts, tok, a.seq_len, say=lambda msg: print(msg, file=sys.stderr))
    policy = evaluate.load_model(a.init, tok, torch.device("cpu"), torch.float32, P.Mesh())
    eot, n = data.eot_id(tok), a.micro_batch
    batches = [prompts[i:i + n] for i in range(0, min(len(prompts), n * a.batches), n)]
    cut = lambda row: row[:row.index(eot) + 1] if eot in row else row
    ways = {"per prompt": lambda seqs, ids, rooms: [  # (as rl.py sampled before: each prompt's group alone)
                [cut(row) for row in M.generate(policy, [i] * a.group, r, a.temperature, eos_id=eot, n_vocab=tok.n_vocab,
                                                generator=M.replies_stream(a.seed, s, "cpu")).tolist()]
                for s, i, r in zip(seqs, ids, rooms)],
            "per micro-batch": lambda seqs, ids, rooms: M.sample_groups(
                policy, ids, a.group, rooms, [M.replies_stream(a.seed, s, "cpu") for s in seqs], eot,
                tok.n_vocab, a.temperature)[0]}
    out, replies = {}, {}
    for _ in range(3):  # the two ways in turn, the best of three each (the machine may be shared)
        for name, way in ways.items():
            start, replies[name] = time.perf_counter(), []
            for b, batch in enumerate(batches):
                ids = [q["ids"] for q in batch]
                rooms = [min(a.max_new_tokens, a.seq_len + 1 - len(i)) for i in ids]
                replies[name] += way(range(b * n, b * n + len(batch)), ids, rooms)
            tokens = sum(len(r) for group in replies[name] for r in group)
            rate = round(tokens / (time.perf_counter() - start), 1)
            out[name] = {"tokens": tokens, "tokens_per_s": max(rate, out.get(name, {}).get("tokens_per_s", 0))}
    same = replies["per prompt"] == replies["per micro-batch"]
    speedup = out["per micro-batch"]["tokens_per_s"] / out["per prompt"]["tokens_per_s"]
    print(json.dumps({"init": str(a.init), "prompts": sum(map(len, batches)), "group": a.group,
                      "micro_batch": n, **out, "speedup": round(speedup, 2), "same_replies": same}), flush=True)
    return 0


# ----------------------------------------------------------------------------------------------------
# The command line


def get_parser() -> argparse.ArgumentParser:
    p = config.get_parser()
    p.description = ("Reinforcement learning (GRPO or PPO) against a reward, from an SFT checkpoint. Also: "
                     "`rl.py sums` writes the arithmetic task's files, `rl.py eval` scores greedy replies.")
    g = p.add_argument_group("reinforcement learning")
    g.add_argument("--init", default=None, help="the SFT checkpoint (or HF / Meta folder) to start from")
    g.add_argument("--algo", default="grpo", choices=list(ALGOS), help="see the module docstring")
    g.add_argument("--prompts", default=None, help="JSON/JSONL prompts (reward.py's read_prompts layouts; an "
                                                    "\"answer\" field is what --reward-fn arithmetic checks)")
    g.add_argument("--reward", default=None, help="a reward model (reward.py's --out-dir, or an HF folder)")
    g.add_argument("--reward-fn", default=None,
                   help="a rule instead: " + ", ".join(REWARD_FNS) + ", or FILE.py:FUNCTION taking (prompt "
                        "record, reply text) and returning a number")
    g.add_argument("--group", type=int, default=None, help="replies per prompt (default: grpo 8, ppo 1)")
    g.add_argument("--max-new-tokens", type=int, default=64, help="the longest reply (cut there)")
    g.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of the rollouts")
    g.add_argument("--top-p", type=float, default=None, help="nucleus sampling of the rollouts")
    g.add_argument("--kl-coef", type=float, default=None,
                   help="beta, the KL penalty's weight (default: grpo 0.04, ppo 0.05; 0: no reference)")
    g.add_argument("--clip-eps", type=float, default=0.2, help="the ratio's clip range (its low side, if "
                                                                "--epsilon-high is given)")
    g.add_argument("--loss-type", default="grpo", choices=list(LOSS_TYPES),
                   help="GRPO: how token losses are averaged (LOSS_TYPES; TRL's default: dapo)")
    g.add_argument("--epsilon-high", type=float, default=None,
                   help="GRPO: the clip range's high side, 1 + eps_high (DAPO's clip-higher: 0.28; default: "
                        "--clip-eps)")
    g.add_argument("--scale-rewards", default="group", choices=["group", "batch", "none"],
                   help="GRPO: the std an advantage is divided by: its group's, the global batch's, or none")
    g.add_argument("--importance-sampling", default="token", choices=["token", "sequence"],
                   help="GRPO: the ratio p / p_old per token, or per reply (GSPO)")
    g.add_argument("--mask-truncated", action="store_true",
                   help="GRPO: replies cut at --max-new-tokens (no <|eot_id|>) are not trained on")
    g.add_argument("--dynamic-sampling", type=int, default=0, metavar="TRIES",
                   help="GRPO: drop groups whose rewards are all equal (no signal) and refill the micro-batch "
                        "from the prompt stream, drawing at most TRIES more micro-batches (DAPO; 0: off)")
    g.add_argument("--kl-bias-correction", action="store_true",
                   help="GRPO: weight the KL estimate by the ratio p / p_old (TRL's use_bias_correction_kl)")
    g.add_argument("--gamma", type=float, default=1.0, help="PPO: discount")
    g.add_argument("--lam", type=float, default=0.95, help="PPO: GAE's lambda")
    g.add_argument("--vf-coef", type=float, default=0.1, help="PPO: the value loss's weight")
    g.add_argument("--clip-value", type=float, default=0.2, help="PPO: the value's clip range")
    g.add_argument("--val-fraction", type=float, default=0.1, help="share of prompts held out")
    p.set_defaults(tokenizer=None, data=None, out_dir="out-rl", lr=1e-5, warmup=0, max_steps=100,
                   eval_every=50, eval_batches=8, ckpt_every=100, log_every=10, seq_len=256, micro_batch=4,
                   weight_decay=0.0)
    return p


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["sums"]:
        return sums_main(argv[1:])
    if argv[:1] == ["eval"]:
        return eval_main(argv[1:])
    if argv[:1] == ["rollouts"]:
        return rollouts_main(argv[1:])
    args = config.parse(get_parser(), argv)
    check_flags(args, config.given_flags(get_parser(), argv))
    config.configure_process(args)
    run = train.train(args, RL(args))
    if run.mesh.world > 1:
        launch.leave_job()


if __name__ == "__main__":
    config.run(main)
