"""optim.py against torch.optim.AdamW, plus the schedule, clipping, master weights and loss scaling."""

import math

import pytest
import torch
import torch.utils._pytree as pytree
from torch._inductor.utils import run_and_get_code
from torch.utils._python_dispatch import TorchDispatchMode

import helpers
import model as M
import optim as O
import parallel as P
import zero as Z


def tiny_model(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    args = M.ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=50, multiple_of=16,
                       max_seq_len=32)
    return M.Transformer(args).to(dtype)


def test_matches_torch_adamw_over_10_steps_fp32():
    """Our fused update (torch's fused kernel over views of the flat buffers) against torch.optim.AdamW's
    default, unfused one (the same arithmetic in separate passes): within 1e-6 after 10 steps."""
    ours_model, ref_model = tiny_model(), tiny_model()
    opt = O.AdamW(ours_model.named_parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    decay = [p for n, p in ref_model.named_parameters() if O.decays(n, p)]
    no_decay = [p for n, p in ref_model.named_parameters() if not O.decays(n, p)]
    assert decay and no_decay
    ref = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay,
                                                                      "weight_decay": 0.0}],
                            lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    g = torch.Generator().manual_seed(1)
    for step in range(10):
        x = torch.randint(0, 50, (2, 16), generator=g)
        lr = O.lr_at(step, 1e-2, warmup=3, max_steps=10)
        for m in (ours_model, ref_model):
            M_loss = torch.nn.functional.cross_entropy(m(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
            M_loss.backward()
        opt.step(lr)
        opt.zero_grad()
        for group in ref.param_groups:
            group["lr"] = lr
        ref.step()
        ref.zero_grad()
    for (n, a), (_, b) in zip(ours_model.named_parameters(), ref_model.named_parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6, msg=n)


def test_no_decay_on_norms_and_embeddings():
    m = tiny_model()
    opt = O.AdamW(m.named_parameters(), lr=0.1, weight_decay=0.5)
    decayed = {n for i, n in enumerate(opt.names) if any(lo <= opt.offsets[i] < hi for lo,
                                                         hi in opt.decay_ranges)}
    assert "tok_embeddings.weight" not in decayed
    assert not any("norm" in n for n in decayed)
    assert "layers.0.attention.wq.weight" in decayed and "output.weight" in decayed


def test_grads_accumulate_into_fp32_buffer_and_params_are_views():
    m = tiny_model()
    opt = O.AdamW(m.named_parameters())
    x = torch.randint(0, 50, (2, 8))
    m(x).sum().backward()
    first = opt.grad.clone()
    m(x).sum().backward()
    torch.testing.assert_close(opt.grad, 2 * first)
    assert all(opt.grad_view(i).data_ptr() == p.grad.data_ptr() for i, p in enumerate(opt.params))  # in place
    i = opt.names.index("layers.0.attention.wq.weight")
    assert m.layers["0"].attention.wq.weight.data_ptr() == opt.master[opt.offsets[i]:].data_ptr()


def test_bf16_grads_accumulate_in_fp32():
    m = tiny_model(dtype=torch.bfloat16)
    opt = O.AdamW(m.named_parameters())
    x = torch.randint(0, 50, (2, 8))
    m(x).float().sum().backward()
    first = opt.grad.clone()
    m(x).float().sum().backward()
    torch.testing.assert_close(opt.grad, 2 * first)
    assert opt.grad.dtype == torch.float32 and all(p.grad is None for p in m.parameters())


def test_bf16_master_weights_keep_updates_below_bf16_resolution():
    m = tiny_model(dtype=torch.bfloat16)
    opt = O.AdamW(m.named_parameters(), lr=1e-5, weight_decay=0.0)
    w = m.norm.weight  # exactly 1.0; bf16 spacing at 1.0 is 2^-7, far above lr
    for _ in range(3):
        opt.grad.fill_(1.0)
        opt.step()
    i = opt.names.index("norm.weight")
    master = opt.master[opt.offsets[i]:opt.offsets[i] + w.numel()]
    torch.testing.assert_close(master, torch.full_like(master, 1 - 3e-5), atol=1e-7, rtol=0)
    assert w.dtype == torch.bfloat16 and torch.all(w == 1.0)  # the bf16 copy cannot show it yet


def test_clip_grad_norm_uses_global_norm():
    m = tiny_model()
    opt = O.AdamW(m.named_parameters())
    opt.grad.normal_()
    norm = opt.grad.norm().item()
    before = helpers.clip_grad_norm(opt, 1.0)
    assert before.item() == pytest.approx(norm)
    assert opt.grad.norm().item() == pytest.approx(1.0, rel=1e-5)
    helpers.clip_grad_norm(opt, 10.0)  # below the threshold: unchanged
    assert opt.grad.norm().item() == pytest.approx(1.0, rel=1e-5)


@pytest.mark.parametrize("max_norm", [1.0, 1e5, 0.0])
def test_clipping_inside_the_step_equals_clipping_first(max_norm):
    """step(grad_scale=clip_scale(...)) divides the gradients as the fused kernel reads them: the same update
    as clip_grad_norm then step, within float rounding; above the threshold and with clipping off, no
    scaling at all (the same bits)."""
    opts = [O.AdamW(tiny_model().named_parameters(), lr=1e-2) for _ in range(3)]
    for size in (10.0, 1e-4):  # a step clipped at max_norm 1, then one below it: Adam sees the difference
        for opt in opts:
            opt.grad.copy_(size * torch.randn(opt.numel, generator=torch.Generator().manual_seed(0)))
        norm = opts[0].grad_norm()
        helpers.clip_grad_norm(opts[0], max_norm, norm)
        opts[0].step()
        opts[1].step(grad_scale=O.clip_scale(max_norm, norm))
        opts[2].step()  # unclipped
    if max_norm == 1.0:
        torch.testing.assert_close(opts[1].master, opts[0].master, atol=1e-7, rtol=1e-6)
        assert (opts[1].master - opts[2].master).abs().max() > 1e-5  # (rounding: ~1e-9)
    else:
        assert torch.equal(opts[1].master, opts[0].master)


def test_lr_schedule():
    assert O.lr_at(0, 1.0, 10, 100) == pytest.approx(0.1)
    assert O.lr_at(9, 1.0, 10, 100) == pytest.approx(1.0)
    assert O.lr_at(10, 1.0, 10, 100) == pytest.approx(1.0)
    assert O.lr_at(55, 1.0, 10, 100) == pytest.approx(0.1 + 0.9 * 0.5)
    assert O.lr_at(100, 1.0, 10, 100) == pytest.approx(0.1)
    assert O.lr_at(500, 1.0, 10, 100, min_lr_ratio=0.0) == 0.0
    lrs = [O.lr_at(s, 1.0, 10, 100) for s in range(10, 101)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))


def test_annealing_falls_linearly_to_zero_at_the_last_step():
    """From anneal_from on, a straight line from the schedule's value there to 0 at step max_steps - 1."""
    start = O.lr_at(55, 1.0, 10, 100)
    lrs = [O.lr_at(s, 1.0, 10, 100, anneal_from=55) for s in range(100)]
    assert lrs[:56] == [O.lr_at(s, 1.0, 10, 100) for s in range(56)]  # the schedule, up to where it starts
    assert lrs[99] == 0 and lrs[77] == pytest.approx(start / 2)
    assert [O.lr_at(s, 1.0, 10, 100, anneal_from=99) for s in (98, 99)] == [O.lr_at(98, 1.0, 10, 100), 0]


def test_loss_scaler_skips_overflow_and_recovers():
    m = tiny_model(dtype=torch.float16)
    opt = O.AdamW(m.named_parameters())
    scaler = O.LossScaler(init_scale=1024.0, growth_interval=2)
    finite = lambda: bool(torch.isfinite(opt.grad).all())
    opt.grad.fill_(float("inf"))
    scaler.unscale(opt)
    assert not scaler.update(finite()) and scaler.scale == 512.0
    opt.grad.fill_(512.0)
    scaler.unscale(opt)
    assert scaler.update(finite()) and torch.all(opt.grad == 1.0) and scaler.scale == 512.0
    opt.grad.fill_(1.0)
    scaler.unscale(opt)
    assert scaler.update(finite()) and scaler.scale == 1024.0


def test_state_dict_round_trip_is_exact():
    m = tiny_model()
    opt = O.AdamW(m.named_parameters(), lr=1e-2)
    x = torch.randint(0, 50, (2, 8))
    for _ in range(2):
        m(x).sum().backward()
        opt.step()
        opt.zero_grad()
    state = {k: v for k, v in opt.state_dict().items()}
    m2 = tiny_model(seed=5)
    opt2 = O.AdamW(m2.named_parameters(), lr=1e-2)
    opt2.load_state_dict(state)
    assert opt2.step_count == 2
    assert torch.equal(opt2.master, opt.master) and torch.equal(opt2.exp_avg_sq, opt.exp_avg_sq)
    for a, b in zip(m.parameters(), m2.parameters()):
        assert torch.equal(a, b)
    assert math.isfinite(opt.grad_norm().item())


def test_sharded_owner_updates_exactly_its_ranges():
    """ZeRO-1's building block: two optimizers owning complementary ranges, each applying its update to the
    flat model copy, together equal one optimizer owning everything."""
    full_model, a_model, b_model = tiny_model(), tiny_model(), tiny_model()
    full = O.AdamW(full_model.named_parameters(), lr=1e-2, pad_to=4)
    a = O.AdamW(a_model.named_parameters(), lr=1e-2, pad_to=4)
    b = O.AdamW(b_model.named_parameters(), lr=1e-2, pad_to=4)
    n = full.numel
    cuts = [0, n // 4, n // 2, 3 * n // 4, n]  # interleaved ownership, crossing the decay boundary
    a.shard([(cuts[0], cuts[1]), (cuts[2], cuts[3])])
    b.shard([(cuts[1], cuts[2]), (cuts[3], cuts[4])])
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        grad = torch.randn(n, generator=g)
        full.grad.copy_(grad)
        full.step()
        for opt in (a, b):
            O.pack(opt.ranges, grad, opt.grad_shard)  # what the reduce-scatter does
            opt.step()
        merged = a.model_flat.clone()
        O.unpack(b.ranges, b.master, merged)
        torch.testing.assert_close(merged, full.model_flat, atol=0, rtol=0)
        a.model_flat.copy_(merged)  # what the all-gather does
        b.model_flat.copy_(merged)


class Allocations(TorchDispatchMode):
    """Counts the bytes of every tensor storage created while active: an op's outputs whose storage none
    of its inputs shares (views and in-place ops create none). The total bounds the peak from above."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        storage = lambda t: t.untyped_storage().data_ptr()
        inputs = {storage(t) for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        created = {storage(t): t.untyped_storage().nbytes() for t in pytree.tree_leaves(out)
                   if isinstance(t, torch.Tensor) and storage(t) not in inputs}
        self.bytes += sum(created.values())
        return out


def state_bytes(opt) -> int:
    own = [opt.exp_avg, opt.exp_avg_sq, opt._step] + ([opt.master] if opt.master is not opt.model_flat
                                                      else [])
    return sum(t.numel() * t.element_size() for t in own)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero1_allocates_only_this_ranks_share_of_the_optimizer_state(dtype):
    """At dp 4 under ZeRO-1 a rank keeps a quarter of the optimizer state (of a flat length padded to a
    multiple of 4 x 16; dp 1's to 16), and never allocates more: everything built (the full-length
    gradient and model buffers, the state, the packed pieces of the reduced gradient) adds up to exactly
    what is kept."""
    kept, owned, numel = {}, {}, {}
    for dp in (1, 4):
        model = tiny_model(dtype=dtype)
        with Allocations() as built:
            opt = O.AdamW(model.named_parameters(), lr=1e-2, pad_to=dp, allocate_state=False)
            Z.grad_sync(opt, P.Mesh(P.Layout(dp=dp), dp_rank=1), bucket_mb=0.001, zero=1)  # shards the optimizer
        n = opt.numel
        kept[dp] = state_bytes(opt)
        pieces = opt.grad_shard.numel() * 4 if opt.grad_shard is not opt.grad else 0  # ZeRO's reduced pieces
        full_length = n * 4 + n * opt.model_flat.element_size()  # gradient (fp32) and model copy
        assert built.bytes == full_length + kept[dp] + pieces, (dp, built.bytes, full_length, kept[dp],
                                                                pieces)
        owned[dp], numel[dp] = sum(t.numel() for t in (opt.master, opt.exp_avg, opt.exp_avg_sq)), n
    # master, m and v: a quarter each (in fp32 at dp 1 the master is the model copy itself)
    assert owned[4] * 4 == 3 * numel[4] and owned[1] == 3 * numel[1] and 0 <= numel[4] - numel[1] < 64


def test_loading_a_sharded_state_builds_no_full_length_buffer():
    """Resume under ZeRO-1 copies each parameter's state straight into the owned ranges: what it allocates
    is far below one full-length fp32 buffer, and the ranges hold exactly the saved values."""
    source = tiny_model()
    full = O.AdamW(source.named_parameters(), lr=1e-2, pad_to=4)
    x = torch.randint(0, 50, (2, 8))
    source(x).sum().backward()
    full.step()
    saved = full.state_dict()
    opt = O.AdamW(tiny_model(seed=3).named_parameters(), lr=1e-2, pad_to=4, allocate_state=False)
    Z.grad_sync(opt, P.Mesh(P.Layout(dp=4), dp_rank=2), bucket_mb=0.001, zero=1)
    with Allocations() as loading:
        opt.load_state_dict(saved)
    assert loading.bytes < opt.numel * 4 // 4  # the old way made three full-length fp32 buffers
    for key in ("master", "exp_avg", "exp_avg_sq"):
        expected = torch.empty_like(getattr(opt, key))
        O.pack(opt.ranges, getattr(full, key), expected)
        assert torch.equal(getattr(opt, key), expected), key
    assert torch.equal(opt.model_flat, full.model_flat)


@pytest.mark.parametrize("dtype,sharded", [(torch.bfloat16, False), (torch.float32, False), (torch.bfloat16, True)],
                         ids=["bf16", "fp32", "bf16-zero1"])
def test_the_compiled_one_pass_step_equals_the_eager_step(dtype, sharded):
    """compile()'s step (one compiled pass a stretch: decay, update and the model copy's refresh) against
    the eager step (a foreach decay, torch's fused kernel, a copy): the master weights and moments within
    float error after four steps with a changing lr and clipping, decay where the eager step decays (a
    norm decayed by mistake would be off by lr x 0.1 of itself, 1e4 times the tolerance), the model copy
    the master rounded, and under ZeRO-1's interleaved ranges the ranges it does not own untouched."""
    eager, one_pass = (O.AdamW(tiny_model(dtype=dtype).named_parameters(), lr=1e-2, pad_to=4) for _ in range(2))
    one_pass.compile()
    n = eager.numel
    if sharded:  # two of four ranges, crossing decay boundaries: the model copy stays full-length
        for opt in (eager, one_pass):
            opt.shard([(0, n // 4), (n // 2, 3 * n // 4)])
    before = one_pass.model_flat.clone()
    g = torch.Generator().manual_seed(0)
    for step in range(4):
        grad = torch.randn(n, generator=g)
        for opt in (eager, one_pass):
            O.pack(opt.ranges, grad, opt.grad_shard)
            opt.step(O.lr_at(step, 1e-2, 2, 4), grad_scale=torch.tensor(1.5) if step % 2 else None)
    for key in ("master", "exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(getattr(one_pass, key), getattr(eager, key), rtol=1e-6, atol=1e-7, msg=key)
    owned = torch.empty_like(one_pass.master, dtype=dtype)
    O.pack(one_pass.ranges, one_pass.model_flat, owned)
    assert torch.equal(owned, one_pass.master.to(dtype))
    O.unpack(one_pass.ranges, one_pass.master.to(dtype), before)  # what it owns updated, the rest as it was
    assert torch.equal(one_pass.model_flat, before)


def test_the_compiled_step_is_one_kernel_and_allocates_nothing():
    """The code torch.compile makes of the one-pass step (bf16: master, m, v and the model copy written)
    runs one kernel and allocates no buffer: a temporary of the updated weights would be as large as the
    state (4 bytes a parameter, 5 GB at 1B) and cost a write and a read of its own."""
    opt = O.AdamW(tiny_model(dtype=torch.bfloat16).named_parameters(), lr=1e-2)
    opt.compile()
    opt.grad.normal_()
    torch._dynamo.reset()  # compile afresh, so that the code is generated here
    _, code = run_and_get_code(opt.step, 1e-3)
    code = "\n".join(code)
    assert code.count("async_compile.cpp_pybinding(") == 1, code
    assert "empty_strided" not in code.split("def call(")[1], code
