"""A reward model: the SFT model with a score for a whole conversation, learned from preference pairs.

    python reward.py --init out-sft --data hh_rlhf_harmless_test --out-dir out-rm   # train it
    python reward.py score --reward out-rm --data PAIRS                              # accuracy and margin

RLHF (Ouyang et al. 2022, "InstructGPT") and Llama 2 and 3's post-training (Touvron et al. 2023; Dubey et
al. 2024, section 4.1.2) train a reward model on comparisons before they optimize a policy against it:
  - the model: the SFT model, its vocabulary head replaced by a head of one output (model.ModelArgs
    num_labels 1, Hugging Face's LlamaForSequenceClassification), freshly initialized;
  - the score r(x, y) of a prompt and reply: that output at the reply's last token, the <|eot_id|> that
    ends it (there the whole conversation has been read; transformers reads the last non-padding token,
    the same one); a reply cut by --seq-len is scored at its last token;
  - the loss, Bradley-Terry: -log sigmoid(r_chosen - r_rejected - m), averaged over the pairs of the
    global batch; m is --margin, Llama 2's margin term (a constant here: its ratings are not in these
    datasets), which Llama 3 dropped (m = 0, the default);
  - the metrics: accuracy (share of pairs with r_chosen > r_rejected), margin (mean r_chosen - r_rejected),
    rewards/chosen and rewards/rejected (mean scores), each also at every validation (val_accuracy, ...).

It is train.py's loop with another recipe (RewardModel: the model from --init, preference pairs as dpo.py
reads them) and loss (RewardTask): the same phases, flags, layouts (tp, pp, dp, ZeRO; not cp: a score
needs the whole sequence), checkpoints and --resume. `python parallel.py consolidate` writes it as a
LlamaForSequenceClassification folder, and such a folder is an --init or a --reward here.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import checkpoint as C
import data
import dpo
import model as M
import parallel as P
import sft
import train as T


def get_parser() -> argparse.ArgumentParser:
    p = T.get_parser()
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


# ----------------------------------------------------------------------------------------------------
# The score of a conversation, and the loss


def score_positions(targets: torch.Tensor) -> torch.Tensor:
    """(rows, T) targets -> (rows,) the input position that holds each row's last token: one past the last
    learned target (which is the reply's <|eot_id|>), or the last position for a row cut by seq_len."""
    T = targets.shape[-1]
    after = (targets != data.IGNORE_INDEX).long() * torch.arange(1, T + 1, device=targets.device)  # t + 1
    return after.max(dim=-1).values.clamp(max=T - 1)


def scores(logits, targets, mesh) -> torch.Tensor:
    """A reward model's logits (rows, T, its head's columns on this tp rank) -> (rows,) scores r(x, y)."""
    out = P.head_outputs(logits, 1, mesh)[..., 0].float()  # (rows, T): the score after every token
    return out.gather(1, score_positions(targets)[:, None])[:, 0]


def pair_sums(r_chosen, r_rejected) -> torch.Tensor:
    """The sums behind the metrics (RewardTask.metric_names): pairs ranked right, margins, the two scores."""
    return torch.stack([(r_chosen > r_rejected).float().sum(), (r_chosen - r_rejected).sum(),
                        r_chosen.sum(), r_rejected.sum()])


def bradley_terry(r_chosen, r_rejected, margin: float = 0.0) -> torch.Tensor:
    """Per-pair losses -log sigmoid(r_c - r_r - m): the negative log-likelihood of the preference under the
    Bradley-Terry model (Llama 2's margin m)."""
    return -F.logsigmoid(r_chosen - r_rejected - margin)


class RewardTask:
    """The loss of train.py's loop for a reward model: a micro-batch of B pairs is 2B rows (chosen first, as
    dpo.PreferenceLoader gives them); the loss is the sum of the pairs' Bradley-Terry losses over the global
    pair count."""

    metric_names = ("accuracy", "margin", "rewards/chosen", "rewards/rejected")
    rows_per_example = 2
    reference_forwards = 0

    def __init__(self, margs, mesh, args):
        self.mesh, self.margin, self.total = mesh, args.margin, None
        self._sums = torch.zeros(len(self.metric_names))

    def prepare(self, batches):
        return batches

    def count(self, batch) -> torch.Tensor:
        return torch.full((), batch[0].shape[0] // 2, device=batch[0].device)  # pairs (a fill: no copy)

    def loss(self, logits, targets):
        r = scores(logits, targets, self.mesh)  # (2B,)
        rc, rr = r.chunk(2)
        with torch.no_grad():  # on the device: a .cpu() here would wait for the GPU at every micro-batch
            self._sums = self._sums.to(r.device) + pair_sums(rc, rr) / self.total
        return bradley_terry(rc, rr, self.margin).sum() / self.total

    def metrics(self) -> torch.Tensor:
        """Metric sums since the last call (each over the global pair count: means when summed)."""
        out, self._sums = self._sums, torch.zeros_like(self._sums)
        return out


# ----------------------------------------------------------------------------------------------------
# The recipe: train.py's loop with this model, preference pairs and this loss


def as_reward_model(margs: M.ModelArgs) -> M.ModelArgs:
    """A language model's shape with one output in place of the vocabulary's (untied from the embedding)."""
    return M.ModelArgs(**{**margs.__dict__, "num_labels": 1, "tie_embeddings": False})


class RewardModel(sft.SFT):
    """train.py's recipe: SFT's model from --init with a fresh head of one output (kept, if --init is a
    reward model already), preference pairs as the data, RewardTask as the loss."""

    kind = "reward"
    rows_per_example = RewardTask.rows_per_example

    def model_args(self, tok) -> M.ModelArgs:
        self.base = super().model_args(tok)  # the --init model's own shape (SFT.weights checks it)
        if self.base.num_labels not in (None, 1):
            raise T.ConfigError(f"--init {self.args.init} has a head of {self.base.num_labels} outputs; a "
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
        return dpo.preference_data(self.args, tok, mesh)

    def task(self, margs, mesh, device, dtype):
        return RewardTask(margs, mesh, self.args)


# ----------------------------------------------------------------------------------------------------
# Scoring pairs with a trained reward model (reward.py score)


def load_reward_model(path, device, mirror=None):
    """--reward: a reward model's checkpoint or Hugging Face folder -> (model in eval mode, its tokenizer)."""
    tok = C.tokenizer_for(path, None, mirror)
    margs, state = sft.load_init(path, tok)
    if margs.num_labels != 1:
        raise T.ConfigError(f"--reward {path} is not a reward model (a head of one output): train one with "
                            "reward.py")
    with torch.device("meta"):
        model = M.Transformer(margs)
    model.load_state_dict(dict(state), assign=True)
    return model.to(device).eval().requires_grad_(False), tok


@torch.no_grad()
def score_pairs(model, loader: dpo.PreferenceLoader, batch_size: int) -> dict:
    """Every pair of a loader, in order: {"pairs", "accuracy", "margin", "rewards/chosen", ...} (means)."""
    device, sums = model.tok_embeddings.weight.device, torch.zeros(4)
    for lo in range(0, len(loader), batch_size):
        x, y = (t.to(device) for t in loader.pairs(list(range(lo, min(lo + batch_size, len(loader))))))
        rc, rr = scores(model(x), y, P.Mesh()).chunk(2)
        sums += pair_sums(rc, rr).cpu()
    return {"pairs": len(loader), **dict(zip(RewardTask.metric_names, (sums / len(loader)).tolist()))}


def score_main(argv) -> int:
    p = argparse.ArgumentParser(prog="reward.py score",
                                description="A reward model's accuracy and mean margin on preference pairs.")
    p.add_argument("--reward", required=True, help="a reward model: reward.py's --out-dir, or an HF folder")
    p.add_argument("--data", required=True, help="preference pairs, as dpo.py --data reads them")
    p.add_argument("--seq-len", type=int, default=None, help="cut rows here (default: the model's context)")
    p.add_argument("--micro-batch", type=int, default=8, help="pairs scored at once")
    p.add_argument("--device", default=None, help="cuda, cpu, ... (default: cuda if available)")
    p.add_argument("--mirror", default=None, help="local mirror folder for downloads")
    a = p.parse_args(argv)
    if a.micro_batch < 1 or (a.seq_len is not None and a.seq_len < 1):
        raise T.ConfigError("--micro-batch and --seq-len must be at least 1")
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model, tok = load_reward_model(a.reward, device, a.mirror)
    seq_len = min(a.seq_len or model.args.max_seq_len, model.args.max_seq_len)
    examples, _ = dpo.preference_examples(tok, dpo.read_preferences(a.data, mirror=a.mirror), seq_len)
    if not examples:
        raise data.DataError(f"{a.data}: no preference pair fits --seq-len {seq_len}")
    loader = dpo.PreferenceLoader(examples, a.micro_batch, seq_len, pad_id=data.pad_id(tok))
    print(json.dumps({"reward": str(a.reward), "data": str(a.data), **score_pairs(model, loader,
                                                                                  a.micro_batch)}))
    return 0


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["score"]:
        return score_main(argv[1:])
    args = get_parser().parse_args(argv)
    if not -1e6 < args.margin < 1e6:  # (NaN fails too)
        raise T.ConfigError(f"--margin must be a number, got {args.margin}")
    if args.cp > 1:  # a score is read at a sequence's last token, which one cp rank alone holds
        raise T.ConfigError(f"--cp {args.cp}: the reward model does not support context parallelism; use "
                            "--cp 1")
    T.configure_process(args)
    run = T.train(args, RewardModel(args))
    if run.mesh.world > 1:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    T.run(main)
