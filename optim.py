"""The optimizer side of a training step: AdamW on fp32 master weights, the learning-rate schedule,
global gradient-norm clipping, and dynamic loss scaling for fp16.

How the pieces connect:
  - FlatParams makes each parameter a view into one flat buffer of the model's dtype, the gradients
    one flat fp32 buffer; AdamW adds fp32 *master* weights and the moments m, v. In fp32 the model's
    buffer *is* the master; in bf16/fp16, a copy refreshed by one `copy_` per step. Flat buffers
    make the update a handful of vectorized ops, data parallelism's gradient buckets plain slices
    (zero.py), and ZeRO's shards plain ranges.
  - Micro-batch gradients accumulate in fp32 even when compute is bf16 (FlatParams' hook).
    `on_grad_ready` is the seam where data parallelism launches its bucketed all-reduce.
  - Weight decay is decoupled (Loshchilov & Hutter 2019), on matrices only: not norm weights (scales
    meant to stay near 1) nor the embedding (rare tokens' rows would decay to zero between updates).
  - `lr_at`: warmup, then cosine decay to a floor. `clip_scale`: clips the gradients to the true
    global norm as the update reads them. `LossScaler`: keeps fp16 gradients in range.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Iterable

import torch


def lr_at(step: int, max_lr: float, warmup: int, max_steps: int, min_lr_ratio: float = 0.1,
          anneal_from: int | None = None) -> float:
    """Learning rate at optimizer step `step` (0-based): linear warmup over `warmup` steps, cosine
    decay to min_lr_ratio * max_lr at max_steps, flat after. anneal_from (Llama 3's annealing): from
    that step on, a straight line from the schedule's value there to 0 at max_steps - 1."""
    if anneal_from is not None and step >= anneal_from:
        last = max_steps - 1
        return lr_at(anneal_from, max_lr, warmup, max_steps, min_lr_ratio) * (last - step) / max(1, last -
                                                                                                 anneal_from)
    if step < warmup:
        return max_lr * (step + 1) / warmup
    if step >= max_steps:
        return max_lr * min_lr_ratio
    progress = (step - warmup) / max(1, max_steps - warmup)
    return max_lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


VECTOR = 16  # fp32 numbers in one AVX-512 register, the widest the fused AdamW kernel uses on a CPU


def decays(name: str, p: torch.Tensor) -> bool:
    return p.dim() >= 2 and "tok_embeddings" not in name


def pack(ranges: list[tuple[int, int]], full: torch.Tensor, compact: torch.Tensor):
    """Copy `ranges` of `full` into `compact`, one after another (converting the dtype)."""
    c = 0
    for lo, hi in ranges:
        compact[c:c + hi - lo].copy_(full[lo:hi])
        c += hi - lo


def unpack(ranges: list[tuple[int, int]], compact: torch.Tensor, full: torch.Tensor):
    """pack's inverse, as one foreach copy however many ranges."""
    starts = [0]
    for lo, hi in ranges:
        starts.append(starts[-1] + hi - lo)
    torch._foreach_copy_([full[lo:hi] for lo, hi in ranges],
                         [compact[c:c + hi - lo] for c, (lo, hi) in zip(starts, ranges)])


def load_range(ranges: list[tuple[int, int]], compact: torch.Tensor, lo: int, values: torch.Tensor):
    """Write the parts of `values` (flat positions [lo, lo + len)) that lie in `ranges` into
    `compact`, which holds those ranges packed."""
    hi, c = lo + values.numel(), 0
    for rlo, rhi in ranges:
        a, b = max(lo, rlo), min(hi, rhi)
        if a < b:
            compact[c + a - rlo:c + b - rlo].copy_(values[a - lo:b - lo])
        c += rhi - rlo


def lay_out(uniq: list, pad_to: int, unit_of) -> tuple[list[int], list, list, int]:
    """`uniq`'s flat layout: each parameter's offset, the [lo, hi) ranges that decay (`decays`,
    neighbours merged), with unit_of each unit's [lo, hi), and the length. Units and length are
    padded to multiples of pad_to (the padding: zero gradients, never read back)."""
    offsets, decay_ranges, units, off = [], [], [], 0
    for k, (n, p) in enumerate(uniq):
        if unit_of and (k == 0 or unit_of(n) != unit_of(uniq[k - 1][0])):  # a unit starts here
            off = -(-off // pad_to) * pad_to
            units.append((off, off))
        offsets.append(off)
        if decays(n, p):
            if decay_ranges and decay_ranges[-1][1] == off:
                decay_ranges[-1] = (decay_ranges[-1][0], off + p.numel())
            else:
                decay_ranges.append((off, off + p.numel()))
        off += p.numel()
        if unit_of:
            units[-1] = (units[-1][0], -(-off // pad_to) * pad_to)
    return offsets, decay_ranges, units, -(-off // pad_to) * pad_to


def packed_overlaps(ranges: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of `spans` inside `ranges`, as positions in a tensor that holds `ranges` packed."""
    out, c = [], 0
    for lo, hi in ranges:
        for slo, shi in spans:
            a, b = max(lo, slo), min(hi, shi)
            if a < b:
                out.append((c + a - lo, c + b - lo))
        c += hi - lo
    return out


def decay_rows(size: int, segments: list[tuple[int, int]]) -> torch.Tensor:
    """The one-pass step's view of where weight decay applies: the owned state as rows of g elements,
    g the largest length that divides the state's size and every decay segment's ends (2,048 for a
    1B Llama, whose norms are as long), and one bool per row: shape (size / g, 1). Broadcast over a
    row, it costs a byte per row, not per parameter."""
    g = math.gcd(size, *(x for span in segments for x in span)) or 1
    rows = torch.zeros(size // g, 1, dtype=torch.bool)
    for lo, hi in segments:
        rows[lo // g:hi // g] = True
    return rows


def adamw_pass(master, grad, m, v, model, decays, per_step, grad_scale,
               betas_eps: tuple[float, float, float]):
    """AdamW on the owned state, as rows (decay_rows), as the compiled step runs it: torch.compile
    makes it one kernel that reads the master, gradient, m and v once and writes master, m, v and
    (model not None) the model's copy in its dtype: 30 bytes a parameter in bf16
    (costs.optimizer_bytes), where the eager step's decay, fused update and refresh move 42. What
    changes each step comes on the device, per_step (3,): step_size = lr / (1 - b1^t), keep = 1 - lr
    * weight decay, bc2_sqrt = sqrt(1 - b2^t); a new value is new data, not a new compilation."""
    # one flat loop over every element, each row's decay read by index: a 2-D update beside the flat copy
    # to the model was two loops in torch 2.11, with a state-sized temporary between them
    decays = decays.expand(master.shape).reshape(-1)
    master, grad, m, v = (t.view(-1) for t in (master, grad, m, v))
    model = None if model is None else model.view(-1)
    (b1, b2, eps), (step_size, keep, bc2_sqrt) = betas_eps, per_step.unbind()
    g = grad / grad_scale
    m.lerp_(g, 1 - b1)
    v.mul_(b2).addcmul_(g, g, value=1 - b2)
    master.mul_(torch.where(decays, keep, 1.0)).sub_(step_size * m / (v.sqrt() / bc2_sqrt + eps))
    if model is not None:
        model.copy_(master)  # rounded once to the model's dtype


@functools.cache
def compiled_adamw_pass():
    # a value read by two writes (master and model) with more than realize_reads_threshold (4) inputs
    # would be stored to a temporary as large as the state, and read back: this keeps it in registers
    return torch.compile(adamw_pass, options={"realize_reads_threshold": 16})


def clip_scale(max_norm: float, norm: torch.Tensor) -> torch.Tensor | None:
    """AdamW.step's grad_scale, which clips the gradients to max_norm: max(1, norm / max_norm), the
    inverse of min(1, max_norm / norm), on norm's device; None (no clipping) when max_norm is 0."""
    return torch.clamp((norm + 1e-6) / max_norm, min=1.0) if max_norm > 0 else None


class FlatParams:
    """Flat parameter and gradient buffers. Build it once the model is on its device in its training
    dtype: it takes that storage over. Layout: reverse model order, the length padded to a multiple
    of 16 pad_to (parallel.py cuts buckets into dp equal pieces); `unit_of` (ZeRO-3) keeps each
    unit's parameters (a block, say) together, its span padded likewise. full_grad=False (ZeRO-2):
    no full-length gradient buffer; fresh gradients go only to `on_grad_ready`. `initial` (ZeRO-3 at
    scale): the parameters hold no values yet (parallel.materialize_empty) and no full-length model
    copy is ever made. shard_grads and shard_weights (ZeRO-2, 3) keep only a rank's ranges of the
    gradient buffer and of the model copy (`model_ranges`)."""

    def __init__(self, named_params: Iterable[tuple[str, torch.nn.Parameter]],
                 pad_to: int = 1, full_grad: bool = True, unit_of: Callable[[str], str] | None = None,
                 initial: Callable[[str, torch.Size], torch.Tensor] | None = None):
        uniq, seen = [], set()
        for name, p in named_params:
            if p.requires_grad and id(p) not in seen:  # a tied weight appears once, under its first name
                seen.add(id(p))
                uniq.append((name, p))
        # reversed: gradients come output first, so dp buckets fill front to back and go out early
        uniq.reverse()
        self.names = [n for n, _ in uniq]
        self.params = [p for _, p in uniq]
        self._index = {id(p): i for i, p in enumerate(self.params)}
        # 16 elements per dp piece: the fused update's vector loop covers a rank's whole shard, so
        # ZeRO matches one full buffer bit for bit (a scalar remainder rounds differently: FMAs).
        self.offsets, self.decay_ranges, self.units, self.numel = lay_out(uniq, VECTOR * pad_to, unit_of)
        self.dtype, self.device = self.params[0].dtype, self.params[0].device
        self.grads_sharded, self.initial = not full_grad, initial
        self.grad = torch.zeros(self.numel if full_grad else 0, dtype=torch.float32, device=self.device)
        self.model_flat = None if initial else torch.zeros(self.numel, dtype=self.dtype, device=self.device)
        self.model_ranges = None if initial else [(0, self.numel)]
        self.on_grad_ready: Callable[[int], None] | None = None  # set by call_on_grad_ready
        for i, p in enumerate(self.params):
            if p.dtype != self.dtype or p.device != self.device:
                raise ValueError(f"all parameters must share one dtype/device; {self.names[i]} is {p.dtype} "
                                 f"on {p.device}, {self.names[0]} is {self.dtype} on {self.device}")
            if not initial:
                view = self.model_flat[self.offsets[i]:self.offsets[i] + p.numel()].view_as(p)
                view.copy_(p.detach())
                p.data = view  # the parameter now lives inside the flat buffer
            if p.dtype == torch.float32 and full_grad:
                p.grad = self.grad_view(i)  # ... and so does its gradient (no copy after each backward)
            p.register_post_accumulate_grad_hook(self._make_hook(i))
        self.ranges = None  # what this rank owns: AdamW.shard says

    def index_of(self, p: torch.Tensor) -> int:
        """Where parameter p is in self.params (and offsets, names)."""
        return self._index[id(p)]

    def shard_grads(self, ranges: list[tuple[int, int]]):
        """ZeRO-2: the gradient buffer holds only `ranges`, packed; fp32 .grad views are dropped."""
        size = sum(hi - lo for lo, hi in ranges)
        self.grads_sharded, self.grad = True, torch.zeros(size, dtype=torch.float32, device=self.device)
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def shard_weights(self, ranges: list[tuple[int, int]]):
        """ZeRO-3: the model's copy holds only `ranges`, packed: from initial(name, shape), one
        overlapping parameter at a time, else cut from the full copy (the caller must first have
        moved the parameters' storage elsewhere). Units' padding stays 0."""
        compact, c = torch.zeros(sum(hi - lo for lo, hi in ranges), dtype=self.dtype, device=self.device), 0
        for lo, hi in ranges if self.initial else []:
            for i, off in enumerate(self.offsets):
                a, b = max(lo, off), min(hi, off + self.params[i].numel())
                if a < b:
                    value = self.initial(self.names[i], self.params[i].shape).reshape(-1)
                    compact[c + a - lo:c + b - lo].copy_(value[a - off:b - off])
            c += hi - lo
        if not self.initial:
            pack(ranges, self.model_flat, compact)
        self.model_flat, self.model_ranges = compact, ranges

    def grad_view(self, i: int) -> torch.Tensor:
        return self.grad[self.offsets[i]:self.offsets[i] + self.params[i].numel()].view(self.params[i].shape)

    def _make_hook(self, i: int):
        view = None if self.grads_sharded else self.grad_view(i)  # made once, not per backward

        def hook(p):
            # fp32: .grad *is* the buffer's view, accumulated in place. Otherwise (bf16/fp16, or
            # .grad replaced) add it in; ZeRO-2 has no such buffer: on_grad_ready takes p.grad.
            if not self.grads_sharded and p.grad is not None and p.grad.data_ptr() != view.data_ptr():
                view.add_(p.grad)
                p.grad = view if p.dtype == torch.float32 else None
            if self.on_grad_ready is not None:
                self.on_grad_ready(i)
        return hook

    def call_on_grad_ready(self, fn: Callable[[int], None]):
        """Data parallelism's seam: fn(i) runs as parameter i's gradient is ready (zero.GradSync)."""
        self.on_grad_ready = fn

    def zero_grad(self):
        self.grad.zero_()


class AdamW(FlatParams):
    """AdamW over FlatParams' buffers: fp32 master weights and moments, one fused update.

    `shard(ranges)` makes this rank own, and keep state for, only those ranges (ZeRO; by default
    all): it updates their weights in the model copy from `grad_shard`, for zero.py to all-gather
    (its GradSync classes say which stage shards what). Under ZeRO pass `allocate_state=False` and
    let shard() allocate, so the full-length state (12 bytes per parameter: master, m, v) never
    exists on a rank, even briefly."""

    def __init__(self, named_params: Iterable[tuple[str, torch.nn.Parameter]], lr: float = 3e-4,
                 betas=(0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.1,
                 pad_to: int = 1, allocate_state: bool = True, full_grad: bool = True,
                 unit_of: Callable[[str], str] | None = None,
                 initial: Callable[[str, torch.Size], torch.Tensor] | None = None):
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
        super().__init__(named_params, pad_to, full_grad, unit_of, initial)
        self.step_count, self.master, self.one_pass = 0, None, None  # no state until shard() says what
        # this rank owns; one_pass: compile()'s
        if allocate_state:
            self.shard([(0, self.numel)])

    def shard(self, ranges: list[tuple[int, int]]):
        """Keep master weights and moments for `ranges` alone, packed ("compact"). Where the model
        copy holds just these ranges (all, or ZeRO-3's) in fp32, the master *is* the model copy."""
        if self.model_flat is None:
            raise ValueError("an optimizer built with initial= holds its model copy sharded: shard_weights "
                             "first")
        self.ranges, size = ranges, sum(hi - lo for lo, hi in ranges)
        # the owned gradient, packed: the gradient buffer itself when it holds just that; under
        # ZeRO-1 a buffer of its own, which GradSync's reduce-scatters write
        self.grad_shard = self.grad if self.grad.numel() == size else torch.zeros(size, device=self.device)
        self.master = self.exp_avg = self.exp_avg_sq = None  # free any earlier state first
        self.packed_model = self.model_ranges == ranges
        if self.packed_model:
            self.master = self.model_flat if self.dtype == torch.float32 else self.model_flat.float()
        else:  # the owned ranges, packed and in fp32: one allocation, no full-length temporary
            self.master = torch.empty(size, dtype=torch.float32, device=self.device)
            pack(ranges, self.model_flat, self.master)
        self.exp_avg = torch.zeros(size, dtype=torch.float32, device=self.device)
        self.exp_avg_sq = torch.zeros_like(self.exp_avg)
        self.decay_segments = packed_overlaps(ranges, self.decay_ranges)  # where weight decay applies
        self.decay_rows = None  # the one-pass step's (compile()), made at its first step
        self._step = torch.zeros((), dtype=torch.float32, device=self.device)  # the fused kernel reads it

    def compile(self):
        """--compile: step() becomes one compiled pass (adamw_pass) where the eager step takes three
        (decay, fused update, refresh); under ZeRO-1, whose model copy is full-length, the refresh
        stays apart. The master weights and moments are the same within float error (the kernels
        round differently)."""
        self.one_pass = torch.ones(3, device=self.device), torch.ones((), device=self.device)  # per_step, 1

    def grad_norm(self) -> torch.Tensor:
        """L2 norm of the owned gradients (fp32 scalar tensor; parallel.py combines the ranks')."""
        return torch.linalg.vector_norm(self.grad_shard)

    @torch.no_grad()
    def step(self, lr: float | None = None, grad_scale: torch.Tensor | None = None):
        """One AdamW update of the owned master weights, then the model copy's owned ranges
        refreshed from them. First the decoupled decay (one foreach op), then torch's fused AdamW
        kernel in one pass over master, gradient, m and v; unfused, its m.lerp_(g, 1 - b1);
        v.mul_(b2).addcmul_(g, g, value=1 - b2); w.addcdiv_(m, sqrt(v / bc2) + eps, value=-lr / bc1)
        takes seven passes and a temporary as large as v. One tensor, not a list of segments, so its
        vector loop covers the same elements under ZeRO as without (VECTOR). It divides the
        gradients by grad_scale (clip_scale's) as it reads them: clipping takes no pass of its own.
        Four launches in all, the refresh included, however many parameters or ranges."""
        lr = self.lr if lr is None else lr
        self.step_count += 1
        if self.one_pass:
            return self._one_pass_step(lr, grad_scale)
        self._step.fill_(self.step_count)  # the bias corrections' step, on the device
        if self.weight_decay and self.decay_segments:  # decoupled: not through m or v
            torch._foreach_mul_([self.master[lo:hi] for lo, hi in self.decay_segments],
                                1 - lr * self.weight_decay)
        torch._fused_adamw_([self.master], [self.grad_shard], [self.exp_avg], [self.exp_avg_sq], [],
                            [self._step], lr=lr, beta1=self.betas[0], beta2=self.betas[1], weight_decay=0.0,
                            eps=self.eps, amsgrad=False, maximize=False, grad_scale=grad_scale)
        if self.packed_model and self.master is not self.model_flat:
            self.model_flat.copy_(self.master)  # both compact: round to bf16/fp16 once
        elif self.master is not self.model_flat:
            unpack(self.ranges, self.master, self.model_flat)  # round to bf16/fp16 once, for the next forward

    def _one_pass_step(self, lr: float, grad_scale: torch.Tensor | None):
        """compile()'s step. The per-step numbers are computed on the host, each written on the
        device by one fill; the buffers go in as rows of decay_rows' length."""
        (b1, b2), (per_step, one), t = self.betas, self.one_pass, self.step_count
        for i, value in enumerate((lr / (1 - b1 ** t), 1 - lr * self.weight_decay, math.sqrt(1 - b2 ** t))):
            per_step[i].fill_(value)  # (adamw_pass's order)
        if self.decay_rows is None:  # the first step since shard()
            self.decay_rows = decay_rows(self.master.numel(), self.decay_segments).to(self.device)
        rows = lambda t: t.view(self.decay_rows.shape[0], -1)
        refresh = self.packed_model and self.master is not self.model_flat  # the model copy in the pass
        compiled_adamw_pass()(rows(self.master), rows(self.grad_shard), rows(self.exp_avg),
                              rows(self.exp_avg_sq), rows(self.model_flat) if refresh else None,
                              self.decay_rows, per_step, one if grad_scale is None else grad_scale,
                              (b1, b2, self.eps))
        if not self.packed_model:
            unpack(self.ranges, self.master, self.model_flat)  # ZeRO-1: round to bf16/fp16 once

    # Checkpoints keep state per parameter name: independent of the flat layout, of how tensor and
    # pipeline parallelism cut the model, and of ZeRO (parallel.py gathers full buffers first).
    def full_state(self) -> dict[str, torch.Tensor]:
        """master, exp_avg, exp_avg_sq as full-length flat tensors (only when owning everything)."""
        if self.ranges != [(0, self.numel)]:
            raise RuntimeError("this optimizer owns a shard; gather the full state first (parallel.py)")
        return {"master": self.master, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}

    def state_dict(self, full: dict[str, torch.Tensor] | None = None) -> dict:
        full = full or self.full_state()
        per_param = {}
        for i, name in enumerate(self.names):
            sl = slice(self.offsets[i], self.offsets[i] + self.params[i].numel())
            per_param[name] = {k: v[sl].view(self.params[i].shape) for k, v in full.items()}
        return {"step": self.step_count, "params": per_param}

    @torch.no_grad()
    def load_state_dict(self, state: dict):
        """Per-parameter state (any device) -> the owned ranges, one parameter at a time: no
        full-length buffer, so a ZeRO-1 rank never holds more than its shard and one parameter's."""
        missing = set(self.names) - set(state["params"])
        if missing:
            raise ValueError(f"optimizer state lacks {sorted(missing)[:4]}")
        self.step_count = int(state["step"])
        for i, name in enumerate(self.names):
            lo, n = self.offsets[i], self.params[i].numel()
            entry = state["params"][name]  # looked up once: it may be assembled from disk on demand
            for key in ("master", "exp_avg", "exp_avg_sq"):
                t = entry[key]
                if t.numel() != n:
                    raise ValueError(f"optimizer state for {name} has shape {tuple(t.shape)}, "
                                     f"the model has {tuple(self.params[i].shape)}")
                load_range(self.ranges, getattr(self, key), lo, t.reshape(-1))
            # every parameter the model copy holds, owned or not (rounded to the training dtype)
            load_range(self.model_ranges, self.model_flat, lo, entry["master"].reshape(-1))


class LossScaler:
    """Dynamic loss scaling for fp16 (Micikevicius et al. 2018): the loss times `scale` keeps small
    gradients representable; an overflow skips the step and halves the scale, `growth_interval`
    clean steps double it. bf16 has fp32's exponent range and needs none of this."""

    def __init__(self, init_scale: float = 2.0 ** 16, growth_interval: int = 1000):
        self.scale, self.growth_interval, self.good_steps = init_scale, growth_interval, 0

    def unscale(self, opt: AdamW):
        """Divide the gradients by the scale (no sync: train.py's step tally reads the overflow)."""
        opt.grad_shard.mul_(1.0 / self.scale)

    def update(self, finite: bool) -> bool:
        """After unscale(), with `finite` true if every rank's gradients are (one overflow anywhere
        skips the step everywhere): adjusts the scale and returns finite."""
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
