"""parallel.py on CPU with gloo: each parallel layer against its unsharded self, then whole training runs
under every layout against the single-process run (GUIDE section 3), resharded resume, communication
accounting, and failures that must end the job instead of hanging it."""

import contextlib
import faulthandler
import json
import os
import re
import shutil
import helpers
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch._inductor.utils import run_and_get_code

import checkpoint as C
import checks
import config
import costs
import data
import evaluate
import launch
import loss
import multiproc
import model as M
import parallel as P
import weights as W
import zero as Z

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(fn, world, *args):
    port = free_port()
    mp.spawn(_entry, args=(world, port, fn, args), nprocs=world, join=True)


def mesh_of(**layout) -> P.Mesh:
    """A spawned rank's mesh: the layout given, dp what the job's world leaves."""
    cut = layout.get("tp", 1) * layout.get("cp", 1) * layout.get("pp", 1)
    return P.init_mesh(P.Layout(dp=int(os.environ["WORLD_SIZE"]) // cut, **layout))


def _entry(rank, world, port, fn, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    faulthandler.enable()  # a crash in C++ prints this rank's Python stack
    try:
        fn(*args)
    finally:
        launch.leave_job()
    # Done and out of the job: leave as tests/multiproc.py's ranks do, without the interpreter's teardown,
    # where gloo's threads and torch's static objects can still crash a process whose work is over (about
    # one spawned job in a thousand: SIGSEGV, or "terminate called without an active exception").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ---------------------------------------------------------------------------------------------------
# Layer tests: forward outputs and input/weight gradients equal the unsharded layer's


def rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def _layers(tp, sp):
    mesh = mesh_of(tp=tp, sp=sp)
    r, B, T, d = mesh.tp_rank, 2, 8, 16
    torch.manual_seed(0)
    chunk = lambda t, dim: t.chunk(tp, dim=dim)[r]  # this rank's slice
    seq = (lambda t: chunk(t, 1)) if sp else (lambda t: t)  # SP: activations split along the sequence

    # ParallelNorm (f or the SP all-gather) + ColumnParallelLinear: y_r = norm(x) @ W_r^T
    norm, lin = M.RMSNorm(d), torch.nn.Linear(d, 12, bias=False)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(B, T, d, requires_grad=True)
    y = lin(norm(x))
    gy = torch.randn_like(y)
    y.backward(gy)
    pnorm, plin = P.ParallelNorm(M.RMSNorm(d), mesh), P.ColumnParallelLinear(lin, mesh)
    with torch.no_grad():
        pnorm.weight.copy_(norm.weight)
    xp = seq(x.detach()).clone().requires_grad_()
    yp = plin(pnorm(xp))
    assert torch.allclose(yp, chunk(y, 2), atol=1e-6)
    yp.backward(chunk(gy, 2))
    torch.testing.assert_close(xp.grad, seq(x.grad), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(plin.weight.grad, chunk(lin.weight.grad, 0), atol=1e-6, rtol=1e-5)
    ng = pnorm.weight.grad.clone()
    if sp:  # each rank saw its part of the sequence: the norm's gradient is a partial sum over tp
        P.all_reduce(ng, mesh, "tp")
    torch.testing.assert_close(ng, norm.weight.grad, atol=1e-6, rtol=1e-5)

    # RowParallelLinear: y = sum_r x_r @ W_r^T (all-reduce, or reduce-scatter under SP)
    lin = torch.nn.Linear(12, d, bias=False)
    h = torch.randn(B, T, 12, requires_grad=True)
    y = lin(h)
    gy = torch.randn_like(y)
    y.backward(gy)
    prow = P.RowParallelLinear(lin, mesh)
    hp = chunk(h.detach(), 2).clone().requires_grad_()
    yp = prow(hp)
    torch.testing.assert_close(yp, seq(y), atol=1e-6, rtol=1e-5)
    yp.backward(seq(gy))
    torch.testing.assert_close(hp.grad, chunk(h.grad, 2), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(prow.weight.grad, chunk(lin.weight.grad, 1), atol=1e-6, rtol=1e-5)

    # VocabParallelEmbedding, a vocabulary (37) not divisible by tp: padded rows are zero and never read
    emb = torch.nn.Embedding(37, d)
    ids = torch.randint(0, 37, (B, T))
    out = emb(ids)
    go = torch.randn_like(out)
    out.backward(go)
    pemb = P.VocabParallelEmbedding(emb, mesh)
    outp = pemb(ids)
    torch.testing.assert_close(outp, seq(out), atol=1e-6, rtol=1e-5)
    outp.backward(seq(go))
    padded = torch.cat([emb.weight.grad, torch.zeros(P.padded_vocab(37, tp) - 37, d)])
    torch.testing.assert_close(pemb.weight.grad, chunk(padded, 0), atol=1e-6, rtol=1e-5)

    # Vocab-parallel cross-entropy, with ignored targets: per-token losses and logits gradients
    logits = torch.randn(B, T, 37, requires_grad=True)
    targets = torch.randint(0, 37, (B, T))
    targets[0, :3] = data.IGNORE_INDEX
    want = F.cross_entropy(logits.view(-1, 37), targets.view(-1), ignore_index=data.IGNORE_INDEX,
                           reduction="none")
    w = torch.rand_like(want)
    (want * w).sum().backward()
    local = torch.cat([logits.detach(), torch.full((B, T, P.padded_vocab(37, tp) - 37), 3.0)], dim=-1)
    local = chunk(local, 2).clone().requires_grad_()  # padding filled with large logits: must be masked
    lossp = loss.vocab_parallel_cross_entropy(local, targets, 37, mesh)
    torch.testing.assert_close(lossp.view(-1), want, atol=1e-5, rtol=1e-5)
    (lossp.view(-1) * w).sum().backward()
    full_grad = torch.cat([logits.grad, torch.zeros(B, T, P.padded_vocab(37, tp) - 37)], dim=-1)
    torch.testing.assert_close(local.grad, chunk(full_grad, 2), atol=1e-6, rtol=1e-5)

    # The chunked head loss's one pass: the summed loss and its logits gradient, softmax - onehot(target),
    # the padding's columns 0 (eager; compiled, its collectives traced, at tp 2)
    logits.grad = None
    F.cross_entropy(logits.view(-1, 37), targets.view(-1), ignore_index=data.IGNORE_INDEX,
                    reduction="sum").backward()
    full_grad = torch.cat([logits.grad, torch.zeros(B, T, P.padded_vocab(37, tp) - 37)], dim=-1)
    Vl = local.shape[-1]
    fns = [loss.chunk_loss_and_grad] + ([torch.compile(loss.chunk_loss_and_grad, dynamic=False)] if tp == 2 else [])
    for fn in fns:
        lsum, g = fn(local.detach().view(-1, Vl).clone(), targets.view(-1), r * Vl, min(Vl, 37 - r * Vl),
                     mesh.key, tp)
        torch.testing.assert_close(lsum, want.sum(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(g, chunk(full_grad, 2).reshape(-1, Vl), atol=1e-6, rtol=1e-5)

    # ids outside the vocabulary (37: a padding row at tp 2; 99: no rank's) are refused on every rank, as
    # one process's embedding and cross-entropy refuse them: never a zero row or a free target
    for bad in (37, 99):
        with pytest.raises(RuntimeError, match=r"a token id is outside the vocabulary \[0, 37\)"):
            pemb(torch.full((B, T), bad))
        with pytest.raises(RuntimeError, match=r"a target id is outside the vocabulary \[0, 37\)"):
            loss.vocab_parallel_cross_entropy(local, torch.full((B, T), bad), 37, mesh)


@pytest.mark.parametrize("tp,sp", [(2, False), (2, True), (4, False)])
def test_parallel_layers_match_unsharded(tp, sp):
    spawn(_layers, tp, tp, sp)


def _context_attention(cp, packed, block_mask):
    """One attention layer over a whole sequence, and the same layer under context parallelism: each rank's
    outputs and input gradients are the whole layer's at its positions, the weight gradients summed over
    cp are the whole layer's."""
    if block_mask:  # FlexAttention's block mask, CUDA's path: its forward runs on the CPU too
        M.BLOCK_MASK_DEVICES = ("cpu",)
    mesh = mesh_of(cp=cp)
    args = M.ModelArgs(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=64)
    torch.manual_seed(0)
    model, B, T = M.Transformer(args), 2, 32
    att = model.layers["0"].attention
    x = torch.randn(B, T, args.dim, requires_grad=True)
    # documents that cross the chunk boundaries (cp 2: every 8 tokens; cp 4: every 4), and a row of one
    doc_ids = torch.tensor([[0] * 5 + [1] * 20 + [2] * 7, [0] * T]) if packed else None
    pos = P.context_positions(T, cp, mesh.cp_rank)
    catt = P.ContextParallelAttention(att, mesh)
    with torch.set_grad_enabled(not block_mask):  # FlexAttention has no backward on the CPU
        y = att(x, *model.attention_inputs(T, x.device, doc_ids))
        xc = x.detach()[:, pos].clone().requires_grad_(not block_mask)
        yc = catt(xc, *P.attention_inputs(args, mesh, T, x.device, doc_ids))
    torch.testing.assert_close(yc, y[:, pos], atol=1e-5, rtol=1e-5)
    if block_mask:
        return
    gy = torch.randn_like(y)
    y.backward(gy)
    weights = [p.grad.clone() for p in att.parameters()]
    att.zero_grad()
    yc.backward(gy[:, pos])
    torch.testing.assert_close(xc.grad, x.grad[:, pos], atol=1e-5, rtol=1e-5)
    for p, full in zip(catt.parameters(), weights):
        P.all_reduce(p.grad, mesh, "cp")
        torch.testing.assert_close(p.grad, full, atol=1e-5, rtol=1e-5)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("cp,packed,block_mask", [(2, False, False), (2, True, False), (4, True, False),
                                                  (2, True, True)])
def test_context_parallel_attention_matches_the_whole_sequence(cp, packed, block_mask):
    spawn(_context_attention, cp, cp, packed, block_mask)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_loss_in_chunks_equals_the_loss_of_whole_logits(dtype, compiled):
    """head_loss_sum over 37 tokens in chunks of 8 (the last one short, some targets ignored), its
    per-chunk arithmetic eager and compiled (--compile): the loss and the gradients of h and of the head's
    weight (in their own dtypes) equal autograd's through the whole logits and F.cross_entropy, within
    float rounding; without gradients too. The logits come from calls of the head module, whose forward
    hook (ZeRO-1/2 wait there for its weights) runs before the first chunk."""
    torch.manual_seed(0)
    N, d, V = 37, 16, 23
    head = torch.nn.Linear(d, V, bias=False).to(dtype)
    h = torch.randn(N, d, dtype=dtype, requires_grad=True)
    t = torch.randint(0, V, (N,))
    t[::5] = data.IGNORE_INDEX
    calls = []
    head.register_forward_pre_hook(lambda m, args: calls.append(args[0].shape[0]))
    chunked = loss.head_loss_sum(h, head, t, V, P.Mesh(), 8, compiled) / 30
    chunked.backward()
    assert calls == [8, 8, 8, 8, 5]
    got = h.grad.clone(), head.weight.grad.clone()
    h.grad = head.weight.grad = None
    whole = loss.loss_sum(head(h), t, V, P.Mesh()) / 30
    whole.backward()
    tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-2)
    torch.testing.assert_close(chunked, whole, **tol)
    for a, b in zip(got, (h.grad, head.weight.grad)):
        assert a.dtype == dtype
        torch.testing.assert_close(a, b, **tol)
    with torch.no_grad():
        torch.testing.assert_close(loss.head_loss_sum(h, head, t, V, P.Mesh(), 8) / 30, whole, **tol)


def test_the_compiled_chunk_loss_keeps_no_fp32_copy_of_the_logits():
    """Under --compile a chunk's arithmetic (loss.chunk_loss_and_grad) on bf16 logits allocates one buffer
    of their size, the bf16 gradient: no fp32 copy (at 1B, 1,024 x 128,256 x 4 bytes a chunk, written and
    read back). The target's gradient is softmax - 1 rounded once: for a confident prediction (1 - p about
    1e-4) bf16(p - 1), not bf16(p) - 1, which is 0."""
    torch.manual_seed(0)
    N, V = 64, 512
    logits, t = torch.randn(N, V).to(torch.bfloat16), torch.randint(0, V, (N,))
    logits[0, t[0]] = 16.0
    torch._dynamo.reset()  # compile afresh, so that the code is generated here
    (lsum, grad), code = run_and_get_code(torch.compile(loss.chunk_loss_and_grad, dynamic=False),
                                          logits.clone(), t, 0, V, 0, 1)
    sized = re.findall(rf"empty_strided_cpu\(\({N}, {V}\), \({V}, 1\), torch\.(\w+)\)", "\n".join(code))
    assert sized == ["bfloat16"], sized
    exact = torch.softmax(logits.float(), -1)
    exact[torch.arange(N), t] -= 1
    torch.testing.assert_close(grad.float(), exact, atol=1e-6, rtol=1e-2)
    assert 0 < -exact[0, t[0]] < 2 ** -9 and grad[0, t[0]] < 0  # (bf16(p) is 1: bf16(p) - 1 would be 0)
    torch.testing.assert_close(lsum, F.cross_entropy(logits.float(), t, reduction="sum"))


def test_context_chunks_balance_causal_work():
    """Rank r holds chunks r and 2cp-1-r: all positions exactly once, and equal causal work per rank."""
    T, cp = 64, 4
    held = [P.context_positions(T, cp, r) for r in range(cp)]
    assert torch.equal(torch.cat(held).sort().values, torch.arange(T))
    work = [int((p + 1).sum()) for p in held]  # query i attends to i + 1 keys
    assert len(set(work)) == 1, work
    # under sequence parallelism a rank's T/cp tokens are cut again over tp
    with pytest.raises(P.LayoutError, match=r"--seq-len / cp = 36/2 tokens divisible by tp 4"):
        checks.check_layout(P.Layout(tp=4, cp=2, sp=True), 8, M.ModelArgs(n_heads=8, n_kv_heads=4), 1, 36)


# ---------------------------------------------------------------------------------------------------
# Building a rank's part of the model: meta device, then only its own pieces


def test_each_rank_materializes_exactly_its_slice_of_the_whole_model():
    """For every rank of tp 2 x pp 2 (vocabulary 301, not divisible by tp), the pieces built on the meta
    device and materialized are the slices of the model built whole from the same seed, bit for bit."""
    args = M.ModelArgs(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=301, multiple_of=32)
    whole = M.Transformer(args)
    whole.init_weights(seed=7)
    full = dict(whole.named_parameters())
    for pp_rank in range(2):
        for tp_rank in range(2):
            mesh = P.Mesh(P.Layout(tp=2, pp=2), tp_rank=tp_rank, pp_rank=pp_rank, rank=pp_rank * 2 + tp_rank)
            with torch.device("meta"):
                part = M.Transformer(args)
            P.apply_pipeline(P.apply_tensor_parallel(part, mesh), mesh)
            P.materialize(part, mesh, "cpu", lambda name, shape: M.init_tensor(args, name, shape, 7))
            names = [n for n, _ in part.named_parameters()]
            # 2 layers of 9 weights each, plus the embedding (first stage) or the final norm and head (last)
            assert len(names) == 2 * 9 + (1 if pp_rank == 0 else 2)
            for name, p in part.named_parameters():
                dim = part.tp_placement.get(name, (None,))[0]
                if dim is None:
                    expected = full[name]
                else:
                    padded = full[name]
                    if name in ("tok_embeddings.weight", "output.weight"):  # 301 rows -> 302, zero padded
                        padded = torch.cat([padded, torch.zeros(1, args.dim)])
                    expected = padded.chunk(2, dim=dim)[tp_rank]
                assert torch.equal(p, expected), (pp_rank, tp_rank, name)


@pytest.mark.parametrize("tp", [1, 2])
def test_materialized_tied_head_is_the_embedding(tp):
    """Llama 3.2's tied embeddings stay one tensor through meta -> materialize (to_empty unties them)."""
    args = M.ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=301, multiple_of=32,
                       tie_embeddings=True)
    mesh = P.Mesh(P.Layout(tp=tp), tp_rank=tp - 1, rank=tp - 1)
    with torch.device("meta"):
        part = M.Transformer(args)
    P.apply_pipeline(P.apply_tensor_parallel(part, mesh), mesh)
    P.materialize(part, mesh, "cpu", lambda name, shape: M.init_tensor(args, name, shape, 3))
    assert part.output.weight is part.tok_embeddings.weight
    assert "output.weight" not in dict(part.named_parameters())  # one tensor, one optimizer entry


def test_a_rank_reads_only_its_own_weights_from_a_hugging_face_folder(tmp_path, monkeypatch):
    """sft.py/dpo.py --init from a Hugging Face folder: the state is read lazily, so pipeline stage 1 of 2
    reads the files for its own two layers, the final norm and the head, and nothing else."""
    args = M.ModelArgs(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=301, multiple_of=32)
    torch.manual_seed(0)
    whole = M.Transformer(args)
    W.save_hf(whole, tmp_path / "hf")
    reads, real = [], W.read_safetensors
    monkeypatch.setattr(W, "read_safetensors", lambda path, names=None: reads.extend(names or ["*"]) or
                        real(path, names))
    margs, state = W.hf_state(tmp_path / "hf")
    assert reads == []  # checked against the config from the headers alone
    mesh = P.Mesh(P.Layout(tp=2, pp=2), tp_rank=1, pp_rank=1, rank=3)
    with torch.device("meta"):
        part = M.Transformer(margs)
    P.apply_pipeline(P.apply_tensor_parallel(part, mesh), mesh)
    P.materialize(part, mesh, "cpu", lambda name, shape: state[name])
    assert sorted(reads) == sorted(W.hf_name(n) for n, _ in part.named_parameters())
    assert all(".layers.2." in r or ".layers.3." in r or r in ("model.norm.weight", "lm_head.weight")
               for r in reads)
    full = dict(whole.named_parameters())
    for name, p in part.named_parameters():
        dim = part.tp_placement.get(name, (None,))[0]
        assert torch.equal(p, P.local_piece(full[name].detach(), p.shape, dim, mesh)), name


def test_a_rank_of_llama3_8b_holds_only_its_own_pieces():
    """tp 8 x pp 4, stage 1 (layers 8-15): the 8B model is never built whole; the rank's parameters are its
    1/8 of eight layers (norms replicated), 218M x 8 / 8 numbers, not 8B. (Uninitialized full values keep the
    test fast; the values are test_each_rank_materializes_exactly_its_slice_of_the_whole_model's subject.)"""
    args = M.PRESETS["llama3-8b"]
    mesh = P.Mesh(P.Layout(tp=8, pp=4), tp_rank=3, pp_rank=1, rank=11)
    with torch.device("meta"):
        part = M.Transformer(args)
    P.apply_pipeline(P.apply_tensor_parallel(part, mesh), mesh)
    P.materialize(part, mesh, "cpu", lambda name, shape: torch.empty(shape))
    d, kv, h = args.dim, args.n_kv_heads * args.head_dim, args.hidden_dim
    per_layer = (2 * d * d + 2 * kv * d + 3 * d * h) // 8 + 2 * d
    assert sorted(int(i) for i in part.layers) == list(range(8, 16))
    assert part.tok_embeddings is None and part.output is None
    assert sum(p.numel() for p in part.parameters()) == 8 * per_layer
    assert all(p.device.type == "cpu" for p in part.parameters())


# ---------------------------------------------------------------------------------------------------
# Whole runs: every layout gives the single-process losses and weights


TINY = ["--model", "tiny", "--n-layers", "4", "--vocab-size", "301", "--lr", "3e-3",
        "--warmup", "1", "--log-every", "1", "--eval-batches", "4", "--eval-every", "0", "--sample-tokens",
        "0", "--ckpt-every", "1000", "--loss-chunk", "48"]  # 128 tokens a micro-batch: the loss in 3 chunks
GLOBAL_BATCH = 16  # sequences per optimizer step, the same in every layout


def job(n, out_dir, *flags, steps=3, micro=4, check=True, timeout=240, extra_env=None,
        script=REPO / "train.py"):
    """`script` over TINY as a job of n processes, GLOBAL_BATCH sequences a step. A job that must succeed
    starts through multiproc.py (torchrun's variables, torch imported once); one that must fail (check=False)
    through torchrun itself, whose agent ends the job."""
    dp = n // (int(_flag(flags, "--tp", 1)) * int(_flag(flags, "--pp", 1)) * int(_flag(flags, "--cp", 1)))
    accum = GLOBAL_BATCH // (micro * dp)
    start = multiproc.command(n, script) if check else [sys.executable, "-m", "torch.distributed.run",
                                                     "--standalone", f"--nproc_per_node={n}", str(script)]
    shape = [] if "--ramp" in flags else ["--seq-len", "32", "--grad-accum", str(accum)]  # (the ramp's own)
    cmd = [*start, *TINY, *shape, "--micro-batch", str(micro), "--max-steps", str(steps), "--out-dir",
           str(out_dir), *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(extra_env or {})}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)
    if check:
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    return p


def _flag(flags, name, default):
    return flags[flags.index(name) + 1] if name in flags else default


def losses(out_dir):
    recs = [json.loads(l) for l in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in recs if "loss" in r], [r["val_loss"] for r in recs if "val_loss" in r]


def masters(out_dir):
    d = Path(out_dir) / (Path(out_dir) / "latest").read_text().strip()
    return {k: v["master"] for k, v in C.read_full_state(d)[0].items()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    job(1, out)
    return out


def assert_same_training(out, ref, tol=1e-5):
    la, va = losses(out)
    lb, vb = losses(ref)
    assert len(la) == len(lb) == 3
    for a, b in zip(la + va, lb + vb):
        assert abs(a - b) <= tol * abs(b), (la, lb, va, vb)
    wa, wb = masters(out), masters(ref)
    assert wa.keys() == wb.keys()
    for k in wb:
        assert wa[k].shape == wb[k].shape, k
        assert rel(wa[k], wb[k]) <= tol, (k, rel(wa[k], wb[k]))


LAYOUTS = [  # (processes, flags)
    (1, ["--loss-chunk", "0"]),  # the whole logits at once: the same training as the chunked loss
    (2, ["--tp", "2"]),
    (2, ["--tp", "2", "--sp"]),
    (2, ["--pp", "2", "--schedule", "1f1b"]),
    (2, ["--pp", "2", "--schedule", "afab", "--pp-layers", "3,1"]),  # an unbalanced split, by hand
    (2, []),  # dp 2
    (4, ["--tp", "2", "--pp", "2", "--sp"]),
    (4, ["--tp", "2", "--pp", "2", "--schedule", "afab"]),
    (4, ["--tp", "2", "--zero", "1"]),
    (4, ["--tp", "2", "--sp"]),
    (4, ["--pp", "2", "--schedule", "1f1b"]),
    (4, ["--pp", "2", "--schedule", "afab", "--zero", "1"]),
    (8, ["--tp", "2", "--pp", "2", "--zero", "1", "--sp"]),
    (8, ["--tp", "2", "--pp", "2", "--schedule", "afab"]),
    (2, ["--zero", "2", "--bucket-mb", "0.05"]),  # small buckets: several reduced in every micro-batch
    (4, ["--zero", "2"]),  # dp 4
    (4, ["--tp", "2", "--sp", "--zero", "2"]),  # the norms' gradients: partial over tp, in ZeRO-2's shards
    (2, ["--cp", "2"]),
    (4, ["--cp", "2", "--tp", "2", "--sp"]),
    (4, ["--cp", "2", "--pp", "2"]),
    (8, ["--cp", "2", "--tp", "2", "--pp", "2", "--zero", "1"]),  # the four dimensions at once
    (2, ["--zero", "3"]),
    (4, ["--zero", "3", "--act-ckpt"]),  # dp 4; each block's forward runs again inside its backward
    (2, ["--tp", "2", "--sp", "--act-ckpt", "selective"]),  # the matmuls' and the gathers' outputs kept
    (2, ["--cp", "2", "--act-ckpt", "selective"]),
    (4, ["--tp", "2", "--sp", "--zero", "3"]),
    (4, ["--cp", "2", "--pp", "2", "--zero", "3"]),  # ZeRO-3 over dp x cp, in a pipeline stage
    # each rank two model chunks of one layer: rank 0 layers 0 and 2, rank 1 layers 1 and 3. With pp 2 the
    # activations and gradients both travel between the same two ranks, each way
    (2, ["--pp", "2", "--schedule", "interleaved", "--virtual-stages", "2"]),
    (8, ["--pp", "2", "--schedule", "interleaved", "--virtual-stages", "2", "--tp", "2"]),  # and dp 2
    (4, ["--pp", "2", "--schedule", "interleaved", "--virtual-stages", "2", "--zero", "3"]),
]


@pytest.mark.parametrize("n,flags", LAYOUTS, ids=[f"{n}:{' '.join(f)}" for n, f in LAYOUTS])
def test_layout_matches_single_process(tmp_path, reference, n, flags):
    job(n, tmp_path, *flags)
    assert_same_training(tmp_path, reference)


@pytest.fixture(scope="module")
def dropout_reference(tmp_path_factory, reference):
    """The single-process run with --dropout 0.2: it trains otherwise than the reference (the masks act)."""
    out = tmp_path_factory.mktemp("dropout")
    job(1, out, "--dropout", "0.2")
    assert all(abs(a - b) > 1e-4 for a, b in zip(losses(out)[0][1:] + losses(out)[1],
                                                  losses(reference)[0][1:] + losses(reference)[1]))
    return out


DROPOUT_LAYOUTS = [(1, ["--act-ckpt"]), (1, ["--act-ckpt", "selective"]), (2, ["--tp", "2"]),
                   (2, ["--tp", "2", "--act-ckpt"])]


@pytest.mark.parametrize("n,flags", DROPOUT_LAYOUTS, ids=[f"{n}:{' '.join(f)}" for n, f in DROPOUT_LAYOUTS])
def test_dropout_matches_single_process_where_the_stream_is_whole(tmp_path, dropout_reference, n, flags):
    """tp ranks hold the whole residual stream and draw the masks one process draws (train.seed_dropout), and
    activation checkpointing's recompute replays them: the same training as one process with --dropout (the
    weights within 3e-5: the kept elements' 1/(1-p) scale enlarges tp's fp32 rounding differences)."""
    job(n, tmp_path, "--dropout", "0.2", *flags)
    assert_same_training(tmp_path, dropout_reference, tol=3e-5)


@pytest.fixture(scope="module")
def short_documents(tmp_path_factory):
    """A JSONL of 300 documents of 10 to 50 bytes: a 32-token sequence holds one to four of them, cut at
    either end. Single-process runs with and without --doc-mask."""
    root = tmp_path_factory.mktemp("docs")
    rng = torch.Generator().manual_seed(0)
    words = "the a of to and in is it you that he was for on are with as I his they be at one have".split()
    docs = [" ".join(words[int(i)] for i in torch.randint(len(words), (int(n),), generator=rng))
            for n in torch.randint(3, 13, (300,), generator=rng)]
    path = root / "short.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    job(1, root / "masked", "--data", str(path), "--doc-mask")
    job(1, root / "unmasked", "--data", str(path))
    return path, root / "masked", root / "unmasked"


DOC_MASK_LAYOUTS = [(2, ["--tp", "2", "--sp"]), (2, ["--cp", "2"]), (2, ["--pp", "2"]), (2, []),
                    (8, ["--cp", "2", "--tp", "2", "--pp", "2", "--zero", "1"])]


@pytest.mark.parametrize("n,flags", DOC_MASK_LAYOUTS, ids=[f"{n}:{' '.join(f)}" for n, f in DOC_MASK_LAYOUTS])
def test_document_masking_matches_single_process(tmp_path, short_documents, n, flags):
    """--doc-mask on short documents (the masks and restarted positions of each sequence's pieces: whole
    under tp and sp, its chunks under cp, its micro-batches through the pipeline, its rows over dp) gives
    the single-process run's losses and weights; and the mask is no no-op: without it they differ."""
    data_file, masked, unmasked = short_documents
    assert losses(masked)[0] != losses(unmasked)[0]
    job(n, tmp_path, "--data", str(data_file), "--doc-mask", *flags)
    assert_same_training(tmp_path, masked)


# A run that also writes, at its end, the summed log-probs of the choices of 13 PIQA items as its layout scores
# them (evaluate.request_logprobs: requests packed into rows, through the pipeline, the head at the scored
# positions only); --eval-tasks logs the accuracies from the same scores.
BENCHMARK_RUN = f"""
import json, sys
sys.path.insert(0, {str(REPO)!r})
import config, evaluate, train
args = config.get_parser().parse_args(sys.argv[1:])
run = train.train(args)
items = evaluate.read_items("piqa")[:13]
requests, _ = evaluate.choice_requests(run.tok, items, range(13), args.seq_len)
scores = evaluate.request_logprobs(run, requests)
if run.mesh.rank == 0:
    open(args.out_dir + "/scores.json", "w").write(json.dumps(scores))
"""


def benchmark_job(n, out, *flags):
    (out / "run.py").write_text(BENCHMARK_RUN)
    job(n, out / "o", "--eval-tasks", "piqa:13", *flags, script=out / "run.py")
    records = [json.loads(line) for line in (out / "o" / "metrics.jsonl").read_text().splitlines()]
    return json.loads((out / "o" / "scores.json").read_text()), [r for r in records if "piqa/acc" in r]


@pytest.fixture(scope="module")
def benchmark_reference(tmp_path_factory):
    return benchmark_job(1, tmp_path_factory.mktemp("bench"))


BENCHMARK_LAYOUTS = [(2, ["--tp", "2", "--sp"]), (2, ["--cp", "2"]), (2, ["--zero", "3"]),
                     (2, ["--pp", "2", "--schedule", "interleaved", "--virtual-stages", "2"]),
                     (8, ["--cp", "2", "--tp", "2", "--pp", "2", "--zero", "1"])]


@pytest.mark.parametrize("n,flags", BENCHMARK_LAYOUTS, ids=[f"{n}:{' '.join(f)}" for n, f in BENCHMARK_LAYOUTS])
def test_benchmarks_during_training_match_evaluate(tmp_path, benchmark_reference, n, flags):
    """--eval-tasks under each layout (dp ranks with unequal shares of the items among them): each choice's
    log-prob is what evaluate.py computes from the run's checkpoint (the whole model, one request a row),
    and the logged accuracies are the single-process run's."""
    scores, logged = benchmark_job(n, tmp_path, *flags)
    ref_scores, ref_logged = benchmark_reference
    tok = data.get_tokenizer("byte")
    items = evaluate.read_items("piqa")[:13]
    requests, cut = evaluate.choice_requests(tok, items, range(13), 32)
    model = evaluate.load_model(tmp_path / "o", tok, torch.device("cpu"), torch.float32, P.Mesh())
    whole = evaluate.score_by_length(model, requests, 8, data.Progress("piqa", len(requests), "sequences"))
    assert cut > 0 and len(scores) == len(requests) == 26  # some choices longer than the window: cut
    scores, whole, ref_scores = (torch.tensor(v, dtype=torch.float64) for v in (scores, whole, ref_scores))
    assert torch.allclose(scores, whole, rtol=1e-5, atol=1e-4)
    assert torch.allclose(scores, ref_scores, rtol=1e-4, atol=1e-3)
    assert len(logged) == 1 and {k: v for k, v in logged[0].items() if "/" in k} == {
        k: v for k, v in ref_logged[0].items() if "/" in k}


# LoRA fine-tuning (sft.py, from the seed's model): its adapters are cut with their linears under tp (one
# factor of each, the other whole with a gradient summed over tp), and trained like any weights under pp,
# cp and dp/ZeRO; every layout gives the single-process losses and adapters.
LORA_RUN = ["--lora-rank", "4", "--lora-alpha", "16", "--sample-prompt", "", "--seq-len", "64"]
LORA_LAYOUTS = [(2, ["--tp", "2"]), (2, ["--tp", "2", "--sp"]), (2, ["--pp", "2"]), (2, ["--cp", "2"]),
                (2, ["--zero", "1"]), (4, ["--tp", "2", "--zero", "2"])]


@pytest.fixture(scope="module")
def lora_reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("lora")
    job(1, out, *LORA_RUN, script=REPO / "sft.py")
    return out


@pytest.mark.parametrize("n,flags", LORA_LAYOUTS, ids=[f"{n}:{' '.join(f)}" for n, f in LORA_LAYOUTS])
def test_lora_matches_single_process(tmp_path, lora_reference, n, flags):
    job(n, tmp_path, *LORA_RUN, *flags, script=REPO / "sft.py")
    assert set(masters(tmp_path)) == set(masters(lora_reference)) and all(
        M.is_lora(name) for name in masters(tmp_path))
    # B starts at zero, so after 3 steps it is Adam's updates alone, m / sqrt(v) of gradients a layout sums
    # in another order: their rounding shows at 1e-5 of B, where the full model's weights hide it
    assert_same_training(tmp_path, lora_reference, tol=1e-4)


RAMP = ["--ramp", "0:32x16,1K:64x32"]  # step 3 is 32 sequences of 64 tokens


@pytest.mark.parametrize("n,flags", [(4, ["--tp", "2"]), (2, ["--cp", "2"]), (2, ["--pp", "2"])])
def test_a_ramp_matches_single_process(tmp_path, n, flags):
    """Across a --ramp stage (sequences twice as long, twice as many): tp 2 x dp 2, cp 2 (each stage's
    sequences cut in four) and pp 2 (the micro-batches of each stage through the pipeline) give the single
    process's losses and weights."""
    job(1, tmp_path / "one", *RAMP)
    job(n, tmp_path / "many", *RAMP, *flags)
    assert_same_training(tmp_path / "many", tmp_path / "one")


# train.py --compile with dynamo's own counters: graph breaks (every one splits a block into pieces run
# apart, with Python between them) and graphs compiled (each block has the same code: one graph, compiled
# once, the loss's arithmetic on a chunk of logits one more, and the optimizer's one-pass update one;
# config.error_on_recompile makes a second compilation an error). aot_eager: dynamo's tracing and
# autograd's joint graph, the ops run as they are, without inductor's code generation, which changes neither
# count. The counts go to $COMPILE_COUNTS from rank 0.
COUNT_COMPILES = """
import functools, json, os, sys
import torch._dynamo
from torch._dynamo.utils import counters
import config, loss, optim, parallel, train

torch._dynamo.config.error_on_recompile = True
train.compile_blocks = functools.partial(train.compile_blocks, backend="aot_eager")
loss.compiled_chunk_loss_and_grad = functools.cache(
    lambda: torch.compile(loss.chunk_loss_and_grad, backend="aot_eager", dynamic=False))
optim.compiled_adamw_pass = functools.cache(
    lambda: torch.compile(optim.adamw_pass, backend="aot_eager"))
config.run(train.main, sys.argv[1:])
if os.environ["RANK"] == "0":
    with open(os.environ["COMPILE_COUNTS"], "w") as f:
        json.dump({"breaks": dict(counters["graph_break"]), "graphs": counters["stats"]["unique_graphs"]}, f)
"""

COMPILE_LAYOUTS = [["--tp", "2"], ["--tp", "2", "--sp"], ["--cp", "2"], ["--pp", "2"],
                   ["--zero", "1", "--attn-backend", "flash"], ["--zero", "3"]]


@pytest.mark.parametrize("flags", COMPILE_LAYOUTS, ids=[" ".join(f) for f in COMPILE_LAYOUTS])
def test_compiled_blocks_are_one_graph_each(tmp_path, reference, flags):
    """Under --compile each block is one graph with no break, compiled once, in every layout, and so are the
    loss's arithmetic on a chunk of logits and the optimizer's update: the TP, SP and CP collectives inside them are custom ops the
    compiler does not look into. Their bytes are still counted
    (each step's tally is what comm_estimate counts, as eager runs' are in test_memory), and the training
    equals the single process's."""
    script = tmp_path / "count_compiles.py"
    script.write_text(COUNT_COMPILES)
    counts = tmp_path / "counts.json"
    job(2, tmp_path / "compiled", "--compile", *flags, script=script, extra_env={"COMPILE_COUNTS": str(counts)})
    tp, cp, pp, zero = (int(_flag(flags, f"--{k}", d)) for k, d in (("tp", 1), ("cp", 1), ("pp", 1),
                                                                    ("zero", 0)))
    got = json.loads(counts.read_text())  # (rank 0: no head under pp; ZeRO-3 takes the whole logits)
    assert got == {"breaks": {}, "graphs": 2 if pp > 1 or zero == 3 else 3}, got
    assert_same_training(tmp_path / "compiled", reference)
    dp = 2 // (tp * cp * pp)
    margs = config.model_args_from(config.get_parser().parse_args(TINY), 301)
    expected = costs.comm_estimate(margs, P.Layout(tp=tp, cp=cp, pp=pp, dp=dp, sp="--sp" in flags, zero=zero),
                                   costs.Shape(4, 32, "fp32", GLOBAL_BATCH // (4 * dp)), 0)
    records = [json.loads(l) for l in (tmp_path / "compiled" / "metrics.jsonl").read_text().splitlines()]
    sent = [r["comm_bytes_per_step"] for r in records if "comm_bytes_per_step" in r]
    assert len(sent) == 3
    for dim in ("tp", "cp", "pp", "dp"):
        assert all(s[dim] == pytest.approx(expected.get(dim, 0), rel=1e-3, abs=64) for s in sent), (dim, sent)


# ZeRO-1 at any accumulation, and ZeRO-2 without accumulation, add the same numbers in the same order as
# plain DP. ZeRO-2 with accumulation reduces each micro-batch's gradients, then sums them: another order,
# equal within the layouts' tolerance (LAYOUTS above). So does ZeRO-3 even without accumulation: its flat
# layout pads every unit, which moves the pieces whose squares each rank sums for the gradient norm.
@pytest.mark.parametrize("zero,micro", [(1, 4), (2, 8)])
def test_zero_is_identical_to_plain_dp(tmp_path, zero, micro):
    # small buckets: several launched during backward
    job(2, tmp_path / "dp", "--bucket-mb", "0.05", micro=micro)
    job(2, tmp_path / "zero", "--zero", str(zero), "--bucket-mb", "0.05", micro=micro)
    assert losses(tmp_path / "dp") == losses(tmp_path / "zero")
    # the checkpoints too: ZeRO's, gathered bucket by bucket from the dp ranks' pieces, equal DP's
    a, b = (C.read_full_state(Path(d) / (Path(d) / "latest").read_text().strip())[0]
            for d in (tmp_path / "dp", tmp_path / "zero"))
    for k in a:
        for key in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(a[k][key], b[k][key]), (k, key)


# train.py with every way a tensor's value reaches the host counted, when project code asks for it: .item(),
# .tolist(), bool()/float()/int() of a tensor, .cpu(), .numpy(), and costs.sync_device. On a GPU each one
# waits for the queued kernels (tests/gpu_check.py counts the real ones there).
COUNT_SYNCS = """
import collections, json, os, sys
import torch
import config, costs
import train

PROJECT = {"train.py", "model.py", "parallel.py", "zero.py", "optim.py", "data.py", "checkpoint.py", "costs.py"}
seen, counting = collections.Counter(), [False]

def counted(name, original):
    def wrapper(*args, **kwargs):
        caller = sys._getframe(1)
        if counting[0] and os.path.basename(caller.f_code.co_filename) in PROJECT:
            seen[f"{name} at {os.path.basename(caller.f_code.co_filename)}:{caller.f_lineno}"] += 1
        return original(*args, **kwargs)
    return wrapper

for name in ("item", "tolist", "__bool__", "__float__", "__int__", "cpu", "numpy"):
    setattr(torch.Tensor, name, counted(name, getattr(torch.Tensor, name)))
costs.sync_device = counted("sync_device", costs.sync_device)
step, whole = train.train_step, train.train

def first_step_starts_counting(*args, **kwargs):
    counting[0] = True
    return step(*args, **kwargs)

def train_until_it_returns(*args, **kwargs):
    try:
        return whole(*args, **kwargs)
    finally:
        counting[0] = False
        out = os.path.join(args[0].out_dir, f"syncs_rank{os.environ.get('RANK', '0')}.json")
        with open(out, "w") as f:
            json.dump(seen, f)

train.train_step, train.train = first_step_starts_counting, train_until_it_returns
config.run(train.main, sys.argv[1:])
"""

SYNC_LAYOUTS = [(1, []), (1, ["--precision", "fp16", "--skip-spikes", "3"]), (2, []), (2, ["--zero", "1"]),
                (4, ["--tp", "2", "--pp", "2", "--sp"])]


@pytest.mark.parametrize("n,flags", SYNC_LAYOUTS, ids=[f"{n}:{' '.join(f)}" for n, f in SYNC_LAYOUTS])
def test_a_step_synchronizes_host_and_device_once(tmp_path, n, flags):
    """Each optimizer step reads the device once (its tally), logging every step included, on every rank
    and layout: the fp16 overflow check, plain DP's check of every replica, the spike check and the stop
    flag ride on the same all-reduce."""
    script = tmp_path / "count_syncs.py"
    script.write_text(COUNT_SYNCS)
    job(n, tmp_path / "o", *flags, "--eval-every", "-1", "--ckpt-every", "0", steps=4, script=script,
             extra_env={"PYTHONPATH": str(REPO)})
    for rank in range(n):
        seen = json.loads((tmp_path / "o" / f"syncs_rank{rank}.json").read_text())
        [(where, times)] = seen.items() if len(seen) == 1 else [(seen, None)]
        assert times == 4 and where.startswith("tolist at train.py"), (rank, seen)


def _groups_and_patience(out_file):
    """The groups a rank of a (tp 2, dp 2) job makes, and how long its collectives wait: a peer 2.5 s late
    to an all-reduce is waited for inside patient() and is a timeout (1 s) outside it."""
    made, new_group = [], torch.distributed.new_group

    def counted(ranks, **kw):
        made.append([kw.get("group_desc"), ranks, kw.get("backend")])
        return new_group(ranks, **kw)
    torch.distributed.new_group = counted
    mesh = P.init_mesh(P.Layout(tp=2, dp=2), timeout_s=60.0, io_timeout_s=60.0)
    mesh.timeout_s = 1.0
    launch.set_timeout(mesh, mesh.timeout_s)
    out = {"made": made, "io": torch.distributed.get_backend(mesh.groups["io"])}
    t = torch.ones(4)
    for name, context in (("patient", launch.patient(mesh)), ("impatient", contextlib.nullcontext())):
        with context:
            if mesh.tp_rank == 1:
                time.sleep(2.5)
            try:
                P.all_reduce(t, mesh, "tp")
                out[name] = "ok"
            except launch.CommError as e:
                out[name] = str(e)
    Path(out_file.format(rank=mesh.rank)).write_text(json.dumps(out))


def test_a_rank_makes_only_its_own_groups_and_the_first_step_waits_longer(tmp_path):
    """At (tp 2, dp 2) each rank makes its tp and dp groups (cp and pp are 1: none) and the io group, on
    gloo whatever the backend (its timeouts end in this project's error, not NCCL's watchdog); a late
    peer is waited for under patient() (the first step's --io-timeout) and fails as a timeout after it."""
    spawn(_groups_and_patience, 4, str(tmp_path / "r{rank}.json"))
    for r in range(4):
        out = json.loads((tmp_path / f"r{r}.json").read_text())
        tp_line, dp_line = [r - r % 2, r - r % 2 + 1], [r % 2, r % 2 + 2]
        assert out["made"] == [["tp", tp_line, None], ["dp", dp_line, None], ["io", [0, 1, 2, 3], "gloo"],
                               ["ckpt", [0, 1, 2, 3], "gloo"]]  # (the background checkpoint writer's)
        assert out["io"] == "gloo" and out["patient"] == "ok", out
        if r % 2 == 0:  # the one kept waiting (the late one may find it gone, or time out itself)
            assert "all_reduce of (4,) on the tp group" in out["impatient"], out
            assert "--dist-timeout 1 s" in out["impatient"] and "stalled" in out["impatient"], out


def _timeline(out_file, zero):
    """One dp step and the next forward of a 4-block model, every collective GradSync issues (launch,
    wait) recorded in order beside the blocks' backward ends and forward starts."""
    import optim as O
    mesh = P.init_mesh()
    torch.manual_seed(0)
    args = M.ModelArgs(dim=32, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=16,
                       max_seq_len=16)
    model = M.Transformer(args)
    opt = O.AdamW(model.named_parameters(), pad_to=mesh.dp)
    sync = Z.grad_sync(opt, mesh, bucket_mb=0.01, zero=zero)  # 2,600 floats a bucket: one or two per block
    sync.prefetch_into(model)  # before the recording hooks below: a block's wait comes before its start
    events = []
    for name in ("all_reduce", "reduce_scatter", "all_gather", "all_gather_many"):
        def recorded(out, *args, name=name, launch=getattr(P, name), **kw):
            size = len(out) if isinstance(out, list) else out.numel()  # (all_gather_many: a unit's buckets)
            name = name.replace("_many", "")
            events.append(("launch", name, size))
            work = launch(out, *args, **kw)
            if work is not None:
                wait = work.wait
                work.wait = lambda: (events.append(("wait", name, size)), wait())[1]
            return work
        setattr(P, name, recorded)
    for key, block in model.layers.items():
        block.register_forward_pre_hook(lambda m, a, key=key: events.append(("forward", key)))
        block.register_full_backward_hook(lambda m, gi, go, key=key: events.append(("backward", key)))
    x, y = torch.randint(0, 64, (2, 2, 16))
    sync.start()
    (loss.loss_sum(model(x), y, 64, mesh) / (2 * 16 * mesh.dp)).backward()
    sync.finish()
    opt.step()
    sync.all_gather_params()
    events.append(("step done",))
    with torch.no_grad():
        model(x)
    Path(out_file.format(rank=mesh.rank)).write_text(json.dumps(events))


@pytest.mark.parametrize("zero", [0, 1])
def test_data_parallel_collectives_overlap_compute_in_the_same_order_on_every_rank(tmp_path, zero):
    """Gradient buckets are reduced while backward still runs (launched before the first block's backward
    ends, waited for only after the last); ZeRO-1's all-gathers, one per unit, are launched after the step
    and each is waited for just before the first block that needs it, so the later blocks' weights arrive
    while the earlier ones compute. Both ranks issue the same collectives in the same order (they must match)."""
    spawn(_timeline, 2, str(tmp_path / "r{rank}.json"), zero)
    timelines = [[tuple(e) for e in json.loads((tmp_path / f"r{r}.json").read_text())] for r in range(2)]
    ops = [[e for e in t if e[0] in ("launch", "wait")] for t in timelines]
    assert ops[0] == ops[1]
    t = timelines[0]
    end = t.index(("step done",))
    step, after = t[:end], t[end:]
    reduce = "reduce_scatter" if zero else "all_reduce"
    launches = [i for i, e in enumerate(step) if e[:2] == ("launch", reduce)]
    waits = [i for i, e in enumerate(step) if e[:2] == ("wait", reduce)]
    backward = [i for i, e in enumerate(step) if e[0] == "backward"]
    assert len(launches) == len(waits) >= 4
    assert launches[0] < backward[0] and sum(i < backward[-1] for i in launches) >= 3  # during backward
    assert min(waits) > backward[-1]  # finish() waits only once backward is done
    gathers = [i for i, e in enumerate(step) if e[:2] == ("launch", "all_gather")]
    if not zero:
        assert gathers == []
        return
    assert 4 <= len(gathers) <= 7 and min(gathers) > max(waits)  # one per unit, after the step, not waited
    forward = [i for i, e in enumerate(after) if e[0] == "forward"]
    gather_waits = [i for i, e in enumerate(after) if e[:2] == ("wait", "all_gather")]
    assert len(gather_waits) == len(gathers)
    # blocks 1-3 start only after block 0 did, and some of their buckets are waited for only then
    assert sum(i > forward[0] for i in gather_waits) >= 3


class OpCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the ops torch's dispatcher runs while active, views (no work) aside, by name; collectives are
    the "c10d." ones. Not inside a collective's wait: there gloo copies a reduce-scatter's result out
    (NCCL writes it in place)."""

    def __init__(self):
        super().__init__()
        self.ops, self.paused = {}, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and not self.paused:
            name = str(func.overloadpacket)
            self.ops[name] = self.ops.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _step_ops(out_file):
    """Everything after the backward of one dp step (gradient sync's waits, the norm, the update, the
    all-gathers' launch, zeroing), counted op by op, for each ZeRO stage and two bucket sizes."""
    import optim as O
    mesh, out = P.init_mesh(), {}
    args = M.ModelArgs(dim=64, n_layers=8, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=16,
                       max_seq_len=16)
    for zero in (0, 1, 2, 3):
        for bucket_mb in (0.02, 0.004):
            torch.manual_seed(0)
            model = M.Transformer(args).to(torch.bfloat16)
            kw = dict(allocate_state=False, full_grad=zero < 2) if zero else {}
            opt = O.AdamW(model.named_parameters(), pad_to=mesh.dp, unit_of=Z.unit_of if zero == 3 else None,
                          **kw)
            sync = Z.grad_sync(opt, mesh, bucket_mb=bucket_mb, zero=zero)
            sync.prefetch_into(model)
            x, y = torch.randint(0, 64, (2, 2, 16))
            for _ in range(2):  # the second step is counted
                sync.start()
                (loss.loss_sum(model(x), y, 64, mesh) / (2 * 16 * mesh.dp)).backward()
                counter, wait = OpCounter(), launch.Work.wait
                launch.Work.wait = lambda work: (setattr(counter, "paused", True), wait(work),
                                             setattr(counter, "paused", False))[1]
                with counter:
                    sync.finish()
                    norm = Z.grad_norm(sync, model)
                    opt.step(1e-3, grad_scale=O.clip_scale(1.0, norm))
                    sync.all_gather_params()
                    opt.zero_grad()
                launch.Work.wait = wait
            sync.wait_params()  # as train() does at its end: no all-gather outlives its model and process group
            collectives = {k: v for k, v in counter.ops.items() if k.startswith("c10d.")}
            out[f"{zero} {bucket_mb}"] = {"buckets": len(sync.buckets), "ops": sum(counter.ops.values()) - sum(
                collectives.values()), "collectives": collectives, "units": len(Z.unit_modules(model))}
    Path(out_file.format(rank=mesh.rank)).write_text(json.dumps(out))


def test_the_optimizer_side_of_a_step_is_a_few_launches_whatever_the_buckets(tmp_path):
    """After the backward a step issues the same handful of ops however many buckets the gradients are
    cut into (four times as many here): one foreach norm over every piece, one decay and one fused update
    over the owned weights, their rounding, the zeroing; ZeRO-1/2's reduce-scatters write straight into
    the packed gradient the update reads, and the updated weights go out one all-gather per bucket (on
    gloo; NCCL launches a unit's buckets as one group call, which gloo's coalesced all-gather cannot be
    trusted with: parallel.all_gather_many); ZeRO-3 gathers at the next forward."""
    spawn(_step_ops, 2, str(tmp_path / "r{rank}.json"))
    for r in range(2):
        out = json.loads((tmp_path / f"r{r}.json").read_text())
        for zero in (0, 1, 2, 3):
            few, many = out[f"{zero} 0.02"], out[f"{zero} 0.004"]
            if zero < 3:
                assert many["buckets"] >= 3 * few["buckets"] >= 30, (few, many)
            assert few["ops"] == many["ops"] <= 20, (zero, few, many)
            for counted in (few, many):
                gathers = sum(n for k, n in counted["collectives"].items() if "allgather" in k)
                assert counted["collectives"].pop("c10d.allreduce_") == 1, counted  # the norm's
                assert gathers == (0 if zero in (0, 3) else counted["buckets"]), (zero, counted)
                assert sum(counted["collectives"].values()) == gathers, counted  # and nothing else


def _zero3_against_unsharded(out_file, tied, act_ckpt, compiled):
    """A model under ZeRO-3 at dp 2 beside an unsharded copy of itself fed both ranks' batches: logits,
    gradients (this rank's pieces), and the logits after one AdamW step (in evaluation mode: eager blocks,
    when training ran compiled ones); how many units ever held whole weights at once, and how many still
    do after each phase."""
    import optim as O
    import train
    mesh = P.init_mesh()
    torch.manual_seed(0)
    args = M.ModelArgs(dim=32, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=16,
                       max_seq_len=16, tie_embeddings=tied)
    model = M.Transformer(args)
    ref = M.Transformer(args)
    ref.load_state_dict(model.state_dict())
    model.act_ckpt = ref.act_ckpt = act_ckpt
    build = lambda m, **kw: O.AdamW(m.named_parameters(), lr=1e-2, pad_to=mesh.dp, unit_of=Z.unit_of, **kw)
    opt, ref_opt = build(model, allocate_state=False, full_grad=False), build(ref)
    sync = Z.grad_sync(opt, mesh, zero=3)
    if compiled:
        train.compile_blocks(model, backend="eager")  # torch.compile's tracing, without code generation
    sync.prefetch_into(model)
    weights, most = sync.weights, [0]
    fetch = weights.fetch
    weights.fetch = lambda b: (fetch(b), most.append(len(weights.held)))
    x, y = torch.randint(0, 64, (2, 4, 16), generator=torch.Generator().manual_seed(1))  # (B=4, T) each
    mine = slice(2 * mesh.rank, 2 * mesh.rank + 2)  # this rank's half of the batch
    mean_loss = lambda m, x, y: loss.loss_sum(m(x), y, 64, mesh) / (4 * 16)
    held = {}
    logits = model(x[mine])
    held["after forward"] = len(weights.held)
    # torch stops a recomputation once it has every saved tensor, before the block's forward returns;
    # LAYOUTS trains that way. Here the forward runs to its end inside the backward, hooks and all.
    with torch.utils.checkpoint.set_checkpoint_early_stop(False):
        mean_loss(model, x[mine], y[mine]).backward()
    sync.finish()
    held["after backward"] = len(weights.held)
    mean_loss(ref, x, y).backward()
    out = {"logits": (logits - ref(x)[mine]).abs().max().item(), "held": held, "most": max(most),
           "units": len(weights.bufs), "grads": max(rel(sync.grad_of(lo, hi), ref_opt.grad[lo:hi])
                                                   for lo, hi in sync.norm_ranges)}
    opt.step()
    ref_opt.step()
    with torch.no_grad():
        out["logits after step"] = rel(model.eval()(x), ref(x))
    held["after a no-grad forward"] = len(weights.held)
    Path(out_file.format(rank=mesh.rank)).write_text(json.dumps(out))


@pytest.mark.parametrize("tied,act_ckpt,compiled", [(False, False, False), (True, True, False),
                                                     (False, False, True)])
def test_zero3_matches_its_unsharded_self(tmp_path, tied, act_ckpt, compiled):
    """ZeRO-3 alone: whole weights exist only while a unit runs (two units at a time, the one computing
    and the one prefetched; a tied head's embedding stays whole through the backward that needs it at both
    ends), and the model computes what the unsharded one does: the same logits, bit for bit (the gathered
    weights are the same numbers); gradients equal within float summation order (the ranks' halves of the
    batch are summed by the reduce-scatter); and after one step the compact model copy, regathered, gives
    the unsharded model's logits again (within the gradients' tolerance)."""
    spawn(_zero3_against_unsharded, 2, str(tmp_path / "r{rank}.json"), tied, act_ckpt, compiled)
    for r in range(2):
        out = json.loads((tmp_path / f"r{r}.json").read_text())
        assert out["logits"] == 0, out
        assert out["grads"] < 1e-6 and out["logits after step"] < 1e-6, out
        assert out["units"] == 7 - tied  # the embedding, 4 blocks, the norm, the head
        assert out["held"] == {"after forward": 0, "after backward": 0, "after a no-grad forward": 0}, out
        assert out["most"] == (3 if tied else 2), out


# ---------------------------------------------------------------------------------------------------
# Checkpoints: bit-exact resume in the same layout; resume under another layout; consolidation


def test_resume_same_layout_is_bit_exact_and_other_layouts_continue(tmp_path):
    straight, cut = tmp_path / "straight", tmp_path / "cut"
    layout = ["--tp", "2", "--pp", "2", "--zero", "1"]
    job(8, straight, *layout, "--ckpt-every", "2", steps=4)
    job(8, cut, *layout, "--ckpt-every", "2", steps=2)
    job(8, cut, *layout, "--ckpt-every", "2", "--resume", steps=4)
    assert losses(straight)[0] == losses(cut)[0]
    wa, wb = masters(straight), masters(cut)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    # the step-2 checkpoint of the (tp 2, pp 2, dp 2) run, continued on one process, at (pp 2, dp 4) and at
    # (cp 2, pp 2)
    for n, flags, micro in ((1, [], 4), (8, ["--pp", "2"], 2), (4, ["--cp", "2", "--pp", "2"], 4)):
        other = tmp_path / f"other{n}"
        other.mkdir()
        (other / "step_000002").symlink_to(cut / "step_000002")
        (other / "latest").write_text("step_000002\n")
        p = job(n, other, *flags, "--resume", steps=4, micro=micro)
        assert "written at tp 2, cp 1, pp 2, dp 2" in p.stdout
        la, lb = losses(other)[0], losses(straight)[0][2:]
        assert len(la) == 2 and all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(la, lb)), (la, lb)


def test_zero3_resumes_bit_exact_and_its_checkpoints_move_to_and_from_zero0(tmp_path):
    """A ZeRO-3 checkpoint holds what any other does (full master weights and moments per parameter name,
    gathered from the shards): resumed under ZeRO-3 it continues bit for bit; continued without ZeRO it
    gives the same losses, and a ZeRO-0 checkpoint continues under ZeRO-3 likewise (within the layouts'
    tolerance: the two add the dp ranks' gradients in another order)."""
    straight, cut, plain = tmp_path / "straight", tmp_path / "cut", tmp_path / "plain"
    job(2, straight, "--zero", "3", "--ckpt-every", "2", steps=4)
    job(2, cut, "--zero", "3", "--ckpt-every", "2", steps=2)
    job(2, cut, "--zero", "3", "--ckpt-every", "2", "--resume", steps=4)
    assert losses(straight)[0] == losses(cut)[0]
    wa, wb = masters(straight), masters(cut)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    job(2, plain, "--ckpt-every", "2", steps=2)  # ZeRO-0's own first two steps
    for name, source, zero in (("to0", cut, "0"), ("to3", plain, "3")):
        other = tmp_path / name
        other.mkdir()
        (other / "step_000002").symlink_to(source / "step_000002")
        (other / "latest").write_text("step_000002\n")
        job(2, other, "--zero", zero, "--resume", steps=4)
        la, lb = losses(other)[0], losses(straight)[0][2:]
        assert len(la) == 2 and all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(la, lb)), (name, la, lb)


def test_consolidate_to_hugging_face(tmp_path, reference):
    """A tp 2 x pp 2 checkpoint merged into one Hugging Face folder: the weights, and the tokenizer and
    special ids a base model's export records."""
    job(4, tmp_path, "--tp", "2", "--pp", "2")
    ckpt = tmp_path / (tmp_path / "latest").read_text().strip()
    subprocess.run([*multiproc.command(0, REPO / "checkpoint.py"), "consolidate", str(tmp_path),
                    "--hf", str(tmp_path / "hf")], check=True, cwd=REPO)
    hf = helpers.load_hf(tmp_path / "hf")
    ref, merged = masters(reference), hf.state_dict()
    for k, v in ref.items():
        assert rel(merged[k], v) <= 1e-5, k
    assert hf.args.vocab_size == 301 and ckpt.name == "step_000003"
    tok = data.get_tokenizer("byte")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    generation = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert (config["tokenizer"], config["bos_token_id"], config["eos_token_id"]) == (
        "byte", data.bos_id(tok), data.eos_id(tok)) == ("byte", 256, 257)
    assert generation == {"bos_token_id": 256, "eos_token_id": 257, "pad_token_id": data.pad_id(tok)}


def test_consolidate_averages_the_last_checkpoints_of_one_run(tmp_path, capsys):
    """--average-last 3: every weight of the export is the mean of the last three checkpoints' (written
    under tp 2, read whole); fewer intact checkpoints than asked, or one of another run among them, is
    refused in one line and nothing is written."""
    out = tmp_path / "run"
    job(2, out, "--tp", "2", "--ckpt-every", "1", "--keep-ckpts", "3", steps=4)
    hf = tmp_path / "hf"
    assert C.main(["consolidate", str(out), "--hf", str(hf), "--average-last", "3"]) == 0
    assert "(the mean of step_000004, step_000003, step_000002)" in capsys.readouterr().out
    states = [C.read_full_state(out / f"step_00000{i}")[0] for i in (2, 3, 4)]
    averaged = helpers.load_hf(hf).state_dict()
    for name in states[0]:
        want = torch.stack([s[name]["master"] for s in states]).mean(dim=0)
        assert torch.allclose(averaged[name], want, atol=1e-7), name
    assert not torch.equal(averaged["norm.weight"], states[-1]["norm.weight"]["master"])
    # the command where it was documented first, `python parallel.py consolidate`, runs checkpoint.py's
    p = subprocess.run([*multiproc.command(0, REPO / "checkpoint.py"), "consolidate", str(out), "--hf",
                        str(tmp_path / "hf2"), "--average-last", "3"], capture_output=True, text=True)
    assert p.returncode == 0 and helpers.load_hf(tmp_path / "hf2").state_dict().keys() == averaged.keys(), p.stderr
    for argv, message in ((["--average-last", "4"], "holds 3 intact checkpoint(s), fewer than the 4"),
                          (["--average-last", "2"], "are not of one run")):
        if argv[1] == "2":  # another seed's checkpoint, newest in the folder
            job(1, tmp_path / "other", "--seed", "7", steps=5)
            shutil.copytree(tmp_path / "other" / "step_000005", out / "step_000005")
        assert C.main(["consolidate", str(out), "--hf", str(tmp_path / "no"), *argv]) == 1
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
        assert not (tmp_path / "no").exists()


# ---------------------------------------------------------------------------------------------------
# Communication accounting against GUIDE section 2


def _comm(out_file, tp, pp, dp, sp):
    """One training step's collectives, per rank, for a model with known shapes."""
    import optim as O
    mesh = mesh_of(tp=tp, pp=pp, sp=sp)
    torch.manual_seed(0)
    args = M.ModelArgs(dim=32, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=16,
                       max_seq_len=64)
    model = M.Transformer(args)
    P.apply_tensor_parallel(model, mesh)
    P.apply_pipeline(model, mesh)
    opt = O.AdamW(model.named_parameters(), pad_to=dp)
    sync = Z.GradSync(opt, mesh, bucket_mb=0.01)
    B, T, m = 2, 16, 4
    batches = [(torch.randint(0, 64, (B, T)), torch.randint(0, 64, (B, T))) for _ in range(m)]
    loss_fn = lambda logits, y: loss.loss_sum(logits, y, 64, mesh) / (m * B * T * dp)
    before = dict(mesh.comm_bytes)
    if pp > 1:
        P.pipeline_step(model, batches, mesh, T, loss_fn, before_last_backward=sync.start)
    else:
        for i, (x, y) in enumerate(batches):
            if i == m - 1:
                sync.start()
            loss_fn(model(x), y).backward()
    sync.finish()
    grad_bytes = opt.numel * 4
    after = {k: mesh.comm_bytes[k] - before[k] for k in before}
    Path(out_file.format(rank=mesh.rank)).write_text(json.dumps(
        {"comm": after, "grad_bytes": grad_bytes, "pp_rank": mesh.pp_rank, "B": B, "T": T, "m": m,
         "d": args.dim, "L_stage": len(model.layers), "first": mesh.first_stage, "last": mesh.last_stage}))


@pytest.mark.parametrize("tp,pp,dp", [(2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 2)])
def test_communication_bytes_match_formulas(tmp_path, tp, pp, dp):
    spawn(_comm, tp * pp * dp, str(tmp_path / "r{rank}.json"), tp, pp, dp, False)
    for f in tmp_path.glob("r*.json"):
        r = json.loads(f.read_text())
        c, B, T, m, d = r["comm"], r["B"], r["T"], r["m"], r["d"]
        act = B * T * d * 4  # one fp32 activation of the residual stream, per micro-batch
        # DP (ring all-reduce): each rank sends 2(dp-1)/dp of its gradient bytes, once per step
        assert c["dp"] == pytest.approx(2 * (dp - 1) / dp * r["grad_bytes"])
        # PP: B*T*d per micro-batch per stage boundary, forward to the next stage and back to the previous
        sends = (0 if r["last"] else 1) + (0 if r["first"] else 1)
        assert c["pp"] == pytest.approx(sends * m * act)
        # TP: per layer per micro-batch 2 all-reduces of B*T*d forward and 2 backward; plus the embedding's
        # forward all-reduce and the final norm's backward one (first / last stage), and the vocab-parallel
        # cross-entropy's all-gather of B*T numbers from each rank ((tp - 1) B T sent: tp / 2 all-reduces'
        # worth) and all-reduce of B*T numbers (last stage)
        ring = 2 * (tp - 1) / tp
        expected = m * ring * (4 * r["L_stage"] * act + (act if r["first"] else 0)
                               + (act + (tp / 2 + 1) * B * T * 4 if r["last"] else 0))
        assert c["tp"] == pytest.approx(expected)


# ---------------------------------------------------------------------------------------------------
# Bad layouts and failing ranks end the job with one message, never a hang


@pytest.mark.parametrize("n,flags,message", [
    (3, ["--tp", "2"], "world size 3 is not divisible by tp*cp*pp = 2*1*1 = 2"),
    (2, ["--cp", "2", "--seq-len", "30"], "context parallelism needs --seq-len 30 divisible by 2*cp = 4"),
    (2, ["--tp", "2", "--n-kv-heads", "1"], "n_kv_heads 1 is not divisible by tp 2"),
    (4, ["--pp", "4", "--n-layers", "3"], "pp 4 stages need at least 4 layers, the model has 3"),
    (2, ["--pp", "2", "--schedule", "1f1b"], "1F1B needs at least as many micro-batches"),
    (2, ["--pp", "2", "--virtual-stages", "2"], "--schedule 1f1b with --virtual-stages 2: the interleaved"),
    (2, ["--pp", "2", "--schedule", "interleaved", "--virtual-stages", "2"],
     "the interleaved schedule needs --grad-accum 1 divisible by pp 2"),
])
def test_invalid_layouts_are_refused_before_any_collective(tmp_path, n, flags, message):
    micro = 16 if "1F1B" in message or "--grad-accum 1" in message else 4  # 16 x 1 micro-batch
    t0 = time.time()
    p = job(n, tmp_path / "o", *flags, micro=micro, check=False, timeout=120)
    assert p.returncode != 0 and time.time() - t0 < 90
    errors = [l for l in p.stderr.splitlines() if l.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], p.stderr[-3000:]
    assert not (tmp_path / "o").exists()


def test_one_failing_rank_ends_the_job(tmp_path):
    """An exception in one pipeline stage of a 4-process job: torchrun stops every rank within seconds and
    the failing rank's message is in the output."""
    script = tmp_path / "fail.py"
    script.write_text(textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(REPO)!r})
        import config, parallel, train
        import model
        real = model.Transformer.forward
        def broken(self, *a, **k):
            if int(os.environ["RANK"]) == 3:
                raise RuntimeError("stage 1 exploded on rank 3")
            return real(self, *a, **k)
        model.Transformer.forward = broken
        config.run(train.main, sys.argv[1:])
    """))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", str(script),
           *TINY, "--seq-len", "32", "--pp", "2", "--micro-batch", "4", "--grad-accum", "2",
           "--max-steps", "3",
           "--out-dir", str(tmp_path / "o"), "--dist-timeout", "30"]
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ,
                                                                              "OMP_NUM_THREADS": "1"})
    assert p.returncode != 0
    assert time.time() - t0 < 60
    assert "stage 1 exploded on rank 3" in p.stderr


@pytest.mark.parametrize("shared", [False, True])
def test_every_data_cache_is_prepared_once_by_one_process(tmp_path, shared):
    """Two nodes (two torchrun agents on this host, 2 processes each). With a DATA_CACHE per node, as nodes
    without a shared disk have, each cache is tokenized once, by one process, while the other waits
    (not by both at once into one folder); with one shared cache, it is tokenized once in all."""
    script, log = tmp_path / "count.py", tmp_path / "tokenized"
    script.write_text(textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(REPO)!r})
        import config, data, train
        real = data._tokenize_split
        def counted(docs, enc, out, split, *rest):
            with open({str(log)!r}, "a") as f:
                f.write(f"{{os.environ['DATA_CACHE']}} {{os.environ['RANK']}} {{split}}\\n")
            return real(docs, enc, out, split, *rest)
        data._tokenize_split = counted
        config.run(train.main, sys.argv[1:])
    """))
    port = free_port()
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
                               "--nproc_per_node=2",
                               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
                               "--rdzv-id=two-nodes",
                               str(script), *TINY, "--seq-len", "32", "--micro-batch", "4", "--max-steps", "2",
                               "--out-dir", str(tmp_path / "o")],
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1",
                                   "DATA_CACHE": str(tmp_path / f"cache{0 if shared else i}")})
             for i in range(2)]
    results = [node.communicate(timeout=240) for node in nodes]
    assert all(node.returncode == 0 for node in nodes), results[0][1][-2000:] + results[1][1][-2000:]
    calls = [line.split() for line in log.read_text().splitlines()]
    for cache in [str(tmp_path / "cache0")] + ([] if shared else [str(tmp_path / "cache1")]):
        tokenized_by = [(rank, split) for c, rank, split in calls if c == cache]
        assert sorted(split for _, split in tokenized_by) == ["train", "val"], calls  # once per cache
        assert len({rank for rank, _ in tokenized_by}) == 1, calls
    assert len(calls) == (2 if shared else 4)
