"""Tensor, context and pipeline parallelism written by hand on raw torch.distributed collectives.

No DDP, FSDP, DTensor or torch's pipelining package: every byte that crosses a process boundary is
sent by a function in this file, and counted. Contents, in reading order:

  1. Layout and mesh       world = dp x pp x cp x tp, TP innermost (one NVLink domain), then CP, PP, DP;
                           the layout one value; each rank makes the process groups it is in
  2. Collectives           all_reduce / all_gather / reduce_scatter that count the bytes each rank sends, per
                           dimension (ring algorithm accounting); the same as custom ops for compiled code
  3. TP communication      Megatron's conjugate pair f (identity forward, all-reduce backward) and g (the
                           reverse), and the sequence-parallel pair gather/scatter (Shoeybi et al. 2019,
                           "Megatron-LM"; Korthikanti et al. 2022, "Reducing Activation Recomputation")
  4. TP layers             column-parallel and row-parallel linears, vocab-parallel embedding (the head is
                           column-parallel: loss.py's cross-entropy takes its vocab-sharded logits);
                           apply_tensor_parallel() swaps them into a built Transformer
  5. Context parallelism   each sequence cut into 2cp chunks, two per rank (balanced causal work); K and V
                           all-gathered over cp per layer, as Llama 3 trained (Dubey et al. 2024); the
                           model's attention inputs swapped for this rank's positions
  5b. Expert parallelism   a mixture's experts cut over ep of the dp ranks; tokens to their experts and
                           back by all-to-all
  6. Pipeline              contiguous layer ranges per stage (or model chunks); schedules AFAB
                           (GPipe, Huang et al. 2019), 1F1B (PipeDream-Flush, Narayanan et al. 2021) and
                           interleaved 1F1B over model chunks (Narayanan et al. 2021)
  7. For all              work one rank does for the others: filling a cache first, gathering small objects
  8. Building              materialize() gives a model built on the meta device, sharded and cut, storage
                           for this rank's pieces only

model.py knows nothing of this: apply_tensor_parallel, apply_context_parallel and apply_pipeline
change a model built on the meta device, and materialize() fills each rank's pieces from one seed
(each parameter from its own generator), so every layout starts from bit-identical weights. Data
parallelism and ZeRO are zero.py's; joining the job, timeouts and failures launch.py's; checkpoints
(each rank's shards under global names, loadable into any layout) checkpoint.py's.
"""

from __future__ import annotations

import datetime
import functools
import itertools
import os
import time
import weakref
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import _get_current_dispatch_mode

import launch
import model as M


# ----------------------------------------------------------------------------------------------------
# 1. Layout and mesh

# Every live Mesh by its key: the collectives in compiled blocks are torch custom ops (section 3),
# and a custom op takes tensors, numbers and strings, not objects: it is handed the mesh's key.
MESHES: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_mesh_keys = itertools.count()


@dataclass(frozen=True)
class Layout:
    """A job's parallel layout, one value: how many ranks each dimension spans (world = dp x pp x cp x
    tp) and how they are used: sequence parallelism in the tp group, the ZeRO stage over dp x cp, the
    pipeline's schedule, its model chunks per rank (virtual) and its layers per chunk (split, None:
    as even as they go). Built once from the flags (config.layout_of), held by the mesh, and passed
    whole to the checks, the estimates, the planner, the banner and the checkpoint's record; a new
    dimension is a field here."""
    tp: int = 1
    cp: int = 1  # context parallelism: each sequence cut along its length over cp ranks
    pp: int = 1
    dp: int = 1
    sp: bool = False  # (only with tp > 1: the tp group's ranks hold parts of the sequence)
    zero: int = 0
    schedule: str = "1f1b"
    virtual: int = 1
    split: tuple | None = None
    ep: int = 1  # expert parallelism: each mixture layer's experts cut over ep of the dp ranks

    @property
    def edp(self) -> int:
        """How many dp ranks hold the same experts (expert weights' replicas): dp / ep."""
        return self.dp // self.ep if self.ep else 0

    def __post_init__(self):  # one spelling of each layout: sp only where tp cuts, split a tuple
        object.__setattr__(self, "sp", self.sp and self.tp > 1)
        object.__setattr__(self, "split", tuple(self.split) if self.split else None)

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def dp_cp(self) -> int:
        """How many ranks hold the same pieces of the weights: the dp replicas, each cut into cp ranks that
        see different tokens. Gradients are summed over all of them; ZeRO shards over all of them."""
        return self.dp * self.cp

    def record(self) -> dict:
        """The layout as a checkpoint's meta.json and a step's trace record it."""
        return {"tp": self.tp, "cp": self.cp, "pp": self.pp, "dp": self.dp, "sp": self.sp, "zero": self.zero,
                "schedule": self.schedule, "virtual": self.virtual, "split": list(self.split or []) or None,
                "ep": self.ep}

    def __str__(self):
        ep = f" (ep {self.ep})" if self.ep > 1 else ""
        return f"{self.world} processes = dp {self.dp}{ep} x pp {self.pp} x cp {self.cp} x tp {self.tp}"

    def describe(self) -> str:
        """The banner's line: the sizes, then how they are used where it matters."""
        pipeline = f", {self.schedule} schedule" if self.pp > 1 else ""
        pipeline += f" over {self.virtual} model chunks per rank" if self.pp > 1 and self.virtual > 1 else ""
        return (str(self) + pipeline + (", sequence parallel" if self.sp else "")
                + (f", ZeRO-{self.zero}" if self.zero and self.dp_cp > 1 else ""))


@dataclass
class Mesh:
    layout: Layout = Layout()
    rank: int = 0
    tp_rank: int = 0
    pp_rank: int = 0
    dp_rank: int = 0
    cp_rank: int = 0
    # "tp" / "cp" / "pp" / "dp" / "dp_cp" (under cp only: see dp_cp) -> ProcessGroup, if size > 1
    groups: dict = field(default_factory=dict)
    pp_peers: list = field(default_factory=list)  # global ranks of my pipeline, stage order
    # "tp" / "cp" / "pp" / "dp" / "dp_cp" / "world" -> global ranks, for messages
    group_ranks: dict = field(default_factory=dict)
    timeout_s: float = 300.0  # how long any collective may wait for its peers
    # ... and the "io" group's waits for one rank's disk work (data, checkpoints)
    io_timeout_s: float = 3600.0
    patient: bool = False  # every group waits io_timeout_s for now (the first step: see patient())
    device: torch.device = torch.device("cpu")  # for a collective's small flags (NCCL: the GPU)
    # bytes sent, per dimension ("dp": the gradients' reduction over dp_cp); "world": the step's tally
    # (train.py), a few numbers over every rank at once
    comm_bytes: dict = field(default_factory=lambda: {"tp": 0.0, "cp": 0.0, "pp": 0.0, "dp": 0.0, "ep": 0.0,
                                                      "world": 0.0})
    key: int = field(default_factory=lambda: next(_mesh_keys))  # its name in custom ops (section 3)
    trace: object = None  # in a traced step (costs.StepTrace), every collective records its span
    # the layout's sizes as the mesh's own (copied: plain attributes, which a step reads without entering
    # this file; the layout is frozen)
    tp: int = field(init=False)
    cp: int = field(init=False)
    pp: int = field(init=False)
    dp: int = field(init=False)
    sp: bool = field(init=False)
    world: int = field(init=False)
    dp_cp: int = field(init=False)
    ep: int = field(init=False)
    edp: int = field(init=False)

    def __post_init__(self):
        MESHES[self.key] = self
        for size in ("tp", "cp", "pp", "dp", "sp", "world", "dp_cp", "ep", "edp"):
            setattr(self, size, getattr(self.layout, size))

    def scheduled(self, schedule: str, virtual: int = 1) -> Mesh:
        """The same ranks and process groups, their pipeline run in another schedule (compare.py's bubble)."""
        layout = replace(self.layout, schedule=schedule, virtual=virtual)
        return replace(self, layout=layout, key=next(_mesh_keys))  # (its own key: see MESHES)

    @property
    def dp_cp_rank(self) -> int:
        return self.dp_rank * self.cp + self.cp_rank

    @property
    def ep_rank(self) -> int:
        """Which experts this rank holds: dp ranks ep_rank, ep + ep_rank, ... hold the same (ep innermost)."""
        return self.dp_rank % self.ep

    @property
    def edp_rank(self) -> int:
        return self.dp_rank // self.ep

    @property
    def grad_dim(self) -> str:
        """The group of those dp_cp ranks, over which gradients are summed: "dp" without cp."""
        return "dp_cp" if self.cp > 1 else "dp"

    @property
    def whole_model(self) -> bool:
        """Whether this rank runs the whole model on whole sequences by itself (generation needs that)."""
        return self.tp == self.cp == self.pp == 1

    def local_seq_len(self, seq_len: int) -> int:
        """Tokens of each sequence in this rank's residual stream: seq_len / cp, and / tp under SP."""
        return seq_len // self.cp // (self.tp if self.sp else 1)

    def size(self, dim: str) -> int:
        return getattr(self, dim)

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1


class LayoutError(ValueError):
    """An impossible parallel layout; raised identically on every rank before any communication."""


def init_mesh(layout: Layout | None = None, device: torch.device | None = None, timeout_s: float = 300.0,
              io_timeout_s: float = 3600.0) -> Mesh:
    """Join the job torchrun started (RANK, WORLD_SIZE, MASTER_ADDR in the environment) and make the
    groups of `layout` (None: every rank a dp rank) from one grid: ranks = arange(world).view(dp, pp,
    cp, tp), TP innermost (the heaviest traffic, inside one NVLink domain), then CP (an all-gather per
    layer), then PP (point-to-point between neighbours), DP outermost (once per step, overlapped).
    NCCL on CUDA, gloo on CPU. Collectives give up after timeout_s rather than hang (the first step
    after io_timeout_s: patient()); the "io" group's waits for disk work, long by nature, after
    io_timeout_s."""
    rank, world = launch.launch_env()
    layout = layout or Layout(dp=world)
    if layout.world != world:
        raise LayoutError(f"the layout ({layout}) is not the job's {world} processes")
    tp, cp, pp, dp = layout.tp, layout.cp, layout.pp, layout.dp
    mesh = Mesh(layout, rank=rank, timeout_s=timeout_s, io_timeout_s=io_timeout_s,
                device=device if device is not None and device.type == "cuda" else torch.device("cpu"))
    grid = torch.arange(world).view(dp, pp, cp, tp)
    mesh.dp_rank, mesh.pp_rank, mesh.cp_rank, mesh.tp_rank = (int(i) for i in (grid == rank).nonzero()[0])
    mesh.pp_peers = grid[mesh.dp_rank, :, mesh.cp_rank, mesh.tp_rank].tolist()
    if world == 1:
        return mesh
    if not dist.is_initialized():
        launch.join_job(rank, world, device, timeout_s)
    mesh.group_ranks["world"] = list(range(world))
    lines = group_lines(layout, grid)
    # Only the groups this rank is in, of dimensions larger than 1, each agreed on by its members
    # alone (use_local_synchronization): a rank makes 3 or 4 groups, not one per line of every
    # dimension (a thousand splits of the world at a thousand GPUs). Each group needs its own
    # timeout (a new group does not inherit the world's); NCCL's watchdog messages show its name.
    for dim, dim_lines in lines.items():
        ranks = next(r for r in dim_lines.tolist() if rank in r)
        if len(ranks) > 1:
            mesh.groups[dim] = dist.new_group(ranks, timeout=datetime.timedelta(seconds=timeout_s),
                                              group_desc=dim, use_local_synchronization=True)
            mesh.group_ranks[dim] = ranks
    # The long waits go over gloo even on GPUs: a timeout there is an exception, which becomes this
    # project's CommError, where NCCL's watchdog would end the process with its own message.
    # "ckpt": the same, for the background checkpoint writer alone (a group is used by one thread at a time).
    for dim in launch.LONG_GROUPS:
        mesh.groups[dim] = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=io_timeout_s),
                                          group_desc=dim, backend="gloo")
        mesh.group_ranks[dim] = list(range(world))
    barrier(mesh)
    return mesh


def group_lines(layout: Layout, grid: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each dimension's groups, one per row: the ranks that differ only in that dimension (dp_cp: in dp
    and cp), in rank order, from grid = arange(world).view(dp, pp, cp, tp)."""
    tp, cp, pp, dp = layout.tp, layout.cp, layout.pp, layout.dp
    lines = {"tp": grid.reshape(-1, tp), "cp": grid.permute(0, 1, 3, 2).reshape(-1, cp),
             "pp": grid.permute(0, 2, 3, 1).reshape(-1, pp), "dp": grid.permute(1, 2, 3, 0).reshape(-1, dp)}
    if cp > 1:
        lines["dp_cp"] = grid.permute(1, 3, 0, 2).reshape(-1, dp * cp)
    if layout.ep > 1:  # dp rank d = edp_rank * ep + ep_rank: "ep" the ranks holding all the experts between
        ep = grid.view(dp // layout.ep, layout.ep, pp, cp, tp)  # them, "edp" those holding the same ones
        lines["ep"], lines["edp"] = (ep.permute(0, 2, 3, 4, 1).reshape(-1, layout.ep),
                                     ep.permute(1, 2, 3, 4, 0).reshape(-1, dp // layout.ep))
    return lines


# ----------------------------------------------------------------------------------------------------
# 2. Collectives, with the bytes each rank sends counted per dimension
#    (ring algorithms: all-reduce sends 2(n-1)/n of the buffer, all-gather and reduce-scatter (n-1)/n)


# newer torch renamed all_gather_into_tensor and reduce_scatter_tensor (the old names warn); 2.5 has the old
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _count(mesh: Mesh, dim: str, nbytes: float) -> float:
    """Bytes sent on a group, counted under its dimension (dp_cp's as "dp": see Mesh.comm_bytes)."""
    mesh.comm_bytes["dp" if dim in ("dp_cp", "edp") else dim] += nbytes  # (edp: the experts' gradients)
    return nbytes


def all_reduce(t: torch.Tensor, mesh: Mesh, dim: str, op=dist.ReduceOp.SUM, async_op=False):
    n = mesh.size(dim)
    if n == 1:
        return None
    sent = _count(mesh, dim, 2 * (n - 1) / n * t.numel() * t.element_size())
    return launch.run_collective(("all_reduce", t), mesh, dim,
                   lambda: dist.all_reduce(t, op=op, group=mesh.groups.get(dim), async_op=async_op), async_op,
                   sent)


def all_gather(out: torch.Tensor, inp: torch.Tensor, mesh: Mesh, dim: str, async_op=False):
    """out (n * len(inp), ...) <- every rank's inp, concatenated along dim 0 in rank order."""
    n = mesh.size(dim)
    sent = _count(mesh, dim, (n - 1) / n * out.numel() * out.element_size())
    return launch.run_collective(("all_gather", out), mesh, dim, lambda: _all_gather_single(
        out, inp, group=mesh.groups[dim], async_op=async_op), async_op, sent)


class Handles:
    """Asynchronous ops' handles as one: wait() waits for each."""

    def __init__(self, works: list):
        self.works = works

    def wait(self):
        for work in self.works:
            work.wait()


def all_gather_many(outs: list[torch.Tensor], inps: list[torch.Tensor], mesh: Mesh, dim: str):
    """all_gather(out, inp) for each pair, launched together; returns one handle (asynchronous). On
    NCCL one group call (torch's coalescing manager: private, used by Megatron-LM), so a unit's buckets
    cost one launch, not one each. On gloo one all-gather each: gloo's coalesced all-gather corrupts
    the heap now and then (torch 2.13, ZeRO-1 and -2 of the tiny model at dp 2: 5 processes aborted
    in 4,700 steps, "malloc(): unaligned tcache chunk"; none in 5,700 steps with separate all-gathers)."""
    sent = sum(_count(mesh, dim, (mesh.size(dim) - 1) / mesh.size(dim) * out.numel() * out.element_size())
               for out in outs)
    group = mesh.groups[dim]

    def gather():
        if mesh.device.type != "cuda":
            return Handles([_all_gather_single(out, inp, group=group, async_op=True)
                            for out, inp in zip(outs, inps)])
        with dist._coalescing_manager(group=group, async_ops=True) as many:
            for out, inp in zip(outs, inps):
                _all_gather_single(out, inp, group=group)
        return many
    return launch.run_collective(("all_gather", outs[0]), mesh, dim, gather, async_op=True, nbytes=sent)


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, mesh: Mesh, dim: str, async_op=False):
    """out <- this rank's 1/n slice (along dim 0) of the sum of every rank's inp."""
    n = mesh.size(dim)
    sent = _count(mesh, dim, (n - 1) / n * inp.numel() * inp.element_size())
    return launch.run_collective(("reduce_scatter", inp), mesh, dim, lambda: _reduce_scatter_single(
        out, inp, group=mesh.groups[dim], async_op=async_op), async_op, sent)


def barrier(mesh: Mesh, long: bool = False, dim: str | None = None):
    """Every rank waits here for all the others. long=True: on the "io" group, for a wait long by
    nature (others preparing data or writing a checkpoint), bounded by --io-timeout; dim: another
    such group ("ckpt": the background checkpoint writer's)."""
    if mesh.world > 1:
        dim = dim or ("io" if long else "world")
        launch.run_collective(("barrier", None), mesh, dim, lambda: dist.barrier(group=mesh.groups.get(dim)))


# The same collectives for compiled code. Section 3's run inside the blocks --compile compiles, and
# loss.py's in its compiled chunks, so each is a torch custom op: one opaque graph node whose body
# (the wrappers above: the byte count, the timing, the CommError) runs as plain Python at every
# call. Called directly, that body would break the graph (the clock cannot be traced) and recompile
# each call (the byte counter's value would become a guard). Selective activation checkpointing finds
# the gathers by these names too (model.KEPT_OPS). Other code calls the body itself: a custom op called
# eagerly imports torch's compiler stack (sympy: a second of every process's start).


def custom_op(name: str, mutates_args=()):
    """torch.library.custom_op where the dispatcher is watched (torch.compile tracing, a dispatch mode:
    selective checkpointing's), the plain function otherwise."""
    def wrap(fn):
        op = torch.library.custom_op(name, mutates_args=mutates_args)(fn)

        def call(*args):
            watched = torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None
            return op(*args) if watched else fn(*args)
        call.register_fake = op.register_fake
        return call
    return wrap


@custom_op("llama3::all_reduce_", mutates_args=("t",))
def all_reduce_op(t: torch.Tensor, mesh_key: int, dim: str) -> None:
    all_reduce(t, MESHES[mesh_key], dim)


@all_reduce_op.register_fake
def _(t, mesh_key, dim):
    return None


@custom_op("llama3::all_gather")
def all_gather_op(inp: torch.Tensor, mesh_key: int, dim: str) -> torch.Tensor:
    mesh = MESHES[mesh_key]
    out = inp.new_empty((inp.shape[0] * mesh.size(dim), *inp.shape[1:]))
    all_gather(out, inp, mesh, dim)
    return out


@all_gather_op.register_fake
def _(inp, mesh_key, dim):
    return inp.new_empty((inp.shape[0] * MESHES[mesh_key].size(dim), *inp.shape[1:]))


@custom_op("llama3::reduce_scatter")
def reduce_scatter_op(inp: torch.Tensor, mesh_key: int, dim: str) -> torch.Tensor:
    mesh = MESHES[mesh_key]
    out = inp.new_empty((inp.shape[0] // mesh.size(dim), *inp.shape[1:]))
    reduce_scatter(out, inp, mesh, dim)
    return out


@reduce_scatter_op.register_fake
def _(inp, mesh_key, dim):
    return inp.new_empty((inp.shape[0] // MESHES[mesh_key].size(dim), *inp.shape[1:]))


# ----------------------------------------------------------------------------------------------------
# 3. Tensor-parallel communication as autograd functions. Each is its own conjugate's transpose:
#    f: forward identity, backward all-reduce   (enters a TP region: every rank needs the whole input)
#    g: forward all-reduce, backward identity   (leaves it: partial sums from each rank are added)
#    With sequence parallelism the activations between TP regions are split along the sequence, and
#    the pair becomes gather (forward all-gather, backward reduce-scatter) / scatter (the reverse).


class _CopyToTP(torch.autograd.Function):  # f
    @staticmethod
    def forward(ctx, x, mesh):
        ctx.mesh = mesh
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        all_reduce_op(grad, ctx.mesh.key, "tp")
        return grad, None


class _ReduceFromTP(torch.autograd.Function):  # g
    @staticmethod
    def forward(ctx, x, mesh):
        x = x.contiguous()
        all_reduce_op(x, mesh.key, "tp")
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _gather_seq(x, mesh, dim: str = "tp"):
    """(B, T/n, ...) on each rank of the group -> (B, T, ...), the ranks' pieces in rank order."""
    xt = x.transpose(0, 1).contiguous()  # collectives concatenate on dim 0: put the sequence there
    out = all_gather_op(xt, mesh.key, dim)
    # contiguous once, here: a transposed view would be copied by each linear reading it (wq, wk and
    # wv; w1 and w3), and every copy kept for backward
    return out.transpose(0, 1).contiguous()


def _scatter_seq(x, mesh, dim: str = "tp"):
    """(B, T, ...) partial sums on each rank of the group -> (B, T/n, ...), this rank's piece, summed."""
    xt = x.transpose(0, 1).contiguous()
    return reduce_scatter_op(xt, mesh.key, dim).transpose(0, 1)


class _GatherSeq(torch.autograd.Function):  # SP's f; context parallelism's K/V exchange over "cp"
    @staticmethod
    def forward(ctx, x, mesh, dim="tp"):
        ctx.mesh, ctx.dim = mesh, dim
        return _gather_seq(x, mesh, dim)

    @staticmethod
    def backward(ctx, grad):
        return _scatter_seq(grad, ctx.mesh, ctx.dim), None, None


class _ScatterSeq(torch.autograd.Function):  # SP's g
    @staticmethod
    def forward(ctx, x, mesh):
        ctx.mesh = mesh
        return _scatter_seq(x, mesh)

    @staticmethod
    def backward(ctx, grad):
        return _gather_seq(grad, ctx.mesh), None


def enter_tp(x, mesh):
    return _GatherSeq.apply(x, mesh) if mesh.sp else _CopyToTP.apply(x, mesh)


def leave_tp(x, mesh):
    return _ScatterSeq.apply(x, mesh) if mesh.sp else _ReduceFromTP.apply(x, mesh)


# ----------------------------------------------------------------------------------------------------
# 4. Tensor-parallel layers


class ParallelNorm(M.RMSNorm):
    """RMSNorm (replicated on every TP rank) followed by f: the norm's output is what the column-parallel
    linears after it consume. Megatron fuses q/k/v into one GEMM so it needs one f per attention; placing
    f here gives the same single all-reduce for wq, wk and wv (and for w1, w3), so each layer does
    2 all-reduces forward (wo, w2) and 2 backward (the two norms). Under SP the norm runs on this rank's
    sequence chunk and f becomes an all-gather; the norm weight's gradient is then partial (sum over tp)."""

    def __init__(self, norm: M.RMSNorm, mesh: Mesh):
        super().__init__(norm.weight.shape[0], norm.eps)
        self.weight = norm.weight
        self.mesh = mesh

    def forward(self, x):
        return enter_tp(super().forward(x), self.mesh)


class ColumnParallelLinear(M.Linear):
    """y_r = x @ W_r^T with W split by rows (output features): rank r computes its slice of the outputs
    (its attention heads, its share of the FFN hidden units). Its input must already be in the TP region:
    the ParallelNorm before it applied f. (With LoRA: A whole, B split like W: x A^T B_r^T is the slice.)"""

    def __init__(self, full: nn.Linear, mesh: Mesh):
        super().__init__(full.in_features, full.out_features // mesh.tp, device="meta")
        self.weight = nn.Parameter(full.weight.detach().chunk(mesh.tp, dim=0)[mesh.tp_rank].clone())


class RowParallelLinear(M.Linear):
    """y = sum_r x_r @ W_r^T with W split by columns (input features): each rank multiplies its slice of the
    hidden units and g (all-reduce, or reduce-scatter under SP) adds the partial results. (With LoRA: A
    split like W, B whole: g adds the x_r A_r^T B^T as well, before it leaves the TP region.)"""

    def __init__(self, full: nn.Linear, mesh: Mesh):
        super().__init__(full.in_features // mesh.tp, full.out_features, device="meta")
        # (a column slice is strided: cloned into contiguous memory, which on the meta device spares the
        # compiler stack's import that a stride-preserving clone makes)
        piece = full.weight.detach().chunk(mesh.tp, dim=1)[mesh.tp_rank]
        self.weight = nn.Parameter(piece.clone(memory_format=torch.contiguous_format))
        self.mesh = mesh

    def forward(self, x):
        return leave_tp(super().forward(x), self.mesh)


def padded_vocab(vocab_size: int, tp: int) -> int:
    """The vocabulary rounded up to a multiple of tp; padding rows are zero and masked out of the loss."""
    return -(-vocab_size // tp) * tp


def _vocab_shard(weight: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """This rank's rows of a (vocab, dim) table padded with zero rows to padded_vocab. (Written into a
    new tensor, not cut from a torch.cat: on the meta device cat imports torch's compiler stack.)"""
    V, rows = weight.shape[0], padded_vocab(weight.shape[0], mesh.tp) // mesh.tp
    first = mesh.tp_rank * rows
    shard = weight.new_zeros(rows, weight.shape[1])
    shard[:max(0, min(V - first, rows))] = weight.detach()[first:first + rows]
    return shard


def check_ids(ids: torch.Tensor, vocab_size: int):
    """Refuse token ids outside [0, vocab_size), as one process's F.embedding does. The vocab-parallel
    embedding below takes an id outside a rank's rows for another rank's, so an id outside every
    rank's rows (or in the padding) would silently become a zero embedding (loss.check_targets: the
    same for the loss). The check is asynchronous (on a GPU a device-side assert, adding no host
    sync; on a CPU a RuntimeError at once), so it cannot name the id; train.py's data loader already
    named it and its shard."""
    torch._assert_async(~((ids < 0) | (ids >= vocab_size)).any(), f"a token id is outside the vocabulary "
                                                                   f"[0, {vocab_size})")


class VocabParallelEmbedding(nn.Module):
    """Rank r holds rows [r*V/tp, (r+1)*V/tp) of the table: it looks up the ids it owns, writes zeros for
    the others, and g sums the ranks' partial embeddings (each id is owned by exactly one rank)."""

    def __init__(self, full: nn.Embedding, mesh: Mesh):
        super().__init__()
        self.mesh, self.vocab_size = mesh, full.weight.shape[0]
        self.weight = nn.Parameter(_vocab_shard(full.weight, mesh))
        self.start = mesh.tp_rank * self.weight.shape[0]

    def forward(self, ids):
        check_ids(ids, self.vocab_size)
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        h = F.embedding(local.masked_fill(outside, 0), self.weight)  # (B, T, dim)
        h = h.masked_fill(outside[..., None], 0.0)
        return leave_tp(h, self.mesh)


# A block's tensor-parallel layout (torchtitan's apply_tp writes its plan so), from which the swap
# and the placement follow: a column-parallel linear cuts its weight's rows (dim 0: outputs), a
# row-parallel one its columns (dim 1: inputs), and a norm is replicated, f applied after it.
TP_PLAN = {"attention.wq": "column", "attention.wk": "column", "attention.wv": "column", "attention.wo": "row",
           "feed_forward.w1": "column", "feed_forward.w3": "column", "feed_forward.w2": "row",
           "attention_norm": "norm", "ffn_norm": "norm"}
TP_STYLES = {"column": (ColumnParallelLinear, 0), "row": (RowParallelLinear, 1), "norm": (ParallelNorm, None)}


def apply_tensor_parallel(model: M.Transformer, mesh: Mesh) -> M.Transformer:
    """Swap a whole model's layers for their TP shards, in place: each block by TP_PLAN, then the final norm
    and the vocab-parallel embedding and head. Records in model.tp_placement, for each sharded parameter,
    (dim, full size along dim) so checkpoints can say where each shard belongs."""
    if mesh.tp == 1:
        return model
    for key, layer in model.layers.items():
        for path, style in TP_PLAN.items():
            parent, name = layer.get_submodule(path.rpartition(".")[0]), path.rpartition(".")[2]
            full, (parallel_class, dim) = getattr(parent, name), TP_STYLES[style]
            setattr(parent, name, parallel_class(full, mesh))
            if dim is not None:
                model.tp_placement[f"layers.{key}.{path}.weight"] = (dim, full.weight.shape[dim])
    model.norm = ParallelNorm(model.norm, mesh)
    model.tok_embeddings = VocabParallelEmbedding(model.tok_embeddings, mesh)
    out = model.args.output_size  # the vocabulary, or a reward model's num_labels (head_outputs)
    head = nn.Linear(model.args.dim, padded_vocab(out, mesh.tp) // mesh.tp, bias=False, device="meta")
    if model.args.tie_embeddings:
        head.weight = model.tok_embeddings.weight
    else:
        head.weight = nn.Parameter(_vocab_shard(model.output.weight, mesh))
    model.output = head  # column-parallel; its input is in the TP region (model.norm's f)
    model.tp_placement.update({"tok_embeddings.weight": (0, model.args.vocab_size), "output.weight": (0, out)})
    return model


def head_outputs(logits, n: int, mesh: Mesh) -> torch.Tensor:
    """The head's n outputs (..., n), whole on every tp rank, from this rank's columns (..., n_padded / tp)
    of a column-parallel head: for a head too small to split (a reward model's one score), what the
    vocab-parallel cross-entropy does for the vocabulary. Each rank places its own real columns among
    zeros and g sums them (each output is one rank's); backward hands each rank its columns' gradient."""
    if mesh.tp == 1:
        return logits[..., :n]
    local, start = logits.shape[-1], mesh.tp_rank * logits.shape[-1]
    mine = max(0, min(local, n - start))
    full = logits.new_zeros(*logits.shape[:-1], n)
    full[..., start:start + mine] = logits[..., :mine]
    return _ReduceFromTP.apply(full, mesh)


def gather_vocab(logits, mesh: Mesh) -> torch.Tensor:
    """This rank's vocabulary columns (B, V_padded / tp) -> the whole padded vocabulary (B, V_padded), the
    same on every tp rank: generation samples from it (model.generate's whole_vocab). Forward only; one
    all-gather of B x V numbers per generated token, against the vocab-parallel loss's three of B."""
    if mesh.tp == 1:
        return logits
    B, local = logits.shape
    out = logits.new_empty(mesh.tp * B, local)
    all_gather(out, logits.contiguous(), mesh, "tp")  # (tp * B, V / tp): rank r's columns in rows r*B..
    return out.view(mesh.tp, B, local).permute(1, 0, 2).reshape(B, mesh.tp * local)


# ----------------------------------------------------------------------------------------------------
# 5. Context parallelism: each sequence cut along its length over the cp ranks
#
# The Llama 3 way (Dubey et al. 2024, section 3.3.2), not the ring: each rank projects its own
# tokens' Q, K and V, all-gathers every rank's K and V over cp once per layer, and attends to all of
# them; backward reduce-scatters the K/V gradients to the ranks whose tokens made them. Under GQA K
# and V are small (8 KV heads against 128 query heads in 405B: each 1/16 of Q), so gathering them
# costs little beside the attention it feeds, and any mask works unchanged (packed documents
# included), where a ring (Liu et al. 2023) must pass K/V blocks around cp times, merge partial
# softmaxes and skip blocks per mask. The price: the whole sequence's K and V, a layer at a time.
#
# Causal attention makes later tokens costlier (query i reads i keys): with cp contiguous pieces the
# last rank would do 2cp-1 times the first one's work, so the sequence is cut into 2cp chunks and
# rank r holds chunks r and 2cp-1-r, evening out the work. Positions stay global: RoPE rotates each
# token by its place in the sequence (or its document); the mask compares global positions.


def context_positions(seq_len: int, cp: int, cp_rank: int, device=None) -> torch.Tensor:
    """(seq_len / cp,) the positions of the sequence that cp rank cp_rank holds, in the order it holds them:
    chunk cp_rank, then chunk 2cp-1-cp_rank, of 2cp equal chunks."""
    chunks = torch.arange(seq_len, device=device).view(2 * cp, seq_len // (2 * cp))
    return torch.cat([chunks[cp_rank], chunks[2 * cp - 1 - cp_rank]])


def context_chunks(batch: tuple, mesh: Mesh) -> tuple:
    """A micro-batch (inputs, targets[, doc_ids]) of whole sequences (B, T) -> this cp rank's part: the
    inputs and targets at its positions (B, T/cp). doc_ids stay whole: the mask needs every key's."""
    if mesh.cp == 1:
        return batch
    pos = context_positions(batch[0].shape[1], mesh.cp, mesh.cp_rank, batch[0].device)
    return (batch[0][:, pos], batch[1][:, pos], *batch[2:])


def attention_inputs(args: M.ModelArgs, mesh: Mesh, seq_len: int, device, doc_ids=None, caches=None,
                     start_pos: int = 0, pad=None):
    """Transformer.attention_inputs under cp (apply_context_parallel puts it in the model's): RoPE's cos/sin
    and the attention mask for this rank's tokens. The queries are this rank's seq_len/cp tokens; the keys
    are all seq_len, in the order the all-gather lays them out (rank 0's two chunks, then rank 1's, ...)."""
    assert caches is None and start_pos == 0 and pad is None, "generation runs unsharded"
    q_pos = context_positions(seq_len, mesh.cp, mesh.cp_rank, device)  # (T/cp,)
    kv_pos = torch.cat([context_positions(seq_len, mesh.cp, r, device) for r in range(mesh.cp)])  # (T,)
    rope_pos = q_pos if doc_ids is None else M.document_positions(doc_ids)[:, q_pos]
    cos, sin = M.rope_cos_sin(rope_pos, M.rope_frequencies(args, device))
    return cos, sin, M.document_mask(doc_ids, q_pos, kv_pos)


class ContextParallelAttention(M.Attention):
    """This rank's T/cp queries against the whole sequence's keys and values, K and V in one
    all-gather over cp. For training and evaluation: generation runs unsharded."""

    def __init__(self, att: M.Attention, mesh: Mesh):
        nn.Module.__init__(self)
        self.head_dim, self.mesh = att.head_dim, mesh
        self.wq, self.wk, self.wv, self.wo = att.wq, att.wk, att.wv, att.wo

    def forward(self, x, cos, sin, mask=None, cache=None, start_pos: int = 0):
        B, T, _ = x.shape  # T: this rank's tokens
        q, k, v = self.project(x, cos, sin)  # (B, T, heads, head_dim)
        kv = _GatherSeq.apply(torch.cat([k, v], dim=2), self.mesh, "cp")  # (B, T * cp, 2 * n_kv_heads, hd)
        k, v = kv.chunk(2, dim=2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, heads, T or T * cp, head_dim)
        y = M.attention(q, k, v, mask, is_causal=False)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


def apply_context_parallel(model: M.Transformer, mesh: Mesh) -> M.Transformer:
    """Swap every block's attention for ContextParallelAttention, in place (same parameters, same names),
    and the model's attention inputs for this rank's positions'."""
    if mesh.cp > 1:
        for layer in model.layers.values():
            layer.attention = ContextParallelAttention(layer.attention, mesh)
        model.attention_inputs = functools.partial(attention_inputs, model.args, mesh)
    return model


# ----------------------------------------------------------------------------------------------------
# 5b. Expert parallelism (--ep): each mixture layer's experts cut over ep of the dp ranks, E / ep each
#     (GShard, Lepikhin et al. 2020). A token stays on its rank for attention; in a mixture layer its
#     hidden state goes to the ranks holding its top_k experts and comes back: two all-to-alls each
#     way per layer, of counts, then of tokens in uneven splits. The experts' gradients are summed
#     over the dp ranks holding the same experts ("edp", zero.py), the rest over all of dp.


def all_to_all(inp: torch.Tensor, send: list[int], recv: list[int], mesh: Mesh, dim: str = "ep") -> torch.Tensor:
    """Rows send[j] of inp (in rank order) to rank j of the group; returns the rows each rank sent here,
    recv[j] of them from rank j, concatenated in rank order. Counted: every row that leaves this rank."""
    out = inp.new_empty((sum(recv), *inp.shape[1:]))
    me = mesh.ep_rank if dim == "ep" else 0
    _count(mesh, dim, (sum(send) - send[me]) * inp[:1].numel() * inp.element_size())
    launch.run_collective(("all_to_all", inp), mesh, dim, lambda: dist.all_to_all_single(
        out, inp.contiguous(), recv, send, group=mesh.groups[dim]))
    return out


class _AllToAll(torch.autograd.Function):
    """all_to_all, whose backward sends each row's gradient back the way the row came."""

    @staticmethod
    def forward(ctx, inp, send: list[int], recv: list[int], mesh_key: int):
        ctx.send, ctx.recv, ctx.key = send, recv, mesh_key
        return all_to_all(inp, send, recv, MESHES[mesh_key])

    @staticmethod
    def backward(ctx, grad):
        return all_to_all(grad, ctx.recv, ctx.send, MESHES[ctx.key]), None, None, None


def expert_parallel_dispatch(experts: nn.ModuleDict, x, chosen, weights, pairs, mesh: Mesh) -> torch.Tensor:
    """model.run_experts across the ep group: x (N, dim), chosen and weights (N, top_k), pairs (E,) this
    rank's pairs per expert -> (N, dim). The (token, slot) pairs, sorted by expert, are sorted by the rank holding it; a first all-to-all
    of counts tells each rank how many rows of each of its experts every rank sends."""
    n, k = chosen.shape
    local, ep = len(experts), mesh.ep  # (experts are numbered globally; this rank holds `local`)
    order = chosen.flatten().argsort(stable=True)
    got = all_to_all(pairs, [local] * ep, [local] * ep, mesh).view(ep, local)  # [source, my expert]
    send, got = pairs.view(ep, local).sum(1).tolist(), got.tolist()  # (the host sync: split sizes)
    rows = _AllToAll.apply(x[order // k], send, [sum(g) for g in got], mesh.key)  # by (source, expert)
    pieces = rows.split([c for g in got for c in g])
    outs = [experts[key](torch.cat(pieces[e::local])) for e, key in enumerate(experts)]  # each expert once
    back = [o.split([g[e] for g in got]) for e, o in enumerate(outs)]  # by source again
    y = _AllToAll.apply(torch.cat([back[e][s] for s in range(ep) for e in range(local)]),
                        [sum(g) for g in got], send, mesh.key)
    out = torch.empty_like(y)
    out[order] = y * weights.flatten()[order, None]
    return out.view(n, k, -1).sum(1)


def apply_expert_parallel(model: M.Transformer, mesh: Mesh) -> M.Transformer:
    """Keep this rank's experts, E / ep of them (ep_rank's contiguous block, by global index), in every
    mixture layer of a model built on the meta device, and route its tokens by all-to-all."""
    if mesh.ep == 1:
        return model
    for layer in model.layers.values():
        moe = layer.feed_forward
        if isinstance(moe, M.MoE):
            share = moe.n_experts // mesh.ep
            mine = range(mesh.ep_rank * share, (mesh.ep_rank + 1) * share)
            moe.experts = nn.ModuleDict({str(e): moe.experts[str(e)] for e in mine})
            moe.dispatch = functools.partial(expert_parallel_dispatch, mesh=mesh)
    return model


def is_expert(name: str) -> bool:
    """Whether parameter `name` is an expert's (under ep, held by the ranks of one edp group only)."""
    return ".feed_forward.experts." in name


# ----------------------------------------------------------------------------------------------------
# 6. Pipeline parallelism


def stage_layers(n_layers: int, pp: int, split: list[int] | None = None) -> list[tuple[int, int]]:
    """[start, end) layer range of each stage: balanced by count (earlier stages take the remainder), or
    given as layer counts per stage (--pp-layers 3,3,2)."""
    if split is None:
        split = [n_layers // pp + (1 if s < n_layers % pp else 0) for s in range(pp)]
    if len(split) != pp or sum(split) != n_layers or min(split) < 1:
        raise LayoutError(f"--pp-layers {split} must give each of the {pp} stages at least one layer and "
                          f"sum to n_layers {n_layers}")
    bounds = [sum(split[:s]) for s in range(pp + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def chunk_layers(n_layers: int, mesh: Mesh) -> list:
    """The layer ranges [start, end) this rank runs: one stage's, or under the interleaved schedule its
    layout.virtual model chunks, chunk v being stage v*pp + pp_rank of pp*virtual (Narayanan et al.
    2021): rank 0 holds layers 0-1 and 8-9 of 16 at pp 4, virtual 2."""
    virtual = mesh.layout.virtual
    ranges = stage_layers(n_layers, mesh.pp * virtual, mesh.layout.split)
    return [ranges[v * mesh.pp + mesh.pp_rank] for v in range(virtual)]


def model_chunks(model: M.Transformer, mesh: Mesh) -> list:
    """What the schedules run one at a time on this rank: its model chunks' layer ranges, or [None]
    (the stage's layers, whatever they are) without the interleaved schedule."""
    return chunk_layers(model.args.n_layers, mesh) if mesh.layout.virtual > 1 else [None]


def apply_pipeline(model: M.Transformer, mesh: Mesh) -> M.Transformer:
    """Keep this stage's layers, or its model chunks' (names keep their global index); the embedding stays
    on the first stage, the final norm and the head on the last."""
    if mesh.pp == 1:
        return model
    chunks = chunk_layers(model.args.n_layers, mesh)
    for key in list(model.layers):
        if not any(start <= int(key) < end for start, end in chunks):
            del model.layers[key]
    if not mesh.first_stage:
        model.tok_embeddings = None
    if not mesh.last_stage:
        model.norm = None
        model.output = None
    return model


def chunk_ends(model: M.Transformer, mesh: Mesh, layers=None) -> tuple[bool, bool]:
    """Whether this rank's stage (or its model chunk of `layers`) starts with the embedding, and whether it
    ends with the head."""
    if layers is None:
        return mesh.first_stage, mesh.last_stage
    return layers[0] == 0, layers[1] == model.args.n_layers


def _p2p(mesh: Mesh, send_next=None, send_prev=None, recv_prev=None, recv_next=None):
    """One batch of point-to-point ops with the neighbouring stages; recv_* are empty buffers to fill.
    Posting a stage's sends and receives together (batch_isend_irecv) is what keeps 1F1B from
    deadlocking when two neighbours both send before they receive."""
    ops = []
    nxt, prev = mesh.pp_peers[(mesh.pp_rank + 1) % mesh.pp], mesh.pp_peers[mesh.pp_rank - 1]  # a ring
    # Activations before gradients, in sends and receives alike: with pp 2 (interleaved) both go to
    # the same peer, and NCCL matches a pair's sends and receives by their order alone, not by tag.
    if send_next is not None:
        ops.append(dist.P2POp(dist.isend, send_next.contiguous(), nxt))
        mesh.comm_bytes["pp"] += send_next.numel() * send_next.element_size()
    if send_prev is not None:
        ops.append(dist.P2POp(dist.isend, send_prev.contiguous(), prev))
        mesh.comm_bytes["pp"] += send_prev.numel() * send_prev.element_size()
    if recv_prev is not None:
        ops.append(dist.P2POp(dist.irecv, recv_prev, prev))
    if recv_next is not None:
        ops.append(dist.P2POp(dist.irecv, recv_next, nxt))
    if ops:
        t0 = time.monotonic()
        sent = sum(t.numel() * t.element_size() for t in (send_next, send_prev) if t is not None)
        done = mesh.trace.collective("send/recv", "pp", sent) if mesh.trace is not None else None
        try:
            for req in dist.batch_isend_irecv(ops):
                req.wait()
            if done is not None:
                done()
        except RuntimeError as e:
            what = "pipeline " + ", ".join(
                f"{'send to' if op.op is dist.isend else 'recv from'} stage {mesh.pp_peers.index(op.peer)}"
                for op in ops)
            launch.raise_comm_error(e, (what, None), mesh, "pp", t0)


def _free(t: torch.Tensor):
    """Drop an activation's storage once it has been sent: backward needs its grad_fn, not its values
    (Megatron's deallocate_output_tensor). _backward() then runs autograd without the shape check."""
    t.data = torch.empty((1,), device=t.device, dtype=t.dtype)


def _backward(output: torch.Tensor, grad: torch.Tensor):
    if output.numel() == grad.numel():
        torch.autograd.backward(output, grad)
    else:  # output's storage freed: call the engine directly, as torch.autograd.backward would
        torch.autograd.Variable._execution_engine.run_backward(
            tensors=(output,), grad_tensors=(grad,), keep_graph=False, create_graph=False, inputs=(),
            allow_unreachable=True, accumulate_grad=True)


def pipeline_step(model, batches, mesh: Mesh, seq_len: int, loss_fn, before_last_backward=None,
                  dtype=torch.float32, stats: dict | None = None, head: bool = True) -> torch.Tensor:
    """Phases 2-4 of one step on this stage, in the layout's schedule: every micro-batch's forward
    and backward, interleaved with the other stages. batches: [(inputs, targets)] for all
    micro-batches (every stage loads them: the first needs inputs, the last targets). loss_fn(logits, targets) -> the micro-batch's
    loss as it enters backward (already divided by the global target count, scaled for fp16);
    head=False passes it the final norm's output instead of the logits. Returns the summed loss on
    the last stage, 0 elsewhere. stats, if given, accumulates "busy_s", the seconds this stage
    computed rather than waited (compare.py measures the bubble with it).

    AFAB runs all m forwards, then all m backwards: up to m micro-batches alive at once. 1F1B runs
    p-1-stage warm-up forwards, alternates one forward with one backward, then drains: at most p
    micro-batches alive on the first stage. Both have the same bubble, (p-1)/(m+p-1) of the time.
    Interleaved 1F1B gives each rank `virtual` model chunks (chunk_layers), cutting the bubble to
    (p-1)/(virtual*m + p-1) for more transfers and more activations in flight."""
    stage = PipelineStage(model, batches, mesh, seq_len, loss_fn, before_last_backward, dtype, stats, head)
    {"afab": _afab, "1f1b": _one_f_one_b, "interleaved": _interleaved}[mesh.layout.schedule](stage)
    return stage.total


def _afab(s: PipelineStage):
    for i in range(s.m):
        s.send_forward(s.forward(i, s.recv_forward()))
    for i in range(s.m):
        s.send_backward(s.backward(i, s.recv_backward()))


def _one_f_one_b(s: PipelineStage):
    mesh = s.mesh
    warmup = min(mesh.pp - mesh.pp_rank - 1, s.m)
    for i in range(warmup):
        s.send_forward(s.forward(i, s.recv_forward()))
    steady = s.m - warmup
    x = s.recv_forward() if steady else None
    for j in range(steady):
        out = s.forward(warmup + j, x)
        grad = None
        if not mesh.last_stage:  # send this output and receive the oldest one's gradient, together
            grad = s.empty()
            _p2p(mesh, send_next=out, recv_next=grad)
            _free(out)
        grad_in = s.backward(j, grad)
        if j == steady - 1:
            s.send_backward(grad_in)
        elif mesh.first_stage:
            x = None
        else:  # send this gradient back, receive the next micro-batch's input, together
            x = s.empty()
            _p2p(mesh, send_prev=grad_in, recv_prev=x)
    for i in range(steady, s.m):
        s.send_backward(s.backward(i, s.recv_backward()))


def _interleaved(s: PipelineStage):
    """Interleaved 1F1B, in Megatron-LM's order. Forward micro-step k runs micro-batch (k // pV) * p + k % p
    on chunk (k // p) % V: p micro-batches go through chunk 0, then the same p through chunk 1, and so on
    (so m must be a multiple of p); backward micro-steps walk the chunks the other way. Rank r first runs
    2(p-1-r) + (V-1)p forwards, then alternates, then drains. Every micro-step ends in one batch of
    transfers: its output to the next rank (rank p-1's goes round to rank 0's next chunk), its input
    gradient to the previous, and the next micro-steps' input and gradient received."""
    p, r, V, total = s.mesh.pp, s.mesh.pp_rank, len(s.chunks), s.m * len(s.chunks)

    def at(k: int, forward: bool) -> tuple[int, int]:  # micro-step k -> (micro-batch, chunk)
        group, within = divmod(k, p * V)
        v = within // p
        return group * p + within % p, v if forward else V - 1 - v

    takes_input = lambda k: k < total and not s.embeds(at(k, True)[1])  # not the embedding's chunk
    takes_grad = lambda k: k < total and not s.ends(at(k, False)[1])  # not the loss's chunk
    sendable = lambda out, v: None if s.ends(v) else out
    warmup = min(2 * (p - 1 - r) + (V - 1) * p, total)
    x, grad = s.exchange(recv_prev=takes_input(0))
    for k in range(warmup):  # forwards only; the last also receives the first backward's gradient
        i, v = at(k, True)
        out = s.forward(i, x, v)
        x, grad = s.exchange(send_next=sendable(out, v), recv_prev=takes_input(k + 1),
                             recv_next=k == warmup - 1 and takes_grad(0))
    for k in range(total - warmup):  # steady: forward k + warmup, backward k
        i, v = at(k + warmup, True)
        out = s.forward(i, x, v)
        j, u = at(k, False)
        grad_in = s.backward(j, grad, u)
        x, grad = s.exchange(send_next=sendable(out, v), send_prev=grad_in,
                             recv_prev=takes_input(k + warmup + 1), recv_next=takes_grad(k + 1))
    for k in range(total - warmup, total):  # backwards only
        j, u = at(k, False)
        _, grad = s.exchange(send_prev=s.backward(j, grad, u), recv_next=takes_grad(k + 1))


class PipelineStage:
    """One step's work on this stage: micro-batch i's forward and backward (on model chunk v under
    the interleaved schedule) and the transfers around them; the schedules above only order them."""

    def __init__(self, model, batches, mesh: Mesh, seq_len: int, loss_fn, before_last_backward, dtype,
                 stats: dict | None, head: bool = True):
        self.model, self.batches, self.mesh, self.seq_len = model, batches, mesh, seq_len
        self.loss_fn, self.head = loss_fn, head
        self.before_last_backward, self.dtype, self.stats = before_last_backward, dtype, stats
        self.m, self.device = len(batches), batches[0][0].device
        self.chunks = model_chunks(model, mesh)  # each chunk's layer range (None: the stage's layers)
        # between stages: the residual stream, (B, T / cp, dim), (B, T / cp / tp, dim) under SP
        self.shape = (batches[0][0].shape[0], mesh.local_seq_len(seq_len), model.args.dim)
        self.inputs, self.outputs = {}, {}  # by (micro-batch, chunk)
        self.total = torch.zeros((), device=self.device)

    def embeds(self, v: int) -> bool:
        """Whether chunk v starts with the embedding (takes token ids, sends no input gradient back)."""
        return chunk_ends(self.model, self.mesh, self.chunks[v])[0]

    def ends(self, v: int) -> bool:
        """Whether chunk v ends with the head (computes the loss, sends no output on)."""
        return chunk_ends(self.model, self.mesh, self.chunks[v])[1]

    def empty(self) -> torch.Tensor:
        return torch.empty(self.shape, device=self.device, dtype=self.dtype)

    @contextmanager
    def busy(self, work: str, i: int, v: int):
        """Time counted as this stage's compute when stats is given. Kernels run asynchronously on CUDA:
        from when earlier work is done to when this work is. In a traced step, a span ("forward 3")."""
        if self.stats is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        trace = self.mesh.trace  # (the span's name is made only in a traced step, off the hot path)
        with trace.span(f"{work} {i}" + (f" chunk {v}" if len(self.chunks) > 1 else "")) \
                if trace is not None else nullcontext():
            yield
        if self.stats is not None:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.stats["busy_s"] = self.stats.get("busy_s", 0.0) + time.perf_counter() - t0

    def forward(self, i: int, x, v: int = 0):
        """Micro-batch i through chunk v; returns its output, or its loss where the chunk ends the model."""
        with self.busy("forward", i, v):
            if self.embeds(v):
                x = self.batches[i][0]
            else:
                x.requires_grad_()
            self.inputs[i, v] = x
            out = self.model(x, doc_ids_of(self.batches[i]), seq_len=self.seq_len, layers=self.chunks[v],
                             head=self.head)
            if self.ends(v):
                out = self.loss_fn(out, self.batches[i][1])
                self.total += out.detach()
            self.outputs[i, v] = out
        return out

    def backward(self, i: int, grad, v: int = 0):
        """Micro-batch i back through chunk v, from its output's gradient (None: from its loss); returns
        the gradient of its input (None for the embedding's chunk)."""
        with self.busy("backward", i, v):
            if i == self.m - 1 and v == 0 and self.before_last_backward is not None:
                self.before_last_backward()  # e.g. data parallelism reducing gradients as they come
            out = self.outputs.pop((i, v))
            _backward(out, grad) if grad is not None else out.backward()
            x = self.inputs.pop((i, v))  # nothing of micro-batch i in chunk v is needed any more
            grad_in = None if self.embeds(v) else x.grad
        return grad_in

    def exchange(self, send_next=None, send_prev=None, recv_prev=False, recv_next=False):
        """One batch of transfers (the interleaved schedule's): returns the received input and gradient
        (None where not asked for); a sent output's values are freed, as in 1F1B."""
        x = self.empty() if recv_prev else None
        grad = self.empty() if recv_next else None
        _p2p(self.mesh, send_next=send_next, send_prev=send_prev, recv_prev=x, recv_next=grad)
        if send_next is not None:
            _free(send_next)
        return x, grad

    def recv_forward(self):
        if self.mesh.first_stage:
            return None
        buf = self.empty()
        _p2p(self.mesh, recv_prev=buf)
        return buf

    def send_forward(self, out):
        if not self.mesh.last_stage:
            _p2p(self.mesh, send_next=out)
            _free(out)

    def recv_backward(self):
        if self.mesh.last_stage:
            return None
        buf = self.empty()
        _p2p(self.mesh, recv_next=buf)
        return buf

    def send_backward(self, grad):
        if not self.mesh.first_stage:
            _p2p(self.mesh, send_prev=grad)


def doc_ids_of(batch):
    """A batch is (inputs, targets) or (inputs, targets, doc_ids) for packed sequences."""
    return batch[2] if len(batch) > 2 else None


@torch.no_grad()
def pipeline_forward(model, batches, mesh: Mesh, seq_len: int, fn, dtype=torch.float32,
                     head: bool = True) -> list:
    """Forward only (validation, reference log-probs): micro-batches flow through the stages one after
    another (with model chunks, round the ranks once per chunk); returns [fn(logits, targets) for each
    micro-batch] on the last stage, [] elsewhere (head=False: fn gets the final norm's output)."""
    results = []
    for batch in batches:
        for layers in model_chunks(model, mesh):
            first, last = chunk_ends(model, mesh, layers)
            x = batch[0]
            if not first:
                x = torch.empty((x.shape[0], mesh.local_seq_len(seq_len), model.args.dim), device=x.device,
                                dtype=dtype)
                _p2p(mesh, recv_prev=x)
            out = model(x, doc_ids_of(batch), seq_len=seq_len, layers=layers, head=head)
            if last:
                results.append(fn(out, batch[1]))
            else:
                _p2p(mesh, send_next=out)
    return results


# ----------------------------------------------------------------------------------------------------
# 7. Work one rank does for all (off the training step)


def on_rank0_first(fn, mesh: Mesh):
    """fn() on every rank in three waves: global rank 0, then the first process of every other node, then
    the rest. For work that fills a cache folder (tokenized shards), which two processes must never fill
    at once: a node that shares rank 0's cache finds it ready, one with its own fills it once. The waves
    wait on the "io" group (a large corpus takes longer to tokenize than any collective should wait)."""
    result = fn() if mesh.rank == 0 else None
    barrier(mesh, long=True)
    if mesh.rank != 0 and int(os.environ.get("LOCAL_RANK", "0")) == 0:
        result = fn()
    barrier(mesh, long=True)
    return result if result is not None else fn()


def all_gather_objects(obj, mesh: Mesh, dim: str = "io") -> list:
    """Every rank's small picklable `obj`, in global rank order, on every rank (over the "io" group, or
    the writer's "ckpt": some ranks may arrive late, having written files the others did not)."""
    if mesh.world == 1:
        return [obj]
    out = [None] * mesh.world
    launch.run_collective(("all_gather_object", None), mesh, dim,
            lambda: dist.all_gather_object(out, obj, group=mesh.groups[dim]))
    return out


def all_true(flag, mesh: Mesh) -> bool:
    """True on every rank iff flag (a bool or a one-element tensor) is true on every rank (e.g. 'my
    checkpoint files are written', 'my reference cache is there'). Off the training step: it waits."""
    t = torch.as_tensor(flag, device=mesh.device).float().reshape(1)
    for dim in ("tp", "cp", "pp", "dp"):
        all_reduce(t, mesh, dim, op=dist.ReduceOp.MIN)
    return bool(t.item())


# ----------------------------------------------------------------------------------------------------
# 8. Building a rank's pieces: a model made on the meta device, cut for this rank, then given storage


def local_piece(full: torch.Tensor, shape, dim: int | None, mesh: Mesh) -> torch.Tensor:
    """This TP rank's piece, of `shape`, of a full tensor split along `dim` (None: replicated). Rows past
    the end of the full tensor (a vocabulary padded to a multiple of tp) are zeros."""
    if dim is None:
        return full
    start = mesh.tp_rank * shape[dim]
    length = max(0, min(shape[dim], full.shape[dim] - start))
    piece = full.new_zeros(shape)
    piece.narrow(dim, 0, length).copy_(full.narrow(dim, start, length))
    return piece


def local_value(model: M.Transformer, mesh: Mesh, full_value, name: str, shape) -> torch.Tensor:
    """This rank's piece, of `shape`, of parameter `name`: full_value(name, full shape) (model.init_tensor
    from a seed, or a tensor of a full state dict) cut as apply_tensor_parallel cut the model."""
    dim, size = model.tp_placement.get(name, (None, None))
    full_shape = list(shape)
    if dim is not None:
        full_shape[dim] = size
    full = full_value(name, tuple(full_shape))
    if tuple(full.shape) != tuple(full_shape):
        raise ValueError(f"{name} has shape {tuple(full.shape)}, this model needs {tuple(full_shape)}")
    return local_piece(full, shape, dim, mesh)


@torch.no_grad()
def materialize(model: M.Transformer, mesh: Mesh, device, full_value) -> M.Transformer:
    """Give a meta-device model, already sharded and cut (apply_tensor_parallel, apply_pipeline) and
    cast to its training dtype, real storage for this rank's parameters only, each its piece of
    full_value(name, full shape) (local_value). One full parameter exists at a time, so a rank of a
    405B model never holds more than its shards plus the largest single weight (in fp32)."""
    with_storage(model, device)
    for name, p in model.named_parameters():
        p.copy_(local_value(model, mesh, full_value, name, p.shape))  # (copy_ casts to p's dtype)
    return model


def with_storage(model: M.Transformer, device) -> M.Transformer:
    """Uninitialized storage for a meta-device model (whole, or a parallel layout's piece), a tied
    head re-tied to the embedding (each parameter gets storage of its own). torch.empty, as
    Module.to_empty does but without its empty_like, which for a meta tensor imports torch's
    symbolic-shape machinery: a second of every process's start."""
    model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    if model.args.tie_embeddings and model.tok_embeddings is not None and model.output is not None:
        model.output.weight = model.tok_embeddings.weight
    return model


def materialize_empty(model: M.Transformer, device) -> M.Transformer:
    """ZeRO-3's start (with dp x cp > 1): every parameter becomes a tensor on `device` without
    storage, its values to be written straight into this rank's pieces of the optimizer's flat
    buffers (optim.AdamW(initial=), GradSync), so the build never holds this rank's whole model (at
    70B on one GPU, 140 GB in bf16). One parameter is allocated at a time, and freed at once."""
    made = {}  # id(meta parameter) -> replacement (a tied weight is one parameter in two places)
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and id(p) not in made:
                t = torch.empty(p.shape, dtype=p.dtype, device=device)
                t.untyped_storage().resize_(0)
                made[id(p)] = nn.Parameter(t, requires_grad=p.requires_grad)
            if p is not None:
                module._parameters[name] = made[id(p)]
    return model
