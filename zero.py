"""Data parallelism: the same model on every replica, each on its share of the global batch,
gradients summed before the update; and ZeRO (Rajbhandari et al. 2020), which shards what replicas
would otherwise each hold whole. Phase 5 of train.py's step, and the global norm phase 6 clips by.

  1. Buckets            optim.FlatParams' fp32 gradient buffer cut into buckets of about --bucket-mb
                        in reverse model order: they fill front first during backward
  2. GradSync           plain data parallelism: each bucket all-reduced (SUM) over dp as soon as its
                        last gradient lands, asynchronously, while backward computes earlier layers
  3. The gradient norm  the true global norm, TP-replicated parameters counted once, shards summed
  4. ZeRO-1             buckets reduce-scattered instead: each rank keeps and updates 1/dp of the
                        optimizer state, then all-gathers the updated weights, a unit at a time
  5. ZeRO-2             gradients sharded too: each micro-batch's buckets staged, reduce-scattered
  6. ZeRO-3             weights sharded too (what FSDP calls full sharding): each unit gathered just
                        before its forward and its backward, released after (ShardedWeights)

Under context parallelism "dp" means dp x cp, every rank holding the same pieces of the weights
(parallel.Mesh.grad_dim). Every collective is parallel.py's, which counts its bytes.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn as nn

import model as M
import parallel as P


# ----------------------------------------------------------------------------------------------------
# 1-3. Buckets, the plain all-reduce, the global gradient norm


def buckets_of(numel: int, dp: int, bucket_mb: float) -> list[tuple[int, int]]:
    """[lo, hi) spans of about bucket_mb of fp32 each, multiples of dp; a small first bucket (1 MB,
    as DDP's) starts communication as early as possible."""
    buckets, lo = [], 0
    size = lambda mb: max(dp, int(mb * 2 ** 20 / 4) // dp * dp)
    while lo < numel:
        hi = min(lo + size(min(1.0, bucket_mb) if not buckets else bucket_mb), numel)
        buckets.append((lo, hi))
        lo = hi
    return buckets


def bucket_map(opt, buckets: list[tuple[int, int]]) -> tuple[list[list[int]], list[int]]:
    """For each parameter of the optimizer the buckets its flat span overlaps, and for each bucket how many
    parameters overlap it: the gradients it waits for."""
    param_buckets, expected = [], [0] * len(buckets)
    for i, p in enumerate(opt.params):
        lo, hi = opt.offsets[i], opt.offsets[i] + p.numel()
        param_buckets.append([b for b, (blo, bhi) in enumerate(buckets) if blo < hi and lo < bhi])
        for b in param_buckets[-1]:
            expected[b] += 1
    return param_buckets, expected


class GradSync:
    """Phase 5 without ZeRO (a single replica sends nothing): each bucket is all-reduced over dp
    (SUM: the loss is already divided by the global target count, so the sum is the mean gradient).
    In the last micro-batch's backward (after start()), each parameter's post-accumulate hook counts
    down its buckets, and a complete bucket is reduced at once. finish() waits. The ZeRO subclasses
    change what a bucket's reduction does. Under context parallelism a replica's cp ranks see
    different tokens of the same sequences; their partial-sum gradients add up like the replicas'
    (ZeRO shards over dp x cp, as Megatron-LM does).

    Nothing waits for a collective before its result is needed. Every rank launches the same buckets
    in the same order: a bucket completes when its last parameter's gradient is accumulated, the
    same parameter on every rank, so the model, not timing, fixes the order (tests/test_parallel.py
    records the order and the overlap)."""
    sharded = False  # ZeRO: the optimizer reads only its pieces of the gradient, packed (grad_of)
    weights = None  # ZeRO-3's unit weights, gathered when used

    @property
    def checks_copies(self) -> bool:
        """Whether a rank's copy of the reduced gradients must be checked: under plain data parallelism
        each rank applies all of them, not only those whose squares it summed for the norm, so a copy
        gone bad on one rank must stop every replica (they must never differ). ZeRO ranks apply only
        their own pieces; a single replica has no others."""
        return not self.sharded and self.mesh.dp_cp > 1

    def __init__(self, opt, mesh: P.Mesh, bucket_mb: float = 25.0, partial_tp: list[int] = ()):
        self.opt, self.mesh = opt, mesh
        self.dim = mesh.grad_dim  # dp, or dp x cp: the ranks whose gradients are summed
        self.partial_tp = list(partial_tp)  # params whose gradient is a partial sum over tp (SP norms)
        dp = mesh.dp_cp
        if opt.numel % dp:
            raise ValueError(f"the optimizer's flat buffer ({opt.numel}) must be padded to a multiple of dp "
                             f"{dp}")
        self.buckets = self.make_buckets(bucket_mb)
        self.bucket_dims = [self.dim if lo < self.experts_from else "edp" for lo, _ in self.buckets]
        self.param_buckets, self.expected = bucket_map(opt, self.buckets)
        self.enabled, self.handles, self.pending = False, {}, list(self.expected)
        # this dp rank's piece of every bucket: its shard under ZeRO, its share of the gradient norm always
        # (an experts' bucket: this rank's piece among the edp ranks holding the same experts)
        place = {self.dim: (dp, mesh.dp_cp_rank), "edp": (mesh.edp, mesh.edp_rank)}
        piece = lambda lo, hi, n, r: (lo + r * (hi - lo) // n, lo + (r + 1) * (hi - lo) // n)
        self.norm_ranges = [(0, opt.numel)] if dp == 1 else \
            [piece(lo, hi, *place[d]) for (lo, hi), d in zip(self.buckets, self.bucket_dims)]
        self.bucket_sizes = [place[d][0] for d in self.bucket_dims]  # how many ranks share each bucket
        self.piece_starts = [sum((hi - lo) // n for (lo, hi), n in zip(self.buckets[:b], self.bucket_sizes))
                             for b in range(len(self.buckets))]
        self.own()
        opt.call_on_grad_ready(self._on_grad_ready)

    @property
    def experts_from(self) -> int:
        """Where the experts' region of the flat buffer begins (laid_out; the end without ep)."""
        starts = [off for off, name in zip(self.opt.offsets, self.opt.names) if P.is_expert(name)]
        return min(starts) if self.mesh.ep > 1 and starts else self.opt.numel

    def make_buckets(self, bucket_mb: float) -> list[tuple[int, int]]:
        """Buckets of the flat buffer; the experts' region (under ep) in buckets of its own."""
        start, dp = self.experts_from, self.mesh.dp_cp
        return buckets_of(start, dp, bucket_mb) + [(start + lo, start + hi) for lo, hi in
                                                   buckets_of(self.opt.numel - start, dp, bucket_mb)]

    def own(self):
        """Without ZeRO the optimizer keeps state for the whole flat buffer (built with
        allocate_state=False, it has none yet)."""
        if self.opt.ranges is None:
            self.opt.shard([(0, self.opt.numel)])

    def start(self):
        """Call before the backward of the last micro-batch: only then are gradients complete."""
        self.enabled = self.mesh.dp_cp > 1
        self.pending = list(self.expected)

    def _on_grad_ready(self, i: int):
        if not self.enabled:
            return  # an accumulation micro-step: nothing is sent
        for b in self.param_buckets[i]:
            self.pending[b] -= 1
            if self.pending[b] == 0:
                self._launch(b)

    def _launch(self, b: int):
        lo, hi = self.buckets[b]  # (None: an experts' bucket on a single holder of its experts, edp 1)
        self.handles[b] = P.all_reduce(self.opt.grad[lo:hi], self.mesh, self.bucket_dims[b], async_op=True)

    def finish(self):
        """Wait for every bucket (launching, in bucket order, any whose parameters got no gradient),
        then sum the SP-partial gradients over tp. (First, any all-gather of the last step's weights
        that no forward waited for: the coming step rewrites what it reads.)"""
        self.wait_params()
        self.reduce_all()
        if self.partial_tp and self.mesh.tp > 1:
            sum_over_tp(self.partial_grads(), self.mesh)

    def reduce_all(self):
        if self.enabled:
            for b in range(len(self.buckets)):
                if b not in self.handles:
                    self._launch(b)
            for b in sorted(self.handles):
                if self.handles[b] is not None:
                    self.handles[b].wait()
            self.handles, self.enabled = {}, False

    def partial_grads(self) -> list[torch.Tensor]:
        """The SP-partial gradients to sum over tp: whole, as every replica applies all the gradients."""
        return [self.opt.grad_view(i) for i in self.partial_tp]

    def parts_in_pieces(self, params: list[int]) -> list[torch.Tensor]:
        """The gradients of these parameters (indices into opt.params) where they lie in this rank's pieces
        (norm_ranges): the parts the optimizer reads under ZeRO, this rank's share of the norm always."""
        parts = []
        for i in params:
            lo, hi = self.opt.offsets[i], self.opt.offsets[i] + self.opt.params[i].numel()
            parts += [self.grad_of(max(lo, rlo), min(hi, rhi)) for rlo, rhi in self.norm_ranges
                      if max(lo, rlo) < min(hi, rhi)]
        return parts

    def grad_of(self, lo: int, hi: int) -> torch.Tensor:
        """The gradient the optimizer reads at flat positions [lo, hi)."""
        return self.opt.grad[lo:hi]

    def all_gather_params(self):
        """Nothing to gather: every replica updated every weight itself."""

    def wait_params(self, buckets=None):
        """Nothing in flight (ZeRO1Sync's all-gathers)."""

    def prefetch_into(self, model):
        """Nothing to wait for at a unit's forward (ZeRO1Sync's)."""

    def gather_optimizer_state(self) -> dict[str, torch.Tensor] | None:
        """Full-length master / moment buffers for a checkpoint: every replica holds them."""
        return self.opt.full_state()


def sum_over_tp(grads: list[torch.Tensor], mesh: P.Mesh):
    """Sum these gradients over tp in one all-reduce (flattened together, then copied back), not one each:
    SP makes two norm weights a layer partial."""
    flat = torch.cat([g.reshape(-1) for g in grads])
    P.all_reduce(flat, mesh, "tp")
    torch._foreach_copy_(grads, [t.view_as(g) for t, g in zip(flat.split([g.numel() for g in grads]), grads)])


def grad_sq(sync: GradSync, model) -> torch.Tensor:
    """This rank's part of the sum of squares of the *whole* model's gradient: summed over all ranks
    (one all-reduce, or train.py's step tally) it is the global norm squared. Each dp rank sums its
    ZeRO-1 pieces of the buckets, with or without ZeRO, splitting the work over dp, so plain DP and
    ZeRO-1 add the same numbers in the same order: bitwise identical updates. Shards count on the tp
    and pp ranks holding them; tp-replicated parameters (norm weights) on tp rank 0 only."""
    opt, mesh, replicated = sync.opt, sync.mesh, []
    if mesh.tp > 1 and mesh.tp_rank > 0:
        placement = model.tp_placement
        replicated = sync.parts_in_pieces([i for i, name in enumerate(opt.names) if name not in placement])
    # one foreach norm over every piece, however many buckets: each piece's norm, squared, summed
    pieces = [sync.grad_of(lo, hi) for lo, hi in sync.norm_ranges]
    sq = torch.stack(torch._foreach_norm(pieces + replicated)).square()
    return sq[:len(pieces)].sum() - sq[len(pieces):].sum()


def grad_norm(sync: GradSync, model) -> torch.Tensor:
    """The global gradient norm, identical on all ranks."""
    sq = grad_sq(sync, model)
    P.all_reduce(sq, sync.mesh, "world")
    return sq.sqrt()


# ----------------------------------------------------------------------------------------------------
# 4-6. ZeRO: the optimizer state (1), the gradients (2) and the weights (3) sharded over dp


def unit_of(name: str) -> str:
    """The unit a parameter belongs to: "layers.3.attention.wq.weight" -> "layers.3", "norm.weight" ->
    "norm". ZeRO's weights travel a unit at a time, as each unit's forward needs them."""
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "layers" else parts[0]


def unit_modules(model: M.Transformer) -> list[tuple[str, list[nn.Module]]]:
    """This stage's units in forward order, each with the modules that run it: a block compiled by
    --compile runs as its compiled wrapper in training and as itself in evaluation and generation."""
    compiled = model.compiled_blocks
    out = [("tok_embeddings", [model.tok_embeddings])]
    out += [(f"layers.{k}", [block] + ([compiled[k]] if k in compiled else [])) for k, block in
            model.layers.items()]
    out += [("norm", [model.norm]), ("output", [model.output])]
    return [(name, modules) for name, modules in out if modules[0] is not None]


def hook_unit(modules: list[nn.Module], before=None, after=None):
    """before() as each module's forward starts, after(output) as it ends. Hooks on a compiled
    wrapper run outside the compiled code; the block's own hooks, traced inside it, do nothing (the
    wrapper's did it). Both must be idempotent: a block that falls back to eager runs both."""
    for module in modules:
        if before is not None:
            module.register_forward_pre_hook(
                lambda m, args: None if torch.compiler.is_compiling() else before())
        if after is not None:
            module.register_forward_hook(
                lambda m, args, out: None if torch.compiler.is_compiling() else after(out))


class ZeRO1Sync(GradSync):
    """ZeRO-1: buckets are reduce-scattered instead. dp rank r gets the summed r-th piece of every
    bucket (all pieces the same size, as bucket lengths are multiples of dp) straight into its
    optimizer's packed gradient (opt.grad_shard), keeps optimizer state for those pieces only and
    updates them into the model copy's owned ranges. all_gather_params() then gathers every rank's
    pieces into every rank's weights, one launch per unit (on NCCL), each waited for as that unit's
    forward starts (prefetch_into): later layers' weights arrive while earlier ones compute."""
    sharded = True

    def own(self):
        self.opt.shard(self.norm_ranges)
        self.plan_gathers()

    def plan_gathers(self):
        """The all-gathers of the updated weights: one per unit, in forward order (unit_buckets)."""
        self.gathers, self.gather_groups = {}, self.unit_buckets()
        self.group_of = {b: g for g, bs in enumerate(self.gather_groups) for b in bs}

    def unit_buckets(self) -> list[list[int]]:
        """The buckets each unit's forward needs (unit_of), units in forward order, a bucket shared by two
        units listed under the first."""
        per_unit = {}  # in the flat buffer's order: reverse model order
        for i, name in enumerate(self.opt.names):  # (under ep a unit's experts apart: other buckets, group)
            per_unit.setdefault((unit_of(name), P.is_expert(name)), set()).update(self.param_buckets[i])
        groups, seen = [], set()
        for unit in reversed(list(per_unit)):
            if per_unit[unit] - seen:
                groups.append(sorted(per_unit[unit] - seen, reverse=True))
                seen |= per_unit[unit]
        return groups

    def _launch(self, b: int):
        (lo, hi), n = self.buckets[b], self.bucket_sizes[b]
        piece = self.opt.grad_shard[self.piece_starts[b]:self.piece_starts[b] + (hi - lo) // n]
        if n == 1:  # an experts' bucket whose experts no other rank holds (edp 1): all of it is this rank's
            piece.copy_(self.opt.grad[lo:hi])
            self.handles[b] = None
        else:
            self.handles[b] = P.reduce_scatter(piece, self.opt.grad[lo:hi], self.mesh, self.bucket_dims[b],
                                               async_op=True)

    def partial_grads(self) -> list[torch.Tensor]:
        return self.parts_in_pieces(self.partial_tp)  # the parts this rank applies

    def grad_of(self, lo: int, hi: int) -> torch.Tensor:
        """The gradient the optimizer reads at flat positions [lo, hi), in the packed pieces it owns
        (opt.grad_shard), where [lo, hi) must lie inside one of them (norm_ranges)."""
        for b, (rlo, rhi) in enumerate(self.norm_ranges):
            if rlo <= lo and hi <= rhi:
                return self.opt.grad_shard[self.piece_starts[b] + lo - rlo:self.piece_starts[b] + hi - rlo]
        raise ValueError(f"flat positions [{lo}, {hi}) are not in one of this rank's pieces")

    def all_gather_params(self):
        """After the optimizer step, every rank's updated pieces -> every rank's weights, in place
        (each piece already lies where NCCL's in-place all-gather wants it), one launch per unit on NCCL
        (all_gather_many; one per bucket on gloo), launched without waiting, the first layers first."""
        flat = self.opt.model_flat
        for g, group in enumerate(self.gather_groups):
            spans, dim = [self.buckets[b] for b in group], self.bucket_dims[group[0]]  # (one dim a group)
            n, r = (self.mesh.dp_cp, self.mesh.dp_cp_rank) if dim != "edp" else (self.mesh.edp, self.mesh.edp_rank)
            if n > 1:
                pieces = [flat[lo + r * (hi - lo) // n:lo + (r + 1) * (hi - lo) // n] for lo, hi in spans]
                self.gathers[g] = P.all_gather_many([flat[lo:hi] for lo, hi in spans], pieces, self.mesh, dim)

    def wait_params(self, buckets=None):
        """Wait for the all-gathers of these buckets (default: all): their weights are then current."""
        groups = self.gathers if buckets is None else {self.group_of[b] for b in buckets if b in self.group_of}
        for g in sorted(groups):
            if g in self.gathers:
                self.gathers.pop(g).wait()

    def prefetch_into(self, model):
        """Make each unit wait, as its forward starts (hook_unit), for the buckets its parameters
        lie in. (Frozen weights, LoRA's, are in no bucket.)"""
        for unit, modules in unit_modules(model):
            buckets = sorted({b for p in modules[0].parameters() if p.requires_grad
                              for b in self.param_buckets[self.opt.index_of(p)]})
            hook_unit(modules, before=lambda buckets=buckets: self.wait_params(buckets))

    def gather_optimizer_state(self) -> dict[str, torch.Tensor] | None:
        """Full-length master / moment buffers for a checkpoint, on dp rank 0 (None elsewhere),
        assembled a bucket at a time in host memory through a bucket-sized device buffer, so no
        device ever holds the unsharded state ZeRO exists to avoid."""
        keep = self.mesh.dp_cp_rank < self.mesh.ep  # (the writers: checkpoint.shard_contents)
        keys = ("master", "exp_avg", "exp_avg_sq")
        out = {key: torch.empty(self.opt.numel) for key in keys} if keep else None
        buf = torch.empty(max(hi - lo for lo, hi in self.buckets), device=self.opt.grad.device)
        c = 0  # where this bucket's piece starts in the compact (owned-only) buffers
        for (lo, hi), n, dim in zip(self.buckets, self.bucket_sizes, self.bucket_dims):
            piece = (hi - lo) // n
            for key in keys:
                mine = getattr(self.opt, key)[c:c + piece]
                if n > 1:
                    P.all_gather(buf[:hi - lo], mine, self.mesh, dim)
                if keep:
                    out[key][lo:hi].copy_(buf[:hi - lo] if n > 1 else mine)
            c += piece
        return out


class ZeRO2Sync(ZeRO1Sync):
    """ZeRO-2 shards the gradients too: with only this rank's pieces of the fp32 gradient buffer,
    there is nowhere to accumulate whole gradients over micro-batches. Instead, every micro-batch,
    each parameter's fresh gradient goes into its bucket's staging buffer; a full bucket is
    reduce-scattered at once and its summed piece added into this rank's shard (_land). Memory: 1/dp
    of the gradients plus a few buckets in flight; traffic: a reduce-scatter per micro-batch."""

    def own(self):
        self.opt.shard_grads(self.norm_ranges)
        self.opt.shard(self.norm_ranges)
        self.staging, self.in_flight = {}, []  # buckets filling; reduce-scatters not waited for yet
        self.plan_gathers()

    def start(self):
        """Nothing to enable: every micro-batch's gradients are reduced as they come."""

    def _on_grad_ready(self, i: int):
        """Stage parameter i's fresh gradient in each bucket it lies in (staging buffers are made on
        first need); a bucket whose gradients are all in is reduce-scattered at once."""
        p, lo = self.opt.params[i], self.opt.offsets[i]
        g = p.grad.reshape(-1)
        p.grad = None  # its values now live in the staging buffers
        for b in self.param_buckets[i]:
            blo, bhi = self.buckets[b]
            a, c = max(lo, blo), min(lo + g.numel(), bhi)
            if b not in self.staging:
                self.staging[b] = torch.zeros(bhi - blo, device=g.device)
            self.staging[b][a - blo:c - blo] += g[a - lo:c - lo]
            self.pending[b] -= 1
            if self.pending[b] == 0:
                self._launch(b)

    def _launch(self, b: int):
        """Reduce-scatter a staged bucket, first landing the oldest while two are in flight, so
        staging never holds more than a few buckets."""
        lo, hi = self.buckets[b]
        self.pending[b] = self.expected[b]  # the next micro-batch counts afresh
        while len(self.in_flight) >= 2:
            self._land()
        staged = self.staging.pop(b)
        piece = staged.new_empty((hi - lo) // self.mesh.dp_cp)
        handle = P.reduce_scatter(piece, staged, self.mesh, self.dim, async_op=True)
        self.in_flight.append((b, handle, piece, staged))  # staged: alive until the op is done

    def _land(self):
        """Wait for the oldest reduce-scatter in flight; add its summed piece into this rank's shard."""
        b, handle, piece, _ = self.in_flight.pop(0)
        handle.wait()
        self.opt.grad[self.piece_starts[b]:self.piece_starts[b] + piece.numel()] += piece

    def reduce_all(self):
        """Buckets some of whose parameters got no gradient, then every one still in flight."""
        for b in sorted(self.staging):
            self._launch(b)
        while self.in_flight:
            self._land()
        self.pending = list(self.expected)


class ZeRO3Sync(ZeRO2Sync):
    """ZeRO-3 shards the weights too (ShardedWeights): each bucket is one unit (the embedding, a
    block, the final norm, the head: AdamW's unit_of layout), gathered whole just before its forward
    and its backward and released after; its gradients are staged and reduce-scattered as
    ZeRO-2's."""

    def make_buckets(self, bucket_mb: float) -> list[tuple[int, int]]:
        if not self.opt.units or self.opt.units[-1][1] != self.opt.numel:
            raise ValueError("ZeRO-3 needs an optimizer whose parameters are laid out by unit "
                             "(AdamW(..., unit_of=zero.unit_of))")
        return list(self.opt.units)

    def own(self):  # the parameters move into unit buffers before the model copy is sharded
        self.weights = ShardedWeights(self.opt, self.mesh, self.buckets, self.piece_starts)
        self.opt.shard_grads(self.norm_ranges)
        self.opt.shard_weights(self.norm_ranges)
        self.opt.shard(self.norm_ranges)
        self.weights.free_all()
        self.staging, self.in_flight = {}, []
        self.gathers, self.gather_groups, self.group_of = {}, [], {}  # (each unit gathers for itself)

    def _launch(self, b: int):
        super()._launch(b)
        self.weights.after_backward(b)  # its backward is done with the unit's weights

    def reduce_all(self):
        super().reduce_all()
        self.weights.free_all()

    def all_gather_params(self):
        """Nothing here: each unit gathers its weights when its forward starts."""

    def prefetch_into(self, model):
        self.weights.attach(model)


class ShardedWeights:
    """ZeRO-3 (what FSDP calls full sharding): no rank keeps whole weights between uses. Each unit's
    buffer holds its weights, in the training dtype, only while they are used: its storage is
    allocated and filled by an all-gather of every dp_cp rank's piece (the optimizer's compact model
    copy) just before the unit's forward and again just before its backward, and released right
    after the forward and once the backward's last gradient is in. The parameters are views into
    these buffers, keeping their names and shapes; only the storage comes and goes (resize_ keeps
    the storage object, so tensors autograd saved in forward see the regathered values in backward).

    Prefetch: a unit's forward starts gathering the next unit, its backward the one before, so the
    transfer overlaps this unit's compute; two units are whole at once (three with a tied head: the
    embedding's weights stay whole from the head's backward to the embedding's). Activation
    checkpointing reruns a block's forward inside its backward: finding the unit marked as in its
    backward, that forward neither prefetches nor releases anything."""

    def __init__(self, opt, mesh: P.Mesh, spans: list[tuple[int, int]], piece_starts: list[int]):
        self.opt, self.mesh, self.dim, self.spans = opt, mesh, mesh.grad_dim, spans
        # where this rank's piece of each unit is in the optimizer's compact model copy, and its length
        self.pieces = [(start, (hi - lo) // mesh.dp_cp) for start, (lo, hi) in zip(piece_starts, spans)]
        self.bufs = []  # (unit numel,) each
        for b, (lo, hi) in enumerate(spans):  # one unit's storage at a time, released at once: the values
            self.bufs.append(torch.empty(hi - lo, dtype=opt.dtype, device=opt.device))  # are the optimizer's
            for i, p in enumerate(opt.params):
                if lo <= opt.offsets[i] < hi:  # a view: its own version counter (see above)
                    p.data = self.bufs[b][opt.offsets[i] - lo:opt.offsets[i] - lo + p.numel()].view_as(p)
            self.bufs[b].untyped_storage().resize_(0)
        self.held, self.gathers, self.in_backward = set(), {}, set()

    def fetch(self, b: int):
        """Start gathering unit b's weights, unless they are held already (or on their way)."""
        if b in self.held:
            return
        buf, (start, n) = self.bufs[b], self.pieces[b]
        buf.untyped_storage().resize_(buf.numel() * buf.element_size())
        self.gathers[b] = P.all_gather(buf, self.opt.model_flat[start:start + n], self.mesh, self.dim,
                                     async_op=True)
        self.held.add(b)

    def ready(self, b: int):
        self.fetch(b)
        if b in self.gathers:
            self.gathers.pop(b).wait()

    def free(self, b: int):
        if b in self.gathers:  # never release storage a collective is still writing into
            self.gathers.pop(b).wait()
        self.bufs[b].untyped_storage().resize_(0)
        self.held.discard(b)

    def free_all(self):
        for b in sorted(self.held):
            self.free(b)
        self.in_backward.clear()

    def after_backward(self, b: int):
        self.in_backward.discard(b)
        self.free(b)

    def attach(self, model: M.Transformer):
        """Hooks on each unit's module. `nxt` is the unit whose forward comes next, `prev` the one before
        (whose backward comes next); units shared by two modules (a tied head) appear under both."""
        modules = [ms for _, ms in unit_modules(model)]
        units = [self.unit_of_param(next(ms[0].parameters())) for ms in modules]
        for k, b in enumerate(units):
            nxt = units[k + 1] if k + 1 < len(units) else None
            prev = units[k - 1] if k > 0 else None
            hook_unit(modules[k], before=lambda b=b, nxt=nxt: self.before_forward(b, nxt),
                      after=lambda out, b=b, prev=prev: self.after_forward(b, prev, out))

    def unit_of_param(self, p) -> int:
        lo = self.opt.offsets[self.opt.index_of(p)]
        return next(b for b, (ulo, uhi) in enumerate(self.spans) if ulo <= lo < uhi)

    def before_forward(self, b: int, nxt):
        recompute = b in self.in_backward  # activation checkpointing, inside b's backward
        self.ready(b)
        if nxt is not None and not recompute:
            self.fetch(nxt)

    def after_forward(self, b: int, prev, out: torch.Tensor):
        if b in self.in_backward:
            return
        self.free(b)
        if torch.is_grad_enabled() and out.requires_grad:  # runs as out's gradient arrives: b's backward next
            out.register_hook(lambda grad: self.before_backward(b, prev))

    def before_backward(self, b: int, prev):
        self.in_backward.add(b)
        self.ready(b)
        if prev is not None:
            self.fetch(prev)


class BuildNeeds(NamedTuple):
    """What a ZeRO stage asks of the model's build and of its optimizer's buffers (needs)."""
    lazy: bool  # each rank builds its own pieces only: the model is never whole on one rank (ZeRO-3)
    full_grad: bool  # a full-length fp32 gradient buffer (ZeRO-2 and 3 keep pieces of it)
    unit_of: object  # name -> unit, where weights move a unit at a time (ZeRO-3), else None


def needs(zero: int, replicas: int, ep: int = 1) -> BuildNeeds:
    """The build of ZeRO stage `zero` over `replicas` (dp x cp) ranks; a single replica shards nothing.
    Under expert parallelism the experts are a unit of their own (laid_out puts them last)."""
    return BuildNeeds(lazy=zero == 3 and replicas > 1, full_grad=zero < 2 or replicas == 1,
                      unit_of=unit_of if zero == 3 else region_of if ep > 1 else None)


def region_of(name: str) -> str:
    """Under ep, the flat buffer's two regions: the experts', whose gradients sum over the edp ranks
    holding the same experts, and the rest's, over all of dp."""
    return "experts" if P.is_expert(name) else "dense"


def laid_out(named: list, mesh: P.Mesh) -> list:
    """The trained parameters in the order the optimizer takes them: under ep, the experts first, so that
    after optim.FlatParams' reversal (gradients come output first) they are the buffer's last region."""
    return sorted(named, key=lambda item: not P.is_expert(item[0])) if mesh.ep > 1 else named


def grad_sync(opt, mesh: P.Mesh, bucket_mb: float = 25.0, zero: int = 0, partial_tp: list[int] = ()) -> GradSync:
    """Phase 5 for ZeRO stage `zero`: plain all-reduce without ZeRO, or over a single replica (which sends
    nothing and keeps everything), else ZeRO1Sync, ZeRO2Sync or ZeRO3Sync."""
    if zero == 0 or mesh.dp_cp == 1:
        return GradSync(opt, mesh, bucket_mb, partial_tp)
    return (ZeRO1Sync, ZeRO2Sync, ZeRO3Sync)[zero - 1](opt, mesh, bucket_mb, partial_tp)
