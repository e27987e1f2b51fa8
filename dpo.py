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
averaged over the pairs of the global batch. The IPO authors' results, and TRL's "ipo", divide each
sequence's log-prob by its response length first, so a published beta means the same here (summed, beta
would have to shrink with the length). cDPO applies --label-smoothing as written above; TRL 1.16's
"sigmoid" silently ignores label_smoothing (it trains plain DPO), so the two agree only at 0. Logged with
TRL's names and meanings, whatever the loss, from the summed log-probs: rewards/chosen = beta * r_c,
rewards/rejected = beta * r_r, rewards/accuracies (share with r_c > r_r), rewards/margins, logps/chosen,
logps/rejected; under ipo the same of the per-token log-probs the loss uses, as rewards_per_token/... and
logps_per_token/....

Llama 3's two changes (Dubey et al. 2024, section 4.1.4), both off by default: --mask-format-tokens leaves
the chat format's tokens (headers and <|eot_id|>: the same in both replies, so their log-probs only add
noise to the margin) out of every DPO log-prob, the rewards and logps metrics included; --nll-coef c adds c
times the chosen reply's negative log-likelihood per token (its length-normalized NLL, as in Pang et al.
2024's RPO, on every learned token, <|eot_id|> included), averaged over the pairs, logged as nll_loss.

It is train.py's loop with another task: each micro-batch holds B pairs as 2B rows (chosen rows first), and
the task's prepare() adds the reference log-probs to it, either computed alongside by the reference model
(default) or, with --precompute-ref, computed once for the whole dataset before training (split over the
dp replicas), cached in <out-dir>/ref_logps.pt, and the reference freed.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import re
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import config
import data
import model as M
import parallel as P
import sft
import train as T


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


# ----------------------------------------------------------------------------------------------------
# The data: preference pairs, each side encoded with the chat format and SFT's length rule (sft.py)


_HH_TURN = re.compile(r"\n\n(Human|Assistant):")


def _parse_hh(text) -> tuple:
    """An HH-RLHF dialogue "\\n\\nHuman: ...\\n\\nAssistant: ..." -> (messages before the last reply, last
    reply)."""
    cut = text.rfind("\n\nAssistant:")
    if cut < 0:
        raise data.DataError('an HH-RLHF dialogue without "\\n\\nAssistant:"')
    pieces = _HH_TURN.split(text[:cut])  # ["", "Human", " text", "Assistant", " text", ...]
    if pieces[0].strip():
        raise data.DataError('an HH-RLHF dialogue must start with "\\n\\nHuman:"')
    messages = []
    for speaker, content in zip(pieces[1::2], pieces[2::2]):
        role = "user" if speaker == "Human" else "assistant"
        if messages and messages[-1]["role"] == role:  # a few dialogues hold two turns in a row: join them
            messages[-1]["content"] += "\n\n" + content.strip()
        else:
            messages.append({"role": role, "content": content.strip()})
    return messages, text[cut + len("\n\nAssistant:"):].strip()


NO_PROMPT = ('a pair needs a prompt: a "prompt" field (a string or messages), or "chosen" and "rejected" as '
             'whole conversations (message lists, or HH-RLHF dialogues "\n\nHuman: ...\n\nAssistant: ...")')


def _preference_side(value, prompt) -> tuple:
    """One of "chosen" / "rejected" -> (the conversation before the reply, the reply). A reply with no user
    message before it has nothing it answers: refused (NO_PROMPT)."""
    if isinstance(value, str):
        if prompt is None and "\n\nAssistant:" not in value:
            raise data.DataError(NO_PROMPT)
        before, reply = (prompt, value) if prompt is not None else _parse_hh(value)
    else:
        data.check_messages(value)
        if not value or value[-1]["role"] != "assistant":
            raise data.DataError("a chosen/rejected message list must end with an assistant message")
        prefix, prompt = value[:-1], prompt or []
        # the list may repeat the prompt (chosen = [user, assistant]) or continue it (chosen = [assistant])
        before, reply = (prefix if prefix[:len(prompt)] == prompt else prompt + prefix), value[-1]["content"]
    if not any(m["role"] == "user" for m in before):
        raise data.DataError(NO_PROMPT)
    return before, reply


def pair_sides(record) -> tuple:
    """One preference record -> ((prompt, chosen reply), (prompt, rejected reply)), each prompt a message
    list (a pair whose two prompts differ is the caller's to skip)."""
    if not (isinstance(record, dict) and "chosen" in record and "rejected" in record):
        fields = list(record)[:8] if isinstance(record, dict) else type(record).__name__
        raise data.DataError(f"unknown preference record {fields}: expected {{prompt, chosen, rejected}} or "
                             "HH-RLHF {chosen, rejected}")
    prompt = record.get("prompt")
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    elif prompt is not None:
        data.check_messages(prompt)
    return tuple(_preference_side(record[k], prompt) for k in ("chosen", "rejected"))


def read_preferences(path_or_name, mirror=None) -> list:
    """A registered name (data.PREFERENCE_DATASETS) or a JSONL file -> [{"prompt": messages, "chosen",
    "rejected"}].

    Records: {"prompt", "chosen", "rejected"}, each a string (a prompt string is one user message) or a
    message
    list, or HH-RLHF's {"chosen", "rejected"} full dialogues. Pairs whose two prompts differ, with an empty
    reply or with identical replies are skipped, and the counts printed (stderr).
    """
    path = data.named_file(path_or_name, data.PREFERENCE_DATASETS, mirror)
    pairs, skipped = [], {"different prompts": 0, "an empty reply": 0, "identical replies": 0}
    for where, record in data.json_records(path):
        try:
            (prompt, chosen), (other, rejected) = pair_sides(record)
        except data.DataError as e:
            raise data.DataError(f"{where}: {e}") from None
        if prompt != other:
            skipped["different prompts"] += 1
        elif not (chosen.strip() and rejected.strip()):
            skipped["an empty reply"] += 1
        elif chosen == rejected:  # no preference to learn from
            skipped["identical replies"] += 1
        else:
            pairs.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    print(f"{path}: {len(pairs):,} preference pairs; skipped " +
          ", ".join(f"{n:,} with {reason}" for reason, n in skipped.items()), file=sys.stderr)
    if not pairs:
        raise data.DataError(f"{path}: no usable preference pairs")
    return pairs


def reply_example(enc, prompt, reply, seq_len) -> tuple:
    """A prompt (messages) and one reply -> ((ids, mask) by the SFT length rule, sft.fit_example: None if no
    reply token survives the cut to seq_len + 1 tokens; whether it was cut). The mask is on the reply and
    its <|eot_id|> only: earlier assistant turns of the prompt are context here."""
    prompt_len = len(data.encode_chat(enc, prompt)[0])
    ids, mask = data.encode_chat(enc, prompt + [{"role": "assistant", "content": reply}])
    mask[:prompt_len] = [False] * prompt_len
    return sft.fit_example(ids, mask, seq_len), len(ids) > seq_len + 1


def preference_examples(enc, pairs, seq_len) -> tuple:
    """Pairs -> ([{"chosen": (ids, mask), "rejected": (ids, mask)}], counts), each side encoded as
    prompt + [assistant reply] with the mask on the reply (and its eot) only. The SFT length rule applies
    to each side; a pair is dropped if either side is, and if its two sides are the same once cut to
    seq_len + 1 tokens (replies that differ only after the cut: no preference is left to learn, and the
    pair would only dilute the batch's mean). counts as in sft_examples, tokens over both sides, plus
    "identical": the pairs dropped for that."""
    examples, truncated, dropped, identical = [], 0, 0, 0
    for pair in pairs:
        sides = {key: reply_example(enc, pair["prompt"], pair[key], seq_len) for key in ("chosen", "rejected")}
        if any(example is None for example, _ in sides.values()):
            dropped += 1
            continue
        (chosen, _), (rejected, _) = sides["chosen"], sides["rejected"]
        if np.array_equal(chosen[0], rejected[0]) and np.array_equal(chosen[1], rejected[1]):
            identical += 1
            continue
        truncated += any(cut for _, cut in sides.values())
        examples.append({key: example for key, (example, _) in sides.items()})
    both = [side for example in examples for side in example.values()]
    return examples, {**sft.example_counts(both, truncated, dropped), "examples": len(examples),
                      "identical": identical}


class PreferenceLoader(data.Positions):
    """(inputs, targets) int64 batches of shape (2 * batch_size, seq_len): rows 0..B-1 the chosen sequences,
    rows B..2B-1 the rejected ones of the same pairs, one pair a row, padded at the end. Targets are
    data.IGNORE_INDEX
    outside the reply tokens. One global sequence is one pair; positions and state as in SFTLoader."""

    def __init__(self, examples, batch_size, seq_len, dp_rank=0, dp_size=1, seed=0, pad_id=0,
                 with_index=False, index_offset=0):
        self.chosen = sft.pack_rows([e["chosen"] for e in examples], seq_len, pad_id, pack=False)[:2]
        self.rejected = sft.pack_rows([e["rejected"] for e in examples], seq_len, pad_id, pack=False)[:2]
        self.with_index, self.index_offset = with_index, index_offset
        super().__init__(len(examples), batch_size, seq_len, dp_rank, dp_size, seed, empty=sft.NO_EXAMPLES)

    def pairs(self, rows):
        """The (2B, T) inputs and targets of the given pairs (rows), chosen first."""
        inputs, targets = (np.concatenate([c[rows], r[rows]]) for c, r in zip(self.chosen, self.rejected))
        return sft.as_int64(inputs), sft.as_int64(targets)

    def next(self):
        """(inputs, targets), plus (B,) pair indices + index_offset with with_index (dpo.py's cached
        reference log-probs are looked up by them)."""
        rows, _ = self._next_items()
        batch = self.pairs(rows)
        return (*batch, torch.from_numpy(rows + self.index_offset)) if self.with_index else batch

    def fingerprint(self) -> str:
        """What identifies the data (a checkpoint records it; --resume refuses other data): its rows."""
        return sft.rows_fingerprint(*self.chosen, *self.rejected)


# ----------------------------------------------------------------------------------------------------
# The loss


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
    return -P.token_losses(logits, skipping(targets, skip), vocab_size, mesh).sum(dim=-1)


def skipping(targets, skip):
    """targets with the ids in `skip` made IGNORE_INDEX (no loss, no log-prob)."""
    if skip is None:
        return targets
    return targets.masked_fill(torch.isin(targets, skip.to(targets.device)), data.IGNORE_INDEX)


def reference_logps(reference, batches, mesh, args, skip=None) -> list:
    """Sequence log-probs of every micro-batch under the frozen reference (pipelined like the policy), the
    target ids in `skip` left out; only the last stage computes them, the others get None."""
    with M.without_lora(reference):  # (LoRA: the reference is the policy's own frozen model)
        scored = P.pipeline_forward(reference, batches, mesh, args.seq_len, reference.args.dim,
                                    lambda logits, y: sequence_logps(logits, y, reference.args.vocab_size, mesh,
                                                                     skip),
                                    next(reference.parameters()).dtype, args.virtual_stages)
    return scored if mesh.last_stage else [None] * len(batches)


def precompute_reference(reference, loaders, mesh, args, device, skip=None) -> torch.Tensor:
    """Score every pair of every loader once: a (pairs, 2) tensor of (chosen, rejected) log-probs, indexed
    by the loaders' pair indices (their index_offset keeps them apart). The micro-batches are dealt out
    over the dp replicas; each pair is scored by one replica, zeros stand elsewhere, and a sum over dp
    (x + 0 is exact) gives every replica the whole table. Stages other than the last hold zeros: only the
    last one computes the loss."""
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
    """The loss of train.py's loop for preference pairs; see the module docstring. skip: the token ids left
    out of the DPO log-probs (--mask-format-tokens), or None."""

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
        token_logps = -P.token_losses(logits, y, self.vocab_size, self.mesh)  # (2B, T), 0 where not learned
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
    """--precompute-ref: the reference's log-probs of every pair, from <out-dir>/ref_logps.pt when it holds
    them for exactly these sequences, weights, tokenizer, precision and left-out tokens (skip), else
    computed (collectively) and written there, whole, then renamed."""
    cache = Path(args.out_dir) / "ref_logps.pt"
    # the rows the reference scores, with where their pair indices start (another seed's split, seq_len or
    # tokenizer gives other rows)
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
    """sha256 of the model's weights as every rank holds them (its tp shard of its pp stage's layers):
    each rank hashes its own, and the job hashes the list. The same weights cut another way give another
    digest, which only costs a recomputation."""
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


def preference_data(a, tok, mesh, with_index: bool = False, keep=None):
    """A recipe's data (train.Pretraining.data) for preference pairs: --data read, encoded and split,
    PreferenceLoaders of this dp rank for training and validation (the validation pairs' indices follow
    the training pairs', for a cache by pair index), and a description. keep(pairs, examples) -> examples:
    the recipe's own rule for them (reward.py's: the replies' ends)."""
    pairs = read_preferences(a.data, mirror=a.mirror)
    examples, counts = preference_examples(tok, pairs, a.seq_len)
    if keep is not None:
        examples = keep(pairs, examples)
    train_ex, val_ex = sft.split_and_report("preference pair", len(pairs), examples, counts, a, mesh)
    make = lambda ex, seed, offset: PreferenceLoader(
        ex, a.micro_batch, a.seq_len, dp_rank=mesh.dp_rank, dp_size=mesh.dp, seed=seed,
        pad_id=data.pad_id(tok), with_index=with_index, index_offset=offset)
    return make(train_ex, a.seed, 0), lambda: make(val_ex, 0, len(train_ex)), f"{len(train_ex):,} train pairs"


class DPO(sft.SFT):
    """train.py's recipe with SFT's model (from --init), preference pairs as the data, and DPOTask as the
    loss, against a frozen reference built from the same initial weights."""

    kind = "dpo"
    rows_per_example = DPOTask.rows_per_example
    head_in_loss = False  # DPOTask's loss is given the logits

    def __init__(self, args):
        super().__init__(args)
        # the reference (with --precompute-ref too: it lives while its log-probs are computed); under LoRA
        # it is the policy's frozen model itself, its adapters off (M.without_lora)
        self.frozen_copies = 0 if config.lora_of(args) else 1

    def weights(self, mesh) -> dict | None:
        self.initial = super().weights(mesh)  # kept: the reference is built from them too (task)
        return self.initial

    def data(self, tok, mesh):
        a = self.args
        train, make_val, desc = preference_data(a, tok, mesh, with_index=a.precompute_ref)
        self.tok_name = tok.name  # part of the cached reference's key
        self.skip = torch.tensor(data.format_ids(tok)) if a.mask_format_tokens else None
        self.loaders = train, make_val()  # precomputing scores both
        return train, make_val, desc

    def task(self, margs, mesh, device, dtype, model):
        reference = model if config.lora_of(self.args) else \
            T.build_model(margs, self.initial, self.args, mesh, device, dtype).eval().requires_grad_(False)
        if not self.args.precompute_ref:
            return DPOTask(margs, mesh, self.args, reference=reference, skip=self.skip)
        # the point of precomputing: the reference is freed when this returns, before training starts
        cached = cached_reference(reference, self.loaders, mesh, self.args, device, self.tok_name, self.skip)
        return DPOTask(margs, mesh, self.args, cached=cached, skip=self.skip)


def main(argv=None):
    args = get_parser().parse_args(argv)
    if not (0 <= args.label_smoothing < 0.5 and 0 < args.beta < math.inf):  # (NaN fails both)
        raise config.ConfigError("--beta must be > 0 and --label-smoothing in [0, 0.5)")
    if not 0 <= args.nll_coef < math.inf:
        raise config.ConfigError(f"--nll-coef must be a number >= 0, got {args.nll_coef}")
    if args.label_smoothing and args.loss != "sigmoid":  # (TRL ignores it there, silently)
        raise config.ConfigError(f"--label-smoothing {args.label_smoothing} is conservative DPO's, a change to "
                                 f"the sigmoid loss; --loss {args.loss} has no use for it: drop one of them")
    if args.cp > 1:  # a pair's log-probability is a sum over the whole sequence, which no cp rank holds
        raise config.ConfigError(f"--cp {args.cp}: DPO does not support context parallelism; use --cp 1")
    sft.post_train(args, DPO)


if __name__ == "__main__":
    config.run(main)
