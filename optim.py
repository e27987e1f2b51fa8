"""The optimizer side of a training step: AdamW on fp32 master weights, the learning-rate schedule, global
gradient-norm clipping, and dynamic loss scaling for fp16.

How the pieces connect:
  - `AdamW(model.named_parameters(), ...)` flattens every parameter into one fp32 *master* buffer, one
    fp32 *gradient* buffer and two fp32 moment buffers (m, v). Model parameters become views into a flat
    buffer of their own dtype: in fp32 that buffer *is* the master, in bf16/fp16 it is a low-precision copy
    refreshed after every step with one `copy_`. Flat buffers make the update a handful of vectorized ops,
    make gradient buckets for data parallelism plain slices (parallel.py), and let ZeRO-1 shard the
    optimizer state by cutting ranges.
  - Gradients: a post-accumulate hook on each parameter adds its fresh `.grad` (any dtype) into the fp32
    buffer and frees `.grad`, so micro-batch accumulation happens in fp32 even when compute is bf16.
    `on_grad_ready` is the seam where data parallelism launches its bucketed all-reduce.
  - Weight decay is decoupled (Loshchilov & Hutter 2019) and applied to matrices only: never to norm
    weights (a scale that should stay near 1) nor to the embedding table (rows of rare tokens would be
    pulled to zero between their rare updates). Decayed parameters come first in the flat buffers, so the
    decayed region is one contiguous prefix.
  - `lr_at` is linear warmup then cosine decay to a floor; `clip_grad_norm` scales all gradients by one
    factor computed from the true global norm; `LossScaler` keeps fp16 gradients inside fp16's range.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable

import torch


def lr_at(step: int, max_lr: float, warmup: int, max_steps: int, min_lr_ratio: float = 0.1) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warmup over `warmup` steps, then cosine
    decay to min_lr_ratio * max_lr at max_steps, flat after that."""
    if step < warmup:
        return max_lr * (step + 1) / warmup
    if step >= max_steps:
        return max_lr * min_lr_ratio
    progress = (step - warmup) / max(1, max_steps - warmup)
    return max_lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def decays(name: str, p: torch.Tensor) -> bool:
    """Weight decay applies to the linear layers' matrices; not to norms (1-D) nor the embedding table."""
    return p.dim() >= 2 and "tok_embeddings" not in name


class AdamW:
    """AdamW over flat fp32 buffers; the model's parameters (any dtype) are views into a flat buffer.

    Build it after the model is on its device and in its training dtype: that is the storage it takes over.
    """

    def __init__(self, named_params: Iterable[tuple[str, torch.nn.Parameter]], lr: float = 3e-4,
                 betas=(0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.1,
                 no_decay: Callable[[str, torch.Tensor], bool] | None = None):
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
        uniq, seen = [], set()
        for name, p in named_params:
            if p.requires_grad and id(p) not in seen:  # a tied weight appears once, under its first name
                seen.add(id(p))
                uniq.append((name, p))
        decide = (lambda n, p: not no_decay(n, p)) if no_decay else decays
        uniq.sort(key=lambda np_: not decide(*np_))  # stable: decayed first, model order kept inside each
        self.names = [n for n, _ in uniq]
        self.params = [p for _, p in uniq]
        self.n_decay = sum(p.numel() for n, p in uniq if decide(n, p))
        self.offsets, off = [], 0
        for p in self.params:
            self.offsets.append(off)
            off += p.numel()
        self.numel = off
        p0 = self.params[0]
        self.dtype, self.device = p0.dtype, p0.device
        # The flat buffers, each (numel,) fp32 on the parameters' device.
        self.master = torch.empty(self.numel, dtype=torch.float32, device=self.device)
        self.grad = torch.zeros_like(self.master)
        self.exp_avg = torch.zeros_like(self.master)
        self.exp_avg_sq = torch.zeros_like(self.master)
        self.step_count = 0
        self.model_flat = self.master if self.dtype == torch.float32 else \
            torch.empty(self.numel, dtype=self.dtype, device=self.device)
        self.on_grad_ready: Callable[[int], None] | None = None  # called with the param index (parallel.py)
        for i, p in enumerate(self.params):
            if p.dtype != self.dtype or p.device != self.device:
                raise ValueError(f"all parameters must share one dtype/device; {self.names[i]} is {p.dtype} "
                                 f"on {p.device}, {self.names[0]} is {self.dtype} on {self.device}")
            view = self.model_flat[self.offsets[i]:self.offsets[i] + p.numel()].view_as(p)
            view.copy_(p.detach())
            p.data = view  # the parameter now lives inside the flat buffer
            self.master_view(i).copy_(p.detach().float())
            p.register_post_accumulate_grad_hook(self._make_hook(i))

    def master_view(self, i: int) -> torch.Tensor:
        return self.master[self.offsets[i]:self.offsets[i] + self.params[i].numel()].view(self.params[i].shape)

    def grad_view(self, i: int) -> torch.Tensor:
        return self.grad[self.offsets[i]:self.offsets[i] + self.params[i].numel()].view(self.params[i].shape)

    def _make_hook(self, i: int):
        def hook(p):
            self.grad_view(i).add_(p.grad)  # fp32 accumulation across micro-batches
            p.grad = None
            if self.on_grad_ready is not None:
                self.on_grad_ready(i)
        return hook

    def zero_grad(self):
        self.grad.zero_()

    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm of the gradient buffer (fp32 scalar tensor; parallel.py sums it across ranks)."""
        return self.grad.norm()

    def clip_grad_norm(self, max_norm: float, norm: torch.Tensor | None = None) -> torch.Tensor:
        """Scale all gradients by min(1, max_norm / norm); returns the norm before clipping. No host sync:
        the factor stays on the device."""
        norm = self.grad_norm() if norm is None else norm
        if max_norm > 0:
            self.grad.mul_(torch.clamp(max_norm / (norm + 1e-6), max=1.0))
        return norm

    @torch.no_grad()
    def step(self, lr: float | None = None):
        """One AdamW update of the master weights from the gradient buffer, then refresh the model copy."""
        lr = self.lr if lr is None else lr
        b1, b2 = self.betas
        self.step_count += 1
        bc1 = 1 - b1 ** self.step_count
        bc2 = 1 - b2 ** self.step_count
        g = self.grad
        self.exp_avg.lerp_(g, 1 - b1)  # m = b1*m + (1-b1)*g
        self.exp_avg_sq.mul_(b2).addcmul_(g, g, value=1 - b2)  # v = b2*v + (1-b2)*g^2
        if self.weight_decay:
            self.master[:self.n_decay].mul_(1 - lr * self.weight_decay)  # decoupled: not through m or v
        denom = (self.exp_avg_sq.sqrt() / math.sqrt(bc2)).add_(self.eps)
        self.master.addcdiv_(self.exp_avg, denom, value=-lr / bc1)
        if self.model_flat is not self.master:
            self.model_flat.copy_(self.master)  # round to bf16/fp16 once, for the next forward

    # Checkpoints keep state per parameter name, so they do not depend on the flat layout (or, later, on
    # how tensor/pipeline parallelism cut the model).
    def state_dict(self) -> dict:
        per_param = {}
        for i, name in enumerate(self.names):
            sl = slice(self.offsets[i], self.offsets[i] + self.params[i].numel())
            per_param[name] = {"master": self.master[sl].view(self.params[i].shape),
                               "exp_avg": self.exp_avg[sl].view(self.params[i].shape),
                               "exp_avg_sq": self.exp_avg_sq[sl].view(self.params[i].shape)}
        return {"step": self.step_count, "params": per_param}

    @torch.no_grad()
    def load_state_dict(self, state: dict):
        missing = set(self.names) - set(state["params"])
        if missing:
            raise ValueError(f"optimizer state lacks {sorted(missing)[:4]}")
        self.step_count = int(state["step"])
        for i, name in enumerate(self.names):
            sl = slice(self.offsets[i], self.offsets[i] + self.params[i].numel())
            s = state["params"][name]
            for buf, key in ((self.master, "master"), (self.exp_avg, "exp_avg"), (self.exp_avg_sq, "exp_avg_sq")):
                if s[key].numel() != self.params[i].numel():
                    raise ValueError(f"optimizer state for {name} has shape {tuple(s[key].shape)}, "
                                     f"the model has {tuple(self.params[i].shape)}")
                buf[sl].copy_(s[key].reshape(-1))
        if self.model_flat is not self.master:
            self.model_flat.copy_(self.master)


class LossScaler:
    """Dynamic loss scaling for fp16 (Micikevicius et al. 2018): multiply the loss by `scale` so small
    gradients stay representable; if any gradient overflowed, skip the step and halve the scale; after
    `growth_interval` clean steps, double it. bf16 has fp32's exponent range and needs none of this."""

    def __init__(self, init_scale: float = 2.0 ** 16, growth_interval: int = 1000):
        self.scale, self.growth_interval, self.good_steps = init_scale, growth_interval, 0

    def unscale_and_check(self, opt: AdamW) -> bool:
        """Divide the gradients by the scale; return True if they are all finite (the step may proceed)."""
        opt.grad.mul_(1.0 / self.scale)
        finite = bool(torch.isfinite(opt.grad).all())
        if not finite:
            self.scale /= 2
            self.good_steps = 0
        else:
            self.good_steps += 1
            if self.good_steps % self.growth_interval == 0:
                self.scale *= 2
        return finite

    def state_dict(self):
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, s):
        self.scale, self.good_steps = float(s["scale"]), int(s["good_steps"])
