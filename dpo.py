"""Direct preference optimization (Rafailov et al. 2023): learn from pairs of a preferred and a rejected
reply, without a reward model.

    python dpo.py --init out-sft --data hh_rlhf_harmless_test

The policy starts from an SFT checkpoint (--init); a frozen reference with the same weights, sharded like
the policy, scores the same sequences. A sequence's log-probability is the sum over its response tokens;
with the policy/reference log-ratios r_c (chosen) and r_r (rejected) and margin m = beta * (r_c - r_r):
    sigmoid (default)  -(1 - eps) * log sigmoid(m) - eps * log sigmoid(-m)   (eps: --label-smoothing, cDPO)
    ipo                (r_c - r_r - 1 / (2 beta))^2, log-probs per response token (Azar et al. 2023)
    ipo-sum            the same on the summed log-probs (the paper's Eq. 17 as written)
    hinge              max(0, 1 - m)                                         (SLiC, Zhao et al. 2023)
averaged over the pairs of the global batch. ipo divides each log-prob by its response length first,
as the IPO authors and TRL's "ipo" do, so a published beta carries over (summed, beta would have to
shrink with the length). TRL 1.16's "sigmoid" silently ignores label_smoothing, so it matches cDPO
only at 0. Metrics keep TRL's names and meanings and use the summed log-probs whatever the loss:
rewards/chosen = beta * r_c, rewards/rejected = beta * r_r, rewards/accuracies (share with
r_c > r_r), rewards/margins, logps/chosen, logps/rejected; under ipo also rewards_per_token/... and
logps_per_token/... from the per-token log-probs the loss uses.

Llama 3's two changes (Dubey et al. 2024, section 4.1.4), both off by default: --mask-format-tokens
leaves the chat format's tokens (headers, <|eot_id|>: alike in both replies, they only add noise to
the margin) out of the DPO log-probs and the rewards and logps metrics; --nll-coef c adds c times
the chosen reply's NLL per token (as in Pang et al. 2024's RPO, over every learned token, <|eot_id|>
included), logged as nll_loss.

It is train.py's loop with another task: a micro-batch holds B pairs as 2B rows (chosen first), and
prepare() adds the reference log-probs, computed alongside or, with --precompute-ref, once before
training (split over dp) and cached in <out-dir>/ref_logps.pt, so that the reference can be freed.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
from pathlib import Path

import torch
import torch.nn.functional as F

import chat
import config
import data
import loss
import model as M
import parallel as P
import train


# ----------------------------------------------------------------------------------------------------
# The loss, and the task that gives it the reference's log-probs


def dpo_loss(pc, pr, rc, rr, beta: float, kind: str = "sigmoid", label_smoothing: float = 0.0):
    """Per-pair losses from policy (pc, pr) and reference (rc, rr) sequence log-probs, chosen / rejected."""
    logits = (pc - rc) - (pr - rr)  # difference of the two log-ratios
    if kind == "sigmoid":
        return (-(1 - label_smoothing) * F.logsigmoid(beta * logits)
                - label_smoothing * F.logsigmoid(-beta * logits))
    if kind in ("ipo", "ipo-sum"):  # "ipo" is given per-token log-probs (DPOTask.loss)
        return (logits - 1 / (2 * beta)) ** 2
    if kind == "hinge":
        return torch.relu(1 - beta * logits)
    raise ValueError(f"unknown DPO loss {kind!r}")


def sequence_logps(logits, targets, vocab_size, mesh, skip=None):
    """Sum of log p(target) over each row's response tokens (IGNORE_INDEX elsewhere), leaving out the target
    ids in `skip` (a tensor of token ids, or None): (rows, T) -> (rows,)."""
    return -loss.token_losses(logits, skipping(targets, skip), vocab_size, mesh).sum(dim=-1)


def skipping(targets, skip):
    """targets with the ids in `skip` made IGNORE_INDEX (no loss, no log-prob)."""
    if skip is None:
        return targets
    return targets.masked_fill(torch.isin(targets, skip.to(targets.device)), data.IGNORE_INDEX)


def reference_logps(reference, batches, mesh, args, skip=None) -> list:
    """Sequence log-probs of every micro-batch under the frozen reference (pipelined like the policy), the
    target ids in `skip` left out; only the last stage computes them, the others get None."""
    with M.without_lora(reference):  # (LoRA: the reference is the policy's own frozen model)
        scored = P.pipeline_forward(reference, batches, mesh, args.seq_len,
                                    lambda logits, y: sequence_logps(logits, y, reference.args.vocab_size, mesh,
                                                                     skip),
                                    next(reference.parameters()).dtype)
    return scored if mesh.last_stage else [None] * len(batches)


def precompute_reference(reference, loaders, mesh, args, device, skip=None) -> torch.Tensor:
    """Score every loader's pairs once: a (pairs, 2) tensor of (chosen, rejected) log-probs by pair
    index (index_offset keeps loaders apart). Micro-batches are dealt out over dp; each replica
    holds zeros where others scored, and a sum over dp (x + 0 is exact) gives every replica the
    whole table. Stages but the last hold zeros (only the last computes the loss)."""
    chunks = [(loader, lo) for loader in loaders for lo in range(0, len(loader), args.micro_batch)]
    out = torch.zeros(sum(len(loader) for loader in loaders), 2, device=device)
    for j, (loader, lo) in enumerate(chunks):
        if j % mesh.dp != mesh.dp_rank:
            continue
        rows = list(range(lo, min(lo + args.micro_batch, len(loader))))
        x, y = (t.to(device) for t in loader.pairs(rows))
        (logps,) = reference_logps(reference, [(x, y)], mesh, args, skip)
        if logps is not None:
            start = loader.index_offset + lo
            out[start:start + len(rows)] = logps.view(2, -1).T.float()
    P.all_reduce(out, mesh, "dp")
    return out.cpu()


def read_cache(path: Path, key: dict) -> torch.Tensor | None:
    """The cached reference log-probs if `path` holds them for this `key`; None if absent, unreadable (a
    crash while writing) or made for other settings."""
    if not path.is_file():  # (absent, or something else under its name: a FIFO would hang the read)
        return None
    try:
        saved = torch.load(path, weights_only=True)
        return saved["logps"] if saved.get("key") == key else None
    except Exception:
        return None


class DPOTask:
    """train.py's task for preference pairs (see the module docstring); skip: the ids left out of
    the DPO log-probs (--mask-format-tokens), or None."""

    rows_per_example = 2  # a pair: its chosen and its rejected row (train.py counts tokens and FLOPs by rows)
    takes_hidden = False  # the loss is given the logits

    def __init__(self, margs, mesh, args, reference=None, cached=None, skip=None):
        self.vocab_size, self.mesh, self.args, self.skip = margs.vocab_size, mesh, args, skip
        self.reference, self.cached = reference, cached  # a model, or (pairs, 2) log-probs by pair index
        self.reference_forwards = 1 if reference is not None else 0  # its forward costs FLOPs every step
        names = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                 "logps/rejected")
        per_token = tuple(n.replace("/", "_per_token/") for n in names) if args.loss == "ipo" else ()
        self.metric_names = names + per_token + (("nll_loss",) if args.nll_coef else ())
        self._sums = torch.zeros(len(self.metric_names))

    def prepare(self, batches):
        """Attach the reference log-probs (chosen then rejected rows) to each micro-batch's targets."""
        if self.cached is not None:  # (B,) pair indices -> (2B,) cached log-probs, chosen then rejected
            # looked up on the device (moved there once): an index taken back to the host would wait for it
            self.cached = self.cached.to(batches[0][0].device)
            return [(b[0], (b[1], self.cached[b[2]].T.reshape(-1))) for b in batches]
        ref = reference_logps(self.reference, [b[:2] for b in batches], self.mesh, self.args, self.skip)
        return [(b[0], (b[1], r)) for b, r in zip(batches, ref)]

    def count(self, batch) -> torch.Tensor:
        return torch.full((), batch[0].shape[0] // 2, device=batch[0].device)  # pairs (a fill: no copy)

    def loss(self, logits, targets, total):
        y, ref = targets
        token_logps = -loss.token_losses(logits, y, self.vocab_size, self.mesh)  # (2B, T), 0 where not learned
        in_dpo = skipping(y, self.skip) != data.IGNORE_INDEX  # (2B, T): the tokens DPO's log-probs sum
        summed = token_logps.masked_fill(~in_dpo, 0.0).sum(dim=-1)  # (2B,)
        logps, ref_used, B = summed, ref, summed.shape[0] // 2
        if self.args.loss == "ipo":  # log-probs per response token, the IPO authors' (and TRL's) convention
            length = in_dpo.sum(dim=-1).clamp(min=1)  # (2B,)
            logps, ref_used = summed / length, ref / length
        pairs = lambda p, r: (p[:B], p[B:], r[:B], r[B:])  # (chosen, rejected) of the policy, the reference
        losses = dpo_loss(*pairs(logps, ref_used), self.args.beta, self.args.loss, self.args.label_smoothing)
        nll = None
        if self.args.nll_coef:  # the chosen reply's NLL per token, over every learned token (eot included)
            nll = -token_logps[:B].sum(dim=-1) / (y[:B] != data.IGNORE_INDEX).sum(dim=-1).clamp(min=1)
            losses = losses + self.args.nll_coef * nll
        per_token = [pairs(logps, ref_used)] if self.args.loss == "ipo" else []
        self.tally([pairs(summed, ref)] + per_token, nll, total)
        return losses.sum() / total

    @torch.no_grad()
    def tally(self, logps: list[tuple], nll, total):
        """Add this micro-batch's pairs to the metric sums (each over the global pair count): for each
        (policy chosen, rejected, reference chosen, rejected) log-probs, the rewards and logps."""
        stats = []
        for pc, pr, rc, rr in logps:
            reward_c, reward_r = self.args.beta * (pc - rc), self.args.beta * (pr - rr)
            stats += [reward_c.sum(), reward_r.sum(), (reward_c > reward_r).float().sum(),
                      (reward_c - reward_r).sum(), pc.sum(), pr.sum()]
        stats += [nll.sum()] if nll is not None else []
        # on the device: a .cpu() here would wait for the GPU at every micro-batch
        self._sums = self._sums.to(stats[0].device) + torch.stack(stats) / total

    def metrics(self) -> torch.Tensor:
        """Metric sums since the last call (each divided by the global pair count: means when summed)."""
        out, self._sums = self._sums, torch.zeros_like(self._sums)
        return out


def cached_reference(reference, loaders, mesh, args, device, tokenizer: str, skip=None) -> torch.Tensor:
    """--precompute-ref: every pair's reference log-probs, read from <out-dir>/ref_logps.pt if made
    for the same `key`, else computed (collectively) and written there whole, then renamed."""
    cache = Path(args.out_dir) / "ref_logps.pt"
    # the rows scored and where their pair indices start (the seed, seq_len and tokenizer pick them)
    key = {"rows": [(loader.index_offset, loader.fingerprint()) for loader in loaders],
           "weights": weights_digest(reference, mesh), "tokenizer": tokenizer,
           "dtype": str(next(reference.parameters()).dtype),
           "skip": None if skip is None else skip.tolist()}
    cached = read_cache(cache, key)
    # every rank must take the same branch (precomputing is collective): use the cache only if all can
    if mesh.world > 1 and not P.all_true(torch.tensor(cached is not None, device=device), mesh):
        cached = None
    if cached is None:
        cached = precompute_reference(reference, loaders, mesh, args, device, skip)
        if mesh.last_stage and mesh.tp_rank == 0 and mesh.dp_rank == 0:
            cache.parent.mkdir(parents=True, exist_ok=True)
            torch.save({"key": key, "logps": cached}, cache.with_suffix(".tmp"))
            os.replace(cache.with_suffix(".tmp"), cache)
    return cached


def weights_digest(model, mesh) -> str:
    """sha256 of the weights as every rank holds them (its tp shard of its pp stage's layers), each
    rank's digest hashed again over ranks. The same weights cut another way give another digest,
    which only costs a recomputation."""
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        if M.is_lora(name):  # the reference is the model without them
            continue
        h.update(name.encode())
        h.update(t.detach().reshape(-1).cpu().view(torch.uint8).numpy().tobytes())
    if mesh.world == 1:
        return h.hexdigest()
    everyone = [None] * mesh.world
    torch.distributed.all_gather_object(everyone, h.hexdigest())
    return hashlib.sha256(" ".join(everyone).encode()).hexdigest()


# ----------------------------------------------------------------------------------------------------
# The recipe: train.py's loop with the model from --init, preference pairs (chat.py) and DPOTask


class DPO(train.FromInit):
    """The policy from --init and a frozen reference built from the same initial weights."""

    kind = "dpo"
    rows_per_example = DPOTask.rows_per_example
    head_in_loss = False  # DPOTask's loss is given the logits

    def __init__(self, args):
        super().__init__(args)
        # a reference (with --precompute-ref too, while it scores); none under LoRA (M.without_lora)
        self.frozen_copies = 0 if config.lora_of(args) else 1

    def data(self, tok, mesh):
        a = self.args
        loader, make_val, desc = chat.preference_data(a, tok, mesh, with_index=a.precompute_ref)
        self.tok_name = tok.name  # part of the cached reference's key
        self.skip = torch.tensor(data.format_ids(tok)) if a.mask_format_tokens else None
        self.loaders = loader, make_val()  # precomputing scores both
        return loader, make_val, desc

    def task(self, spec, mesh, dtype, model):
        margs, device, reference = spec.margs, spec.device, self.reference(spec, mesh, dtype, model)
        if not self.args.precompute_ref:
            return DPOTask(margs, mesh, self.args, reference=reference, skip=self.skip)
        # the point of precomputing: the reference is freed when this returns, before training starts
        cached = cached_reference(reference, self.loaders, mesh, self.args, device, self.tok_name, self.skip)
        return DPOTask(margs, mesh, self.args, cached=cached, skip=self.skip)


# ----------------------------------------------------------------------------------------------------
# The command line


def get_parser() -> argparse.ArgumentParser:
    p = config.get_parser()
    p.description = "Direct preference optimization from an SFT checkpoint."
    g = p.add_argument_group("preference optimization")
    g.add_argument("--init", default=None, help="the SFT checkpoint (or HF / Meta folder) to start from")
    g.add_argument("--beta", type=float, default=0.1, help="strength of the pull towards the reference")
    g.add_argument("--loss", default="sigmoid", choices=["sigmoid", "ipo", "ipo-sum", "hinge"],
                   help="sigmoid: DPO; ipo: Azar et al. 2023 on per-token log-probs (as its authors and TRL; "
                        "published betas carry over); ipo-sum: on summed log-probs (Eq. 17 as written); "
                        "hinge: SLiC (formulas in the module docstring)")
    g.add_argument("--label-smoothing", type=float, default=0.0, help="conservative DPO: assumed label noise")
    g.add_argument("--nll-coef", type=float, default=0.0,
                   help="add this times the chosen replies' negative log-likelihood per token (Llama 3: 0.2)")
    g.add_argument("--mask-format-tokens", action="store_true",
                   help="leave the chat format's tokens (headers, <|eot_id|>) out of the DPO log-probs, as "
                        "Llama 3 did")
    g.add_argument("--precompute-ref", action="store_true",
                   help="score the whole dataset with the reference once, cache it, and free the reference")
    g.add_argument("--val-fraction", type=float, default=0.05, help="share of pairs held out")
    g.add_argument("--sample-prompt", default="How do I make a cup of tea?",
                   help="a user message answered in chat mode at the end ('' to skip)")
    p.set_defaults(tokenizer=None, data="hh_rlhf_harmless_test", out_dir="out-dpo", lr=1e-5, warmup=10,
                   max_steps=200, eval_every=100, eval_batches=10, ckpt_every=200, log_every=10, seq_len=256,
                   micro_batch=4, weight_decay=0.0)
    return p


def main(argv=None):
    args = config.parse(get_parser(), argv)
    if not (0 <= args.label_smoothing < 0.5 and 0 < args.beta < math.inf):  # (NaN fails both)
        raise config.ConfigError("--beta must be > 0 and --label-smoothing in [0, 0.5)")
    if not 0 <= args.nll_coef < math.inf:
        raise config.ConfigError(f"--nll-coef must be a number >= 0, got {args.nll_coef}")
    if args.label_smoothing and args.loss != "sigmoid":  # (TRL ignores it there, silently)
        raise config.ConfigError(f"--label-smoothing {args.label_smoothing} is conservative DPO's, a change to "
                                 f"the sigmoid loss; --loss {args.loss} has no use for it: drop one of them")
    if args.cp > 1:  # a pair's log-probability is a sum over the whole sequence, which no cp rank holds
        raise config.ConfigError(f"--cp {args.cp}: DPO does not support context parallelism; use --cp 1")
    if args.dropout:  # (under LoRA the reference is the policy's own base: it would drop out too)
        raise config.ConfigError(f"--dropout {args.dropout:g}: DPO compares the policy's log-probabilities with "
                                 "the reference's, each of one model; leave out --dropout")
    train.post_train(args, DPO)


if __name__ == "__main__":
    config.run(main)
