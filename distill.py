"""Knowledge distillation: a small model (the student) taught from a larger one's (the teacher's) next-token
distributions rather than from the data's one-hot next tokens alone (Hinton et al. 2015; Llama 3.2's 1B and
3B learned from Llama 3.1 8B's and 70B's logits).

    python train.py --out-dir out-teacher                                        # a mini teacher
    python distill.py --teacher out-teacher --model tiny --out-dir out-student    # a tiny student from it
    torchrun --nproc_per_node=4 distill.py --teacher Llama-3.1-8B --init Llama-3.2-1B --tp 2 --data alpaca_5000

train.py's loop (its seven phases, flags, layouts, checkpoints and --resume) with this recipe:
  - the teacher: --teacher, any model the project reads (a checkpoint, a Hugging Face or a Meta folder),
    frozen and cut like the student (tp, pp); its tokenizer must be the student's, and its head as many
    rows, or the run is refused before any model is built;
  - the student: --init, or a preset (--model) at random, with the teacher's tokenizer;
  - the data: text (token shards, as train.py reads them: --data tinyshakespeare) or conversations (as
    sft.py reads them: a registered SFT set or a .json/.jsonl file; the assistant's tokens are the targets);
  - the loss, at every target token t, with p = softmax(logits / tau) over the tokenizer's ids
    (tau: --temperature):
        forward KL (default)   KL(p_teacher || p_student) = sum_v p_t(v) (log p_t(v) - log p_s(v))
        reverse KL (--kl reverse)  KL(p_student || p_teacher), mode-seeking (MiniLLM, Gu et al. 2024)
    times tau^2 (Hinton's: the gradient keeps its scale as tau grows), mixed with the data's
    cross-entropy by --ce-weight w:  (1 - w) tau^2 KL + w CE,  summed over the global batch's target
    tokens and divided by their count. Logged: kl and ce (the student's cross-entropy on the data at
    temperature 1: val_ce is comparable with a train.py run's val_loss).
Under tp the logits are cut along the vocabulary on both models alike: each rank holds the same columns of
both, and a KL costs two numbers per token across ranks (the log-sum-exps gathered, the sums reduced), as
the cross-entropy does (loss.py). Refused: cp (the teacher's logits are made before a sequence is cut over
the cp ranks) and --dropout (the teacher's distribution is compared with the student's own).
"""

from __future__ import annotations

import argparse
import math

import torch

import checkpoint
import config
import costs
import data
import loss
import model as M
import parallel as P
import sft
import train


# ----------------------------------------------------------------------------------------------------
# The loss: the KL between two next-token distributions, for any tp layout


def kl_and_grad(student, teacher, kind: str, tau: float, n_valid: int, mesh_key: int, tp: int):
    """Per-token KL (N,) between softmax(teacher / tau) and softmax(student / tau), both (N, V/tp) (this tp
    rank's columns, the first n_valid of them ids of the tokenizer), and its gradient in the student's
    logits (N, V/tp) fp32:
        forward  sum_v p_t (log p_t - log p_s)      gradient  (p_s - p_t) / tau
        reverse  sum_v p_s (log p_s - log p_t)      gradient  p_s (log p_s - log p_t - KL) / tau"""
    s, t = (z[:, :n_valid].float() / tau for z in (student, teacher))
    log_ps, log_pt = (x - loss.vocab_logsumexp(x, mesh_key, tp)[:, None] for x in (s, t))
    p_s, p_t = log_ps.exp(), log_pt.exp()
    kl = (p_t * (log_pt - log_ps) if kind == "forward" else p_s * (log_ps - log_pt)).sum(dim=-1)
    if tp > 1:
        P.all_reduce_op(kl, mesh_key, "tp")
    grad = torch.zeros(student.shape, dtype=torch.float32, device=student.device)
    grad[:, :n_valid] = (p_s - p_t if kind == "forward" else p_s * (log_ps - log_pt - kl[:, None])) / tau
    return kl, grad


class _DistillKL(torch.autograd.Function):
    """kl_and_grad at the target tokens (valid), the gradient kept; backward scales it by each token's
    incoming one (the loss is a weighted sum of the tokens' KLs)."""

    @staticmethod
    def forward(ctx, student, teacher, valid, kind, tau, n_valid, mesh):
        kl, grad = kl_and_grad(student, teacher, kind, tau, n_valid, mesh.key, mesh.tp)
        ctx.save_for_backward(grad.mul_(valid[:, None]))
        ctx.dtype = student.dtype
        return kl * valid

    @staticmethod
    def backward(ctx, grad_kl):
        grad, = ctx.saved_tensors
        return grad.mul_(grad_kl[:, None]).to(ctx.dtype), None, None, None, None, None, None


def distill_kl(student, teacher, targets, kind: str, tau: float, n_vocab: int, mesh: P.Mesh) -> torch.Tensor:
    """Per-token KL (B, T) of the student's logits from the teacher's (B, T, V/tp each), 0 where the target
    is data.IGNORE_INDEX; the distributions are over the tokenizer's n_vocab ids."""
    Vl = student.shape[-1]
    n_valid = loss.vocab_columns(Vl, n_vocab, mesh)[1]
    valid = (targets != data.IGNORE_INDEX).float().reshape(-1)
    kl = _DistillKL.apply(student.reshape(-1, Vl), teacher.reshape(-1, Vl), valid, kind, tau, n_valid, mesh)
    return kl.view(targets.shape)


class DistillTask:
    """The loss the loop calls: the teacher's logits made in prepare() (pipelined like the student's, on the
    last stage), the KL and cross-entropy at each target token, over the global count of target tokens."""

    metric_names = ("kl", "ce")
    rows_per_example = 1
    takes_hidden = False  # the loss is given the logits

    def __init__(self, mesh, args, teacher, n_vocab: int, teacher_forwards: float):
        self.mesh, self.args, self.teacher, self.n_vocab = mesh, args, teacher, n_vocab
        self.reference_forwards = teacher_forwards  # the teacher's forward, in the student's forwards (FLOPs)
        self._sums = torch.zeros(2, device=mesh.device)

    @torch.no_grad()
    def prepare(self, batches):
        """Each micro-batch with the teacher's logits beside its targets (None off the last stage)."""
        dtype = next(self.teacher.parameters()).dtype
        logits = P.pipeline_forward(self.teacher, batches, self.mesh, self.args.seq_len, lambda out, y: out, dtype)
        logits = logits if self.mesh.last_stage else [None] * len(batches)
        return [(b[0], (b[1], t), *b[2:]) for b, t in zip(batches, logits)]

    def count(self, batch) -> torch.Tensor:
        y = batch[1][0] if isinstance(batch[1], tuple) else batch[1]  # (prepared, or as the loader gave it)
        return (y != data.IGNORE_INDEX).sum()

    def loss(self, logits, targets, total):
        y, teacher = targets
        a = self.args
        kl = distill_kl(logits, teacher, y, a.kl, a.temperature, self.n_vocab, self.mesh)
        ce = loss.token_losses(logits, y, self.n_vocab, self.mesh)
        self._sums += torch.stack([kl.detach().sum(), ce.detach().sum()]) / total
        return ((1 - a.ce_weight) * a.temperature ** 2 * kl + a.ce_weight * ce).sum() / total

    def metrics(self) -> torch.Tensor:
        """kl and ce, each this replica's share of its mean over the global batch's target tokens."""
        out, self._sums = self._sums, torch.zeros_like(self._sums)
        return out


# ----------------------------------------------------------------------------------------------------
# The recipe: the student as FromInit has it, the teacher beside it, text or conversations


def is_chat(name: str) -> bool:
    """--data: conversations (a registered SFT set, or a .json/.jsonl file), else text (token shards)."""
    return name in data.SFT_DATASETS or str(name).endswith((".json", ".jsonl"))


class Distill(train.FromInit):
    """The student from --init or a preset, the teacher from --teacher, the KL to the teacher's distributions."""

    kind = "distill"
    head_in_loss = False  # DistillTask's loss is given the logits
    resume_flags = ("teacher",)  # (a student resumed under another teacher would learn another target)

    def __init__(self, args):
        super().__init__(args)
        self.chat = is_chat(args.data)  # (the checkpoint says which: an export of a chat model stops at eot)

    def tokenizer(self):
        """The teacher's; a student from --init must read the same ids (refused before a model is built)."""
        a = self.args
        checkpoint.check_head(a.teacher, "--teacher")
        theirs = checkpoint.tokenizer_for(a.teacher, a.tokenizer if a.init is None else None, a.mirror)
        self.tok = super().tokenizer() if a.init is not None else theirs
        if theirs.name != self.tok.name:
            raise config.ConfigError(f"--teacher {a.teacher} reads the tokenizer {theirs.name}, the student "
                                     f"--init {a.init} {self.tok.name}: their distributions are over other ids")
        a.tokenizer = self.tok.name  # (the text data is tokenized with it)
        return self.tok

    def model_args(self, tok) -> M.ModelArgs:
        """The student's (a preset at random needs no word of warning here), checked against the teacher's."""
        if self.args.init:
            margs = super().model_args(tok)
        else:
            margs, self.state = train.Pretraining.model_args(self, tok), None
        teacher = teacher_args(self.args.teacher, tok)
        if teacher.vocab_size != margs.vocab_size:
            raise config.ConfigError(f"--teacher {self.args.teacher} has a head of {teacher.vocab_size:,} rows, the "
                                     f"student {margs.vocab_size:,}: distillation compares their logits id by id "
                                     "(give the student the teacher's --vocab-size)")
        # the teacher's weights in the memory check, in copies of the student's (checks.check_memory)
        self.frozen_copies = costs.count_params(teacher) / costs.count_params(margs)
        return margs

    def weights(self, mesh) -> dict | None:
        state = super().weights(mesh)
        self.initial = None  # (FromInit keeps --init's weights for a frozen copy of them; the teacher is another)
        return state

    def masked_attention(self) -> str | None:
        return "fine-tuning keeps it within each example of a row" if self.chat else None

    def data(self, tok, mesh):
        return sft.SFT.data(self, tok, mesh) if self.chat else train.Pretraining.data(self, tok, mesh)

    def task(self, spec, mesh, dtype, model):
        margs, state = load_teacher(self.args.teacher, self.tok, mesh)
        teacher = train.build_model(margs, state, self.args, mesh, spec.device, dtype).eval().requires_grad_(False)
        flops = lambda m: costs.flops_per_token(m, self.args.seq_len)["palm"]
        forwards = flops(margs) / flops(spec.margs)  # (the teacher's forward, in forwards of the student)
        return DistillTask(mesh, self.args, teacher, self.tok.n_vocab, forwards)


def teacher_args(path, tok) -> M.ModelArgs:
    """The teacher's shape as it is built for tok, before any weight is read (but a Meta folder's, which
    records no shape of its own: those are read twice)."""
    if checkpoint.is_checkpoint(path):
        margs = checkpoint.checkpoint_args(checkpoint.resolve(path, say=lambda msg: None, verify=False))
    else:
        margs = checkpoint.load_init(path, None)[0]  # (a Hugging Face folder: its headers alone)
    return checkpoint.with_room_for(margs, tok.n_vocab)


def load_teacher(path, tok, mesh) -> tuple[M.ModelArgs, dict]:
    """--teacher's shape and weights; a checkpoint's shards are checked by every rank, a share each."""
    if checkpoint.is_checkpoint(path):
        path = checkpoint.resolve(path, say=lambda msg: None, check=checkpoint.shared_check(mesh))
        return checkpoint.load_init(path, tok, verify=False)
    return checkpoint.load_init(path, tok)


# ----------------------------------------------------------------------------------------------------
# The command line


def get_parser() -> argparse.ArgumentParser:
    p = config.get_parser()
    p.description = "Knowledge distillation: a student taught from a teacher's next-token distributions."
    g = p.add_argument_group("distillation")
    g.add_argument("--teacher", default=None, help="the teacher: a checkpoint, a Hugging Face or Meta folder")
    g.add_argument("--init", default=None, help="the student to start from (default: --model at random)")
    g.add_argument("--kl", default="forward", choices=["forward", "reverse"],
                   help="forward: KL(teacher || student), covers the teacher's modes; reverse: KL(student || "
                        "teacher), seeks one")
    g.add_argument("--temperature", type=float, default=1.0, help="both distributions are softmax(logits / tau)")
    g.add_argument("--ce-weight", type=float, default=0.0,
                   help="w in (1 - w) tau^2 KL + w CE: the data's cross-entropy mixed in (0: the teacher alone)")
    g.add_argument("--pack", action=argparse.BooleanOptionalAction, default=True,
                   help="conversations: pack several per sequence (attention never crosses them)")
    g.add_argument("--val-fraction", type=float, default=0.05, help="conversations: the share held out")
    g.add_argument("--sample-prompt", default="", help="conversations: a user message answered at the end")
    p.set_defaults(tokenizer=None, out_dir="out-distill")
    return p


def check_flags(a):
    if not a.teacher:
        raise config.ConfigError("distill.py needs --teacher (a checkpoint, a Hugging Face or Meta folder)")
    if not (0 < a.temperature < math.inf and 0 <= a.ce_weight <= 1):
        raise config.ConfigError("need --temperature > 0 and --ce-weight in [0, 1]")
    if a.cp > 1:
        raise config.ConfigError(f"--cp {a.cp}: distill.py does not support context parallelism (the teacher's "
                                 "logits are made before a sequence is cut over the cp ranks); use --cp 1")
    if a.dropout:
        raise config.ConfigError(f"--dropout {a.dropout:g}: the student's distribution is compared with the "
                                 "teacher's as it is; leave out --dropout")


def main(argv=None):
    args = config.parse(get_parser(), argv)
    check_flags(args)
    train.post_train(args, Distill)


if __name__ == "__main__":
    config.run(main)
