"""A reward model: the SFT model with a score for a whole conversation, learned from preference pairs.

    python reward.py --init out-sft --data hh_rlhf_harmless_test --out-dir out-rm   # train it
    python reward.py score --reward out-rm --data PAIRS                              # accuracy and margin
    python reward.py sample --reward out-rm --policy out-sft --prompts FILE --k 8 --out best.jsonl
                                                          # rejection sampling: the best of 8 replies, for SFT

RLHF (Ouyang et al. 2022, "InstructGPT") and Llama 2 and 3 (Touvron et al. 2023; Dubey et al. 2024,
section 4.1.2) train a reward model on comparisons before optimizing a policy against it:
  - the model: the SFT model with a fresh one-output head in place of the vocabulary's
    (model.ModelArgs num_labels 1, as Hugging Face's LlamaForSequenceClassification);
  - the score r(x, y): that output at the <|eot_id|> ending the reply, where the whole conversation
    has been read (transformers reads the same last non-padding token); a reply cut by --seq-len is
    scored at its last token;
  - the loss, Bradley-Terry: -log sigmoid(r_chosen - r_rejected - m) averaged over the global
    batch's pairs; m is --margin, Llama 2's margin (a constant: these datasets lack its ratings),
    which Llama 3 dropped (m = 0, the default);
  - the metrics: accuracy (share with r_chosen > r_rejected), margin (mean r_chosen - r_rejected),
    rewards/chosen and rewards/rejected (mean scores), also at every validation (val_accuracy, ...).

It is train.py's loop with another recipe (RewardModel) and loss (RewardTask), in every layout but
cp (a score needs the whole sequence). `python checkpoint.py consolidate` writes it as a
LlamaForSequenceClassification folder, which is an --init or a --reward here.

`reward.py sample` is Llama 2 and 3's rejection sampling (Dubey et al. 2024, section 4.2.2; see its
section below): the reward model picks the best of the policy's K replies to each prompt, and those
conversations are the next round's SFT data.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import chat
import checkpoint
import config
import data
import evaluate
import launch
import model as M
import parallel as P
import train


# ----------------------------------------------------------------------------------------------------
# The score of a conversation, and the loss


def bradley_terry(r_chosen, r_rejected, margin: float = 0.0) -> torch.Tensor:
    """Per-pair negative log-likelihood of the preference under the Bradley-Terry model."""
    return -F.logsigmoid(r_chosen - r_rejected - margin)


class RewardTask:
    """train.py's task: B pairs as 2B rows, chosen first (as chat.PreferenceLoader gives them)."""

    metric_names = evaluate.PAIR_METRICS
    rows_per_example = 2
    reference_forwards = 0
    takes_hidden = False  # the loss is given the head's outputs

    def __init__(self, margs, mesh, args):
        self.mesh, self.margin = mesh, args.margin
        self._sums = torch.zeros(len(self.metric_names))

    def prepare(self, batches):
        return batches

    def count(self, batch) -> torch.Tensor:
        return torch.full((), batch[0].shape[0] // 2, device=batch[0].device)  # pairs (a fill: no copy)

    def loss(self, logits, targets, total):
        r = evaluate.scores(logits, targets, self.mesh)  # (2B,)
        rc, rr = r.chunk(2)
        with torch.no_grad():  # on the device: a .cpu() here would wait for the GPU at every micro-batch
            self._sums = self._sums.to(r.device) + evaluate.pair_sums(rc, rr) / total
        return bradley_terry(rc, rr, self.margin).sum() / total

    def metrics(self) -> torch.Tensor:
        """Metric sums since the last call (each over the global pair count: means when summed)."""
        out, self._sums = self._sums, torch.zeros_like(self._sums)
        return out


def keep_reply_ends(tok, pairs, examples, seq_len: int, context: int, say) -> list:
    """Leave out the pairs with a side over seq_len tokens (said in one line; none left is refused).
    The score is learned and read at a reply's <|eot_id|> (score_positions), which such a side has
    as a target at best: the model would learn to score unfinished replies, yet reward.py score and
    sample and rl.py read finished ones at their <|eot_id|>."""
    kept = [e for e in examples if all(len(ids) <= seq_len for ids, _ in e.values())]
    if len(kept) == len(examples):
        return kept
    lengths = [max(len(chat.encode_chat(tok, p["prompt"] + [{"role": "assistant", "content": p[side]}])[0])
                   for side in ("chosen", "rejected")) for p in pairs]  # each pair's longer side, whole
    fix = f"--seq-len {max(lengths):,} keeps every pair's end"
    if max(lengths) > context:
        fix += f", beyond the model's context ({context:,}), which keeps {sum(n <= context for n in lengths):,}"
    what = (f"{len(examples) - len(kept):,} of {len(examples):,} preference pairs have a side longer than "
            f"--seq-len {seq_len:,} tokens, which cuts off the <|eot_id|> where the reward model reads its score")
    if not kept:
        raise data.DataError(f"{what}: none is left; {fix}")
    say(f"left out: {what}; {fix}")
    return kept


# ----------------------------------------------------------------------------------------------------
# The recipe: train.py's loop with this model, preference pairs and this loss


def as_reward_model(margs: M.ModelArgs) -> M.ModelArgs:
    """A language model's shape with one output in place of the vocabulary's (untied from the embedding)."""
    return M.ModelArgs(**{**margs.__dict__, "num_labels": 1, "tie_embeddings": False})


class RewardModel(train.FromInit):
    """The model from --init with a fresh one-output head (kept if --init is a reward model)."""

    kind = "reward"
    scoring_init = True  # an SFT model (its head replaced) or a reward model (its head kept)
    rows_per_example = RewardTask.rows_per_example
    head_in_loss = False  # RewardTask's loss is given the head's outputs
    trained_whole = ("output.",)  # under LoRA the head, new, is trained whole beside the adapters

    def model_args(self, tok) -> M.ModelArgs:
        self.base = super().model_args(tok)  # the --init model's own shape (SFT.weights checks it)
        if self.base.num_labels not in (None, 1):
            raise config.ConfigError(f"--init {self.args.init} has a head of {self.base.num_labels} outputs; a "
                                     "reward model has one")
        return as_reward_model(self.base)

    def weights(self, mesh) -> dict | None:
        state = super().weights(mesh)
        if state is None or self.base.num_labels == 1:  # no --init (tests), or a reward model already
            return state
        margs = as_reward_model(self.base)  # the head: new, drawn from --seed like any initial weight
        head = M.init_tensor(margs, "output.weight", (1, margs.dim), self.args.seed)
        return collections.ChainMap({"output.weight": head}, state)

    def data(self, tok, mesh):
        say = lambda msg: print(msg, flush=True) if mesh.rank == 0 else None
        ends = lambda pairs, examples: keep_reply_ends(tok, pairs, examples, self.args.seq_len,
                                                       self.base.max_seq_len, say)
        return chat.preference_data(self.args, tok, mesh, keep=ends)

    def task(self, spec, mesh, dtype, model):
        return RewardTask(spec.margs, mesh, self.args)


# ----------------------------------------------------------------------------------------------------
# Scoring pairs with a trained reward model (reward.py score)


def score_main(argv) -> int:
    p = argparse.ArgumentParser(prog="reward.py score",
                                description="A reward model's accuracy and mean margin on preference pairs.",
                                formatter_class=launch.HelpFormatter)
    p.add_argument("--reward", required=True, help="a reward model: reward.py's --out-dir, or an HF folder")
    p.add_argument("--data", required=True, help="preference pairs, as dpo.py --data reads them")
    p.add_argument("--seq-len", type=int, default=None, help="cut rows here (default: the model's context)")
    p.add_argument("--micro-batch", type=int, default=8, help="pairs scored at once")
    p.add_argument("--device", default=None, help="cuda, cpu, ... (default: cuda if available)")
    p.add_argument("--mirror", default=None, help="local mirror folder for downloads")
    a = p.parse_args(argv)
    if a.micro_batch < 1 or (a.seq_len is not None and a.seq_len < 1):
        raise config.ConfigError("--micro-batch and --seq-len must be at least 1")
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model, tok = evaluate.load_reward_model(a.reward, device, a.mirror)
    seq_len = min(a.seq_len or model.args.max_seq_len, model.args.max_seq_len)
    pairs = chat.read_preferences(a.data, mirror=a.mirror)
    examples, _ = chat.preference_examples(tok, pairs, seq_len)
    if not examples:
        raise data.DataError(f"{a.data}: no preference pair fits --seq-len {seq_len}")
    examples = keep_reply_ends(tok, pairs, examples, seq_len, model.args.max_seq_len,
                               say=lambda msg: print(msg, file=sys.stderr))
    loader = chat.PreferenceLoader(examples, a.micro_batch, seq_len, pad_id=data.pad_id(tok))
    print(json.dumps({"reward": str(a.reward), "data": str(a.data), **evaluate.score_pairs(model, loader,
                                                                                  a.micro_batch)}))
    return 0


# ----------------------------------------------------------------------------------------------------
# Rejection sampling (reward.py sample): K replies per prompt, the reward model keeps the best
#
#   - the K replies to a prompt are one batch for model.generate (one prefill shape, one KV cache),
#     drawn from a generator seeded by (--seed, prompt index): the same however many ranks share the
#     prompts (rank r takes prompts r, r + world, ...);
#   - each reply is scored as in training: the assistant's turn read at its <|eot_id|>
#     (score_replies);
#   - a reply cut by --max-new-tokens before its <|eot_id|> is no candidate: as SFT data it would
#     teach the model to stop mid-reply. A prompt without a finished reply is counted, not kept.


def sample_replies(policy, tok, prompt, k: int, max_new_tokens: int, seq_len: int, generator,
                   temperature: float = 1.0, top_p: float | None = None) -> list[tuple[str, bool]]:
    """K replies to one prompt (messages) -> [(text, finished)]; finished: it ended with <|eot_id|> within
    max_new_tokens (and within seq_len)."""
    ids, _ = chat.encode_chat(tok, prompt, add_generation_prompt=True)
    eot = data.eot_id(tok)
    rows = M.sample(policy, ids, k, min(max_new_tokens, seq_len - len(ids)), generator, eot, tok.n_vocab,
                    temperature, top_p)
    return [(tok.decode(row[:-1]), True) if row[-1:] == [eot] else (tok.decode(row), False) for row in rows]


def best_of_k(policy, reward_model, tok, prompt, index: int, a, seq_len: int) -> dict:
    """Prompt `index`'s K replies and their scores -> its record: the SFT conversation with the best
    finished reply ("messages", absent if none finished), and every reply, score and finished flag."""
    device = policy.tok_embeddings.weight.device
    replies = sample_replies(policy, tok, prompt, a.k, a.max_new_tokens, seq_len,
                             M.replies_stream(a.seed, index, device), a.temperature, a.top_p)
    texts = [text for text, _ in replies]
    r = evaluate.score_replies(reward_model, tok, prompt, texts, seq_len).float().cpu().tolist()
    finished = [done for _, done in replies]
    record = {"index": index, "scores": r, "finished": finished, "replies": texts}
    candidates = [i for i in range(a.k) if finished[i]]
    if candidates:
        best = max(candidates, key=lambda i: r[i])
        record.update(best=best, messages=prompt + [{"role": "assistant", "content": texts[best]}])
    return record


def expected_best(scores_k: list[float], k: int) -> float:
    """The expected best score of k replies drawn from these K (without replacement): the i-th smallest of
    K is the best of a draw of k with probability C(i-1, k-1) / C(K, k). Best of 1 is the plain mean."""
    ordered, K = sorted(scores_k), len(scores_k)
    return sum(math.comb(i, k - 1) * s for i, s in enumerate(ordered)) / math.comb(K, k)


def sampling_summary(records: list[dict], k: int) -> dict:
    """What reward.py sample prints: prompts kept, the mean reward of all replies and of the kept
    ones, and the expected best of 1, 2, 4, ... K replies (finished or not), estimated from each
    prompt's K scores: how the best rises with K, from one run."""
    kept = [r for r in records if "messages" in r]
    n, ks = len(records), sorted({min(2 ** j, k) for j in range(k.bit_length() + 1)})
    return {"prompts": n, "k": k, "kept": len(kept), "no_finished_reply": n - len(kept),
            "unfinished_replies": sum(not f for r in records for f in r["finished"]),
            "reward_mean": sum(sum(r["scores"]) / k for r in records) / n,
            "kept_reward_mean": sum(r["scores"][r["best"]] for r in kept) / len(kept) if kept else None,
            "best_of_k": {str(j): sum(expected_best(r["scores"], j) for r in records) / n for j in ks}}


def sample_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="reward.py sample", description=(
        "Rejection sampling: K replies per prompt from --policy, scored by --reward; the best finished reply "
        "of each prompt is written to --out as an SFT conversation (sft.py --data reads it), with every "
        "reply and score. Under torchrun the ranks share the prompts."),
        formatter_class=launch.HelpFormatter)
    p.add_argument("--reward", required=True, help="a reward model: reward.py's --out-dir, or an HF folder")
    p.add_argument("--policy", required=True, help="the model that replies: an sft.py/dpo.py checkpoint or "
                                                   "a Hugging Face / Meta folder")
    p.add_argument("--prompts", required=True, help="a JSON/JSONL file or registered name (read_prompts)")
    p.add_argument("--out", required=True, help="the JSONL file to write")
    p.add_argument("--k", type=int, default=4, help="replies sampled per prompt (at least 2)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="the longest reply")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (0: greedy)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling: keep this probability mass")
    p.add_argument("--seq-len", type=int, default=None,
                   help="prompt + reply at most this many tokens (default: the models' context)")
    p.add_argument("--limit", type=int, default=None, help="only the first N prompts")
    p.add_argument("--seed", type=int, default=0, help="replies are drawn from (seed, prompt index)")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    p.add_argument("--device", default=None, help="cuda, cpu, ... (default: cuda if available)")
    p.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16"],
                   help="auto: bf16 on a GPU, fp32 elsewhere")
    p.add_argument("--mirror", default=None, help="local mirror folder for downloads")
    return p


def check_sample_flags(a):
    """Everything wrong with the flags, before a model is loaded: sampling takes long, and a flag found
    wrong after it would throw the replies away."""
    if a.k < 2:
        raise config.ConfigError(f"--k {a.k}: rejection sampling keeps the best of at least 2 replies (--k 1 "
                                 "would keep whatever the policy says)")
    for flag, value in (("--max-new-tokens", a.max_new_tokens), ("--seq-len", a.seq_len), ("--limit", a.limit)):
        if value is not None and value < 1:
            raise config.ConfigError(f"{flag} must be at least 1, got {value}")
    if a.seed < 0:  # (a prompt's stream is drawn from (seed, index): numpy's SeedSequence takes no negatives)
        raise config.ConfigError(f"--seed must be 0 or more, got {a.seed}")
    try:
        M.check_sampling(a.temperature, None, a.top_p)
    except ValueError as e:
        raise config.ConfigError(str(e)) from None
    out = Path(a.out)
    if os.path.isdir(out) or (os.path.exists(out) and not a.overwrite):
        raise config.ConfigError(f"--out {out} exists: give another file, or --overwrite to replace it"
                                 if not os.path.isdir(out) else f"--out {out} is a folder: name a file")
    if os.path.exists(a.prompts) and out.resolve() == Path(a.prompts).resolve():
        raise config.ConfigError(f"--out {out} is the --prompts file: writing it would lose the prompts")
    check_writable(out, "--out")


def check_writable(path: Path, flag: str):
    """That `path` can be written (write_records), before the work that makes it: its folder exists, and a
    file can be made there (tried beside it under this process's own name, removed at once: every rank of
    a job checks, and two ranks removing one probe would fail each other)."""
    if not os.path.isdir(path.parent):
        raise config.ConfigError(f"{flag} {path}: the folder {path.parent} does not exist; make it first")
    probe = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with data.writing(path.parent, path, cleanup=[probe]):
        probe.touch()
        probe.unlink()


def load_policy_and_reward(a, device, dtype, mesh):
    """The policy and the reward model, which must read the same ids: a reward model of another tokenizer
    would score text it reads as something else."""
    checkpoint.check_head(a.policy, "--policy")
    checkpoint.check_head(a.reward, "--reward", reward=True)
    tok = checkpoint.tokenizer_for(a.policy, None, a.mirror)
    reward_tok = checkpoint.tokenizer_for(a.reward, None, a.mirror)
    if reward_tok.name != tok.name:
        raise config.ConfigError(f"--reward {a.reward} reads the tokenizer {reward_tok.name}, --policy "
                                 f"{a.policy} writes {tok.name}: train the reward model from the policy's SFT "
                                 "model")
    policy = evaluate.load_model(a.policy, tok, device, dtype, mesh)
    reward_model, _ = evaluate.load_reward_model(a.reward, device, a.mirror, dtype, mesh)
    return policy, reward_model, tok


def sample_main(argv) -> int:
    a = sample_parser().parse_args(argv)
    check_sample_flags(a)
    device, precision = config.pick_device_and_precision(a)
    launch.exit_with_agent()  # a worker whose torchrun agent was killed ends too
    if device.type == "cuda":
        torch.cuda.set_device(device)
    mesh = P.init_mesh(device=device)  # every rank a dp rank: each samples its share of the prompts
    policy, reward_model, tok = load_policy_and_reward(a, device, M.DTYPES[precision], mesh)
    context = min(policy.args.max_seq_len, reward_model.args.max_seq_len)
    seq_len = min(a.seq_len or context, context)
    prompts = P.on_rank0_first(lambda: chat.read_prompts(a.prompts, a.mirror), mesh)[:a.limit]
    kept = chat.with_room(prompts, tok, seq_len, say=lambda msg: print(msg, file=sys.stderr) if mesh.rank == 0
                     else None)
    mine = [best_of_k(policy, reward_model, tok, prompts[i][1], i, a, seq_len)
            for i in kept[mesh.rank::mesh.world]]
    records = sorted((r for part in P.all_gather_objects(mine, mesh) for r in part), key=lambda r: r["index"])
    if mesh.rank == 0:
        checkpoint.write_jsonl(Path(a.out), [{"where": prompts[r["index"]][0], **r} for r in records
                                             if "messages" in r])
        print(json.dumps({"out": a.out, **sampling_summary(records, a.k)}), flush=True)
    if mesh.world > 1:
        launch.leave_job()
    return 0


# ----------------------------------------------------------------------------------------------------
# The command line


def get_parser() -> argparse.ArgumentParser:
    p = config.get_parser()
    p.description = "Train a reward model on preference pairs (Bradley-Terry), from an SFT checkpoint."
    g = p.add_argument_group("reward model")
    g.add_argument("--init", default=None,
                   help="the SFT checkpoint (or HF / Meta folder, or a reward model) to start from")
    g.add_argument("--margin", type=float, default=0.0,
                   help="Llama 2's margin m in -log sigmoid(r_chosen - r_rejected - m) (Llama 3: 0)")
    g.add_argument("--val-fraction", type=float, default=0.05, help="share of pairs held out")
    p.set_defaults(tokenizer=None, data="hh_rlhf_harmless_test", out_dir="out-rm", lr=1e-5, warmup=10,
                   max_steps=200, eval_every=100, eval_batches=10, ckpt_every=200, log_every=10, seq_len=256,
                   micro_batch=4, weight_decay=0.0)
    return p


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["score"]:
        return score_main(argv[1:])
    if argv[:1] == ["sample"]:
        return sample_main(argv[1:])
    args = config.parse(get_parser(), argv)
    if not -1e6 < args.margin < 1e6:  # (NaN fails too)
        raise config.ConfigError(f"--margin must be a number, got {args.margin}")
    if args.cp > 1:  # a score is read at a sequence's last token, which one cp rank alone holds
        raise config.ConfigError(f"--cp {args.cp}: the reward model does not support context parallelism; use "
                                 "--cp 1")
    config.configure_process(args)
    run = train.train(args, RewardModel(args))
    if run.mesh.world > 1:
        launch.leave_job()


if __name__ == "__main__":
    config.run(main)
