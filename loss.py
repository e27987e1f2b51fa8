"""The next-token loss: phase 3 of the training step, and the log-probabilities the recipes read.

  token_losses, loss_sum    cross-entropy per token or summed, for any layout: under tensor parallelism
                            the logits are cut along the vocabulary, and two numbers per token cross
                            ranks instead of the (tokens, vocab) logits (cross_entropy_and_grad, one
                            implementation for the whole logits and for chunks of them)
  head_loss_sum             the head and the loss together, --loss-chunk tokens at a time, each chunk's
                            gradients made with its loss, so a micro-batch's logits never exist whole
  loss_chunk_used           when chunks are worth it
  LMTask                    next-token prediction as the training loop sees it: count the targets,
                            take the loss over the global batch's count, report metrics

Targets equal to data.IGNORE_INDEX (prompts in fine-tuning, padding) count for nothing.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

import data
import model as M
import parallel as P


def check_targets(targets: torch.Tensor, vocab_size: int):
    """Refuse targets outside [0, vocab_size) other than data.IGNORE_INDEX, as F.cross_entropy does:
    a vocab-parallel rank would score a target outside its columns as another rank's, and one outside
    every rank's as if it had the largest logit (asynchronous, as parallel.check_ids)."""
    bad = ((targets < 0) | (targets >= vocab_size)) & (targets != data.IGNORE_INDEX)
    torch._assert_async(~bad.any(), f"a target id is outside the vocabulary [0, {vocab_size})")


def token_losses(logits, targets, vocab_size: int, mesh: P.Mesh):
    """Per-token cross-entropy (= -log p(target)) for any layout, shaped like targets; data.IGNORE_INDEX -> 0.
    The distribution is over the ids below vocab_size (a tokenizer's, inside a padded head: RL's sampler
    never draws the padding rows)."""
    if mesh.tp == 1:
        x = logits.float()
        if vocab_size < x.shape[-1]:
            x = x.masked_fill(torch.arange(x.shape[-1], device=x.device) >= vocab_size, float("-inf"))
        return F.cross_entropy(x.view(-1, x.size(-1)), targets.reshape(-1), ignore_index=data.IGNORE_INDEX,
                               reduction="none").view(targets.shape)
    return vocab_parallel_cross_entropy(logits, targets, vocab_size, mesh)


def loss_sum(logits, targets, vocab_size: int, mesh: P.Mesh):
    """Sum of token cross-entropies for any layout (data.IGNORE_INDEX targets count 0)."""
    if mesh.tp == 1:
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1),
                               ignore_index=data.IGNORE_INDEX, reduction="sum")
    return vocab_parallel_cross_entropy(logits, targets, vocab_size, mesh).sum()


# Under tensor parallelism the head is column-parallel: each rank holds the logits of V/tp of the
# vocabulary. Two collectives of one number per token replace gathering the (tokens, V) logits: the
# ranks' log-sum-exps, gathered and combined, and the target's logit, which one rank holds. The
# gradient is local: softmax - onehot(target), restricted to this rank's columns.


def cross_entropy_and_grad(logits, targets, start: int, n_valid: int, mesh_key: int, tp: int,
                           grad_dtype=torch.float32):
    """Per-token cross-entropy of logits (N, V/tp; vocab-sharded under TP, this rank's columns from
    `start`, the first n_valid real) and its gradient with respect to them in grad_dtype, together:
    the fp32 logits become the softmax in place (pass a copy where the logits are needed after: a
    bf16 input is copied by its cast), cast once; the target's column is then written from its own
    fp32 value, N numbers put in place. So the (N, V) values are passed over a few times, and under
    --compile inductor fuses the passes without ever writing an fp32 (N, V) buffer. mesh_key, not the
    mesh: compiled code takes numbers, and the collectives are custom ops (parallel.py section 3)."""
    x = logits.float()
    if n_valid < x.shape[-1]:  # the vocabulary padding on the last rank never wins
        x[:, n_valid:] = float("-inf")
    lse = vocab_logsumexp(x, mesh_key, tp)  # (N,)
    local = targets - start
    mine = (local >= 0) & (local < x.shape[-1])
    local = local.masked_fill(~mine, 0)  # a gather and a put there: no host sync to count rows
    at = x.gather(1, local[:, None]).squeeze(1)  # (N,) the target's logit, where this rank holds it
    target_logit = at.masked_fill(~mine, 0.0)
    if tp > 1:
        P.all_reduce_op(target_logit, mesh_key, "tp")
    valid = (targets != data.IGNORE_INDEX).to(x.dtype)
    losses = (lse - target_logit) * valid
    grad = x.sub_(lse[:, None]).exp_().mul_(valid[:, None]).to(grad_dtype)  # softmax, in x's place
    # softmax - 1 at the target, computed in fp32 before its one rounding (p - 1 after rounding p to
    # bf16 would lose most digits of a confident prediction's gradient)
    at_grad = ((at - lse).exp() - mine.to(x.dtype)) * valid
    rows = torch.arange(len(local), device=local.device)
    return losses, grad.index_put_((rows, local), at_grad.to(grad_dtype))


def vocab_logsumexp(x, mesh_key: int, tp: int) -> torch.Tensor:
    """log sum_v exp(x_v) over the whole vocabulary of x (N, V/tp): each rank's columns', gathered over tp
    and combined (N,)."""
    lse = x.logsumexp(dim=-1)
    return lse if tp == 1 else P.all_gather_op(lse, mesh_key, "tp").view(tp, -1).logsumexp(dim=0)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """cross_entropy_and_grad on a copy of the logits (N, V/tp); backward scales the kept gradient by
    each token's incoming one."""

    @staticmethod
    def forward(ctx, logits, targets, start, n_valid, mesh):
        losses, grad = cross_entropy_and_grad(logits.to(torch.float32, copy=True), targets, start, n_valid,
                                              mesh.key, mesh.tp)
        ctx.save_for_backward(grad)
        ctx.dtype = logits.dtype
        return losses

    @staticmethod
    def backward(ctx, grad_losses):
        grad, = ctx.saved_tensors
        return grad.mul_(grad_losses[:, None]).to(ctx.dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits, targets, vocab_size: int, mesh: P.Mesh):
    """logits (..., V/tp) on each TP rank, targets (...) global ids -> per-token losses (...)."""
    check_targets(targets, vocab_size)
    Vl = logits.shape[-1]
    losses = _VocabParallelCrossEntropy.apply(logits.reshape(-1, Vl), targets.reshape(-1),
                                              *vocab_columns(Vl, vocab_size, mesh), mesh)
    return losses.view(targets.shape)


def vocab_columns(Vl: int, vocab_size: int, mesh: P.Mesh) -> tuple[int, int]:
    """This rank's Vl columns of the head -> (the id of its first, how many of them are ids below vocab_size):
    the last ranks' columns may be padding past the tokenizer's vocabulary."""
    start = mesh.tp_rank * Vl
    return start, max(0, min(Vl, vocab_size - start))


def chunk_loss_and_grad(logits, targets, start: int, n_valid: int, mesh_key: int, tp: int):
    """One chunk's summed cross-entropy and its logits' gradient in their dtype (in place: the logits
    of a chunk are made for this call alone)."""
    losses, grad = cross_entropy_and_grad(logits, targets, start, n_valid, mesh_key, tp, logits.dtype)
    return losses.sum(), grad


@functools.cache
def compiled_chunk_loss_and_grad():
    return torch.compile(chunk_loss_and_grad, dynamic=False)


class _ChunkedHeadLoss(torch.autograd.Function):
    """sum over rows of the cross-entropy of head(h), `chunk` rows at a time: forward makes each
    chunk's logits, its loss and gradient (chunk_loss_and_grad), then the gradients of h and of the
    head's weight by two matmuls, and drops the logits, so the (N, V) logits never exist whole
    (Liger-Kernel's "fused linear cross-entropy", in plain torch). The logits come from calls of the
    head module itself, so its forward hooks run (ZeRO-1 and 2 wait there for its updated weights'
    all-gather). Under TP each rank's gradient of h is its columns' part; the final norm's f sums
    them in backward. Backward only scales the kept fp32 gradients, h's (N, dim) and the weight's
    (V, dim), by the incoming gradient, so the result must be used linearly (a sum, divided by a
    count). A frozen head (LoRA) gets no gradient."""

    @staticmethod
    def forward(ctx, h, weight, targets, chunk, head, loss_and_grad):
        grad_h = torch.empty(h.shape, dtype=torch.float32, device=h.device)
        trained = weight.requires_grad
        grad_w = torch.zeros(weight.shape if trained else (), dtype=torch.float32, device=weight.device)
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        for lo in range(0, h.shape[0], chunk):
            hc = h[lo:lo + chunk]
            loss, grad = loss_and_grad(head(hc), targets[lo:lo + chunk])  # grad: (n, V/tp)
            grad_h[lo:lo + chunk] = grad @ weight  # (n, dim)
            if trained:
                grad_w += grad.T @ hc  # (V/tp, dim), summed in fp32
            total += loss
        ctx.save_for_backward(grad_h, grad_w)
        ctx.dtypes = h.dtype, weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad):
        grad_h, grad_w = ctx.saved_tensors
        grad_w = grad_w.mul_(grad).to(ctx.dtypes[1]) if grad_w.dim() else None
        return grad_h.mul_(grad).to(ctx.dtypes[0]), grad_w, None, None, None, None


def head_loss_sum(h, head: nn.Module, targets, vocab_size: int, mesh: P.Mesh, chunk: int, compiled=False):
    """loss_sum(head(h), targets) for h (..., dim), the final norm's output, and the head (vocab-sharded
    under TP): chunk rows (tokens) of logits at a time (_ChunkedHeadLoss), its per-chunk arithmetic
    compiled where `compiled` (--compile). Without gradients (evaluation) the chunks are summed as they
    come."""
    h, targets = h.reshape(-1, h.shape[-1]), targets.reshape(-1)
    if torch.is_grad_enabled() and (h.requires_grad or head.weight.requires_grad):
        check_targets(targets, vocab_size)
        start, n_valid = vocab_columns(head.weight.shape[0], vocab_size, mesh)
        # compiled for one shape: a shorter last chunk runs eager, so nothing is compiled twice
        fn = lambda n: compiled_chunk_loss_and_grad() if compiled and n == chunk else chunk_loss_and_grad
        loss_and_grad = lambda logits, t: fn(len(t))(logits, t, start, n_valid, mesh.key, mesh.tp)
        return _ChunkedHeadLoss.apply(h, head.weight, targets, chunk, head, loss_and_grad)
    return sum(loss_sum(head(h[lo:lo + chunk]), targets[lo:lo + chunk], vocab_size, mesh)
               for lo in range(0, h.shape[0], chunk))


def loss_chunk_used(chunk: int, tokens: int, zero: int) -> int:
    """The chunk head_loss_sum is run with for micro-batches of `tokens` tokens on a rank, or 0 (whole
    logits) where chunks would not help: a micro-batch no longer than one chunk (they would only add the
    kept fp32 gradients), and ZeRO-3, whose head weights are gathered around the head module's own call,
    which the chunked loss does not make."""
    return 0 if zero == 3 or tokens <= chunk else chunk


class LMTask:
    """Next-token prediction, normalized by the global batch's target tokens (all micro-batches and
    dp ranks) so accumulation and every layout give the same gradient; data.IGNORE_INDEX targets
    (SFT prompts, padding) count for nothing. Document ids, where a batch has them, come from its
    loader (--doc-mask: data.with_documents). `chunk` (--loss-chunk): the loss gets the final norm's
    output (takes_hidden) and applies the head chunk tokens at a time (head_loss_sum;
    `compiled`: its arithmetic under --compile): a 128K vocabulary's logits for a whole micro-batch
    never exist. The loop knows only these four methods and takes_hidden."""

    metric_names: tuple = ()
    rows_per_example = 1  # model input rows per example the loader counts (a DPO pair has two)
    # forward passes of a frozen model per row, besides the trained one's (DPO: 0 or 1)
    reference_forwards = 0

    def __init__(self, margs: M.ModelArgs, mesh, head=None, chunk: int = 0, compiled: bool = False):
        self.vocab_size, self.mesh, self.compiled = margs.vocab_size, mesh, compiled
        self.head, self.chunk, self.takes_hidden = head, chunk, chunk > 0  # (head: None off the last stage)

    def prepare(self, batches):
        return batches

    def count(self, batch) -> torch.Tensor:
        return (batch[1] != data.IGNORE_INDEX).sum()

    def loss(self, out, targets, total) -> torch.Tensor:
        """out: the logits, or the final norm's output (takes_hidden); total: the normalizer."""
        if self.takes_hidden:
            return head_loss_sum(out, self.head, targets, self.vocab_size, self.mesh, self.chunk,
                                 self.compiled) / total
        return loss_sum(out, targets, self.vocab_size, self.mesh) / total

    def metrics(self) -> torch.Tensor:
        return torch.zeros(0, device=self.mesh.device)
