"""A mixture of experts (model.MoE): exact sizes, and parity with Hugging Face's MixtralForCausalLM (an
independent implementation): logits, the load-balancing loss and its gradient, weights both ways."""

import json
import re

import pytest
import torch
import torch.nn.functional as F

import costs
import data
import helpers
import model as M
import multiproc
import weights as W
from conftest import REPO

transformers = pytest.importorskip("transformers")  # test-only dependency: requirements-test.txt


def test_mixtral_8x7b_counts_its_parameters_exactly():
    """46.7B in all, 12.9B a token meets (top 2 of 8 experts): Mixtral's published sizes, to the parameter."""
    args = M.PRESETS["mixtral-8x7b"]
    with torch.device("meta"):
        model = M.Transformer(args)
    assert sum(p.numel() for p in model.parameters()) == costs.count_params(args) == 46_702_792_704
    assert costs.count_params(args, active=True) == 12_879_925_248
    for name in ("moe-tiny", "moe-mini"):  # the CPU sizes: as many active parameters as tiny and mini
        a, dense = M.PRESETS[name], M.PRESETS[name.removeprefix("moe-")]
        assert costs.count_params(a, active=True) - a.moe_layers * a.dim * a.n_experts == costs.count_params(dense)


def test_moe_every_second_layer_interleaves_dense_and_mixture_layers():
    args = M.ModelArgs(dim=32, n_layers=4, n_heads=4, vocab_size=64, n_experts=4, top_k=1, moe_every=2)
    model = M.Transformer(args)
    kinds = [type(model.layers[str(i)].feed_forward).__name__ for i in range(4)]
    assert kinds == ["FeedForward", "MoE", "FeedForward", "MoE"]
    assert sum(p.numel() for p in model.parameters()) == costs.count_params(args)


@pytest.mark.parametrize("fields,message", [
    (dict(n_experts=1), "n_experts must be 0 (a dense model) or 2 to 4096, got 1"),
    (dict(n_experts=4, top_k=5), "top_k must be 1 to n_experts 4, got 5"),
    (dict(n_experts=4, moe_every=0), "moe_every must be 1 to n_layers 2, got 0"),
    (dict(n_experts=4, expert_hidden=0), "expert_hidden must be null or a positive integer, got 0")])
def test_impossible_experts_are_one_value_error(fields, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        M.ModelArgs(dim=32, n_layers=2, n_heads=4, vocab_size=64, **fields)


def hf_mixtral(layers: int = 2, coef: float = 0.02):
    cfg = transformers.MixtralConfig(
        vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=128,
        rms_norm_eps=1e-5, rope_theta=1e6, router_aux_loss_coef=coef, tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = transformers.MixtralForCausalLM(cfg).eval()
    with torch.no_grad():  # norms and routers away from their initial values, so both are really tested
        for n, p in hf.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
            elif "gate.weight" in n:
                p.normal_(0.0, 0.5)
    return hf


def test_mixtral_from_transformers_gives_its_logits_and_round_trips(tmp_path):
    hf = hf_mixtral()
    hf.save_pretrained(tmp_path / "hf")
    ours = helpers.load_hf(tmp_path / "hf").eval()
    assert (ours.args.n_experts, ours.args.top_k, ours.args.expert_dim) == (4, 2, 80)
    tokens = torch.randint(0, 96, (3, 40))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), hf(tokens).logits, atol=2e-5, rtol=2e-5)
    W.save_hf(ours, tmp_path / "back")  # ours -> a Mixtral folder: the same tensors, loadable by transformers
    again = W.read_safetensors(tmp_path / "back" / "model.safetensors")
    theirs = W.read_safetensors(tmp_path / "hf" / "model.safetensors")
    assert again.keys() == theirs.keys() and all(torch.equal(again[k], v) for k, v in theirs.items())
    hf2 = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        torch.testing.assert_close(hf2(tokens).logits, hf(tokens).logits, atol=0, rtol=0)


def test_the_load_balancing_loss_is_mixtrals_layer_by_layer(tmp_path):
    """Each layer's loss is transformers' load_balancing_loss_func on that layer's router logits (which
    pools the layers' counts before the product when given them all: ours is Switch Transformer's sum of
    one term per layer, which each pipeline stage computes for its own)."""
    hf = hf_mixtral(layers=2)
    hf.save_pretrained(tmp_path / "hf")
    ours = helpers.load_hf(tmp_path / "hf").train()
    tokens = torch.randint(0, 96, (2, 24))
    with torch.no_grad():
        router_logits = hf(tokens, output_router_logits=True).router_logits
        ours(tokens)
    func = transformers.models.mixtral.modeling_mixtral.load_balancing_loss_func
    per_layer = [func((r,), 4, 2) for r in router_logits]
    aux, _, count = M.moe_stats(ours).tolist()
    assert count == 2 and aux == pytest.approx(sum(per_layer).item(), rel=1e-5)
    assert M.moe_stats(ours) is None  # read once: cleared


def test_the_load_balancing_loss_trains_the_router_as_transformers_does(tmp_path):
    """One MoE layer (where the pooled and per-layer losses agree): ours, its AuxLoss weighted by the
    coefficient, gives every parameter the gradient of transformers' cross-entropy + coef x aux loss."""
    hf = hf_mixtral(layers=1, coef=0.5)
    hf.save_pretrained(tmp_path / "hf")
    ours = helpers.load_hf(tmp_path / "hf").train()
    hf.train()
    tokens = torch.randint(0, 96, (2, 24))
    out = hf(tokens, labels=tokens, output_router_logits=True)
    out.loss.backward()
    M.set_moe_aux(ours, 0.5)
    logits = ours(tokens)
    F.cross_entropy(logits[:, :-1].reshape(-1, 96), tokens[:, 1:].reshape(-1)).backward()
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, hf_grad(hf, name), atol=1e-6, rtol=1e-4, msg=name)
    assert ours.layers["0"].feed_forward.gate.weight.grad.abs().sum() > 0


def hf_grad(hf, ours: str) -> torch.Tensor:
    """The gradient transformers holds for our parameter `ours`: in memory it keeps a layer's experts as
    two stacked tensors, mlp.experts.gate_up_proj (E, 2 x hidden, dim: w1's rows, then w3's) and
    down_proj (E, dim, hidden); its router is mlp.gate."""
    theirs = dict(hf.named_parameters())
    if ".feed_forward." not in ours:
        return theirs[W.hf_name(ours)].grad
    layer, rest = ours.split(".")[1], ours.split(".feed_forward.")[1]
    mlp = f"model.layers.{layer}.mlp."
    if rest == "gate.weight":
        return theirs[mlp + "gate.weight"].grad
    _, e, w, _ = rest.split(".")
    if w == "w2":
        return theirs[mlp + "experts.down_proj"].grad[int(e)]
    gate, up = theirs[mlp + "experts.gate_up_proj"].grad[int(e)].chunk(2)
    return gate if w == "w1" else up


def test_a_mixture_in_one_layer_of_two_has_no_hugging_face_form():
    args = M.ModelArgs(dim=32, n_layers=2, n_heads=4, vocab_size=64, n_experts=4, moe_every=2)
    with pytest.raises(ValueError, match="experts in every layer, this model in one of every 2"):
        W.hf_config(args)


# ---------------------------------------------------------------------------------------------------
# Training: the loss and the load balance logged, and the single process's run under dp, pp and ZeRO-1

from test_parallel import assert_same_training, job  # noqa: E402  (the parity harness of every layout)

MOE = ["--model", "moe-tiny", "--moe-aux-coef", "0.05"]


@pytest.fixture(scope="module")
def moe_reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("moe_single")
    job(1, out, *MOE)
    return out


def moe_records(out_dir):
    return [r for r in map(json.loads, (out_dir / "metrics.jsonl").read_text().splitlines()) if "moe_aux" in r]


def test_a_mixture_logs_its_load_balance(moe_reference):
    """Each step's record has the load-balancing loss (about top_k = 2 when balanced, 4 when every pair
    goes to one of the 4 experts) and the busiest expert's share over the even share (1 to 2)."""
    recs = moe_records(moe_reference)
    assert len(recs) == 3
    for r in recs:
        assert 1.5 < r["moe_aux"] < 4.0 and 1.0 <= r["moe_load"] <= 2.0, r


@pytest.mark.parametrize("n,flags", [(2, []), (2, ["--pp", "2"]), (2, ["--zero", "1", "--act-ckpt"]),
                                     (2, ["--zero", "2"]), (4, ["--pp", "2", "--zero", "1"])])
def test_a_mixture_trains_as_the_single_process_does(tmp_path, moe_reference, n, flags):
    """dp 2, pp 2, dp 2 under ZeRO-1 with activation checkpointing and under ZeRO-2, pp 2 x dp 2: the
    single process's losses, load-balancing losses and weights (each micro-batch's aux loss weighs the
    same everywhere). Compiled: with ep, below."""
    job(n, tmp_path, *MOE, *flags)
    assert_same_training(tmp_path, moe_reference)
    for a, b in zip(moe_records(tmp_path), moe_records(moe_reference)):
        assert a["moe_aux"] == pytest.approx(b["moe_aux"], rel=1e-5)
        assert a["moe_load"] == pytest.approx(b["moe_load"], rel=1e-5)


@pytest.mark.parametrize("flags,message", [
    (["--tp", "2"], "--tp 2: a mixture of experts does not train with it yet"),
    (["--zero", "3"], "--zero 3: a mixture of experts does not train with it yet"),
    (["--zero", "2", "--ep", "2"], "--zero 2 with --ep: a mixture of experts does not"),
    (["--ep", "2", "--model", "tiny"], "--ep 2: model tiny is dense"),
    (["--ep", "3"], "--ep 3 must divide the 4 experts and dp 2")])
def test_what_a_mixture_does_not_train_with_is_one_line(tmp_path, flags, message):
    p = job(2, tmp_path / "o", *MOE, *flags, check=False, timeout=120)
    assert p.returncode != 0 and message in p.stderr, p.stderr[-2000:]
    assert not (tmp_path / "o").exists()


def test_a_trained_mixture_consolidates_to_a_mixtral_folder_transformers_loads(tmp_path, moe_reference):
    """checkpoint.py consolidate --hf: a Mixtral folder, the same logits in transformers; --init reads it."""
    import checkpoint
    step = moe_reference / (moe_reference / "latest").read_text().strip()
    assert checkpoint.main(["consolidate", str(step), "--hf", str(tmp_path / "hf")]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(hf).__name__ == "MixtralForCausalLM"
    ours = helpers.load_hf(tmp_path / "hf").eval()
    margs, state = checkpoint.load_init(tmp_path / "hf", data.get_tokenizer("byte"))
    assert margs.n_experts == 4 and all(torch.equal(state[k].float(), v) for k, v in ours.state_dict().items())
    tokens = torch.randint(0, 301, (2, 32))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), hf(tokens).logits, atol=2e-5, rtol=2e-5)


# ---------------------------------------------------------------------------------------------------
# Expert parallelism (--ep): the experts cut over dp ranks, tokens to them and back by all-to-all

from test_parallel import losses, masters, rel  # noqa: E402


@pytest.mark.parametrize("n,flags", [(2, ["--ep", "2"]), (4, ["--ep", "2"]), (4, ["--ep", "4"]),
                                     (4, ["--pp", "2", "--ep", "2"]), (2, ["--ep", "2", "--zero", "1"]),
                                     (4, ["--ep", "2", "--zero", "1", "--act-ckpt"])])
def test_expert_parallelism_trains_as_the_single_process_does(tmp_path, moe_reference, n, flags):
    """dp 2 with ep 2, dp 4 with ep 2 and ep 4, pp 2 x dp 2 with ep 2, dp 2 with ep 2 under ZeRO-1, and dp 4
    with ep 2 under ZeRO-1 with activation checkpointing: the single process's losses, load-balancing
    losses and weights; each step's all-to-all bytes are counted under "ep"."""
    job(n, tmp_path, *MOE, *flags)
    assert_same_training(tmp_path, moe_reference)
    for a, b in zip(moe_records(tmp_path), moe_records(moe_reference)):
        assert a["moe_aux"] == pytest.approx(b["moe_aux"], rel=1e-5)
        assert a["comm_bytes_per_step"]["ep"] > 0


@pytest.mark.parametrize("n,flags", [(1, []), (2, ["--ep", "2"])])
def test_a_compiled_mixture_compiles_each_graph_once_and_trains_as_eager_does(tmp_path, moe_reference, n, flags):
    """--compile, on one process and at dp 2 with ep 2: the routing (group sizes read on the host, uneven
    all-to-alls) runs eagerly, so no graph is compiled twice whatever each step routes
    (config.error_on_recompile: a recompile ends the run); the only graph breaks are the calls
    train.compile_blocks keeps eager (the routing, the load log), none at a shape the data decide; and
    the training is the eager single process's."""
    from test_parallel import COUNT_COMPILES
    script, counts = tmp_path / "count_compiles.py", tmp_path / "counts.json"
    script.write_text(COUNT_COMPILES)
    job(n, tmp_path / "run", *MOE, *flags, "--compile", script=script, extra_env={"COMPILE_COUNTS": str(counts)})
    breaks = json.loads(counts.read_text())["breaks"]
    assert breaks and all("torch.compiler.disable" in b for b in breaks), breaks
    assert_same_training(tmp_path / "run", moe_reference)
    for a, b in zip(moe_records(tmp_path / "run"), moe_records(moe_reference)):
        assert a["moe_aux"] == pytest.approx(b["moe_aux"], rel=1e-5)


def test_an_expert_parallel_checkpoint_continues_under_another_ep(tmp_path):
    """A checkpoint of dp 2 with ep 2 (each block of experts in a file of its own) continues at ep 4 and on one
    process with the single process's losses: it holds every expert under its global name."""
    straight, cut = tmp_path / "straight", tmp_path / "cut"
    job(1, straight, *MOE, "--ckpt-every", "2", steps=4)
    job(2, cut, *MOE, "--ep", "2", "--ckpt-every", "2", steps=2)
    assert sorted(p.name for p in (cut / "step_000002").glob("shard_*")) == ["shard_pp00_tp00_ep00.pt",
                                                                            "shard_pp00_tp00_ep01.pt"]
    for n, flags in ((4, ["--ep", "4"]), (1, [])):
        other = tmp_path / f"other{n}"
        other.mkdir()
        (other / "step_000002").symlink_to(cut / "step_000002")
        (other / "latest").write_text("step_000002\n")
        job(n, other, *MOE, *flags, "--resume", steps=4)
        la, lb = losses(other)[0], losses(straight)[0][2:]
        assert len(la) == 2 and all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(la, lb)), (n, la, lb)
        wa, wb = masters(other), masters(straight)
        assert wa.keys() == wb.keys() and max(rel(wa[k], wb[k]) for k in wb) <= 1e-5


def test_the_plan_of_mixtral_8x7b_divides_its_experts_over_ep(tmp_path):
    """bench.py --plan on 64 H100s: total and active parameters, FLOPs on the active ones (6 N_active per
    token), each GPU's weights with 1/ep of the experts, the all-to-all bytes; tp is refused as training
    refuses it."""
    import subprocess
    import sys
    base = [*multiproc.command(0, "bench.py"), "--plan", "--model", "mixtral-8x7b", "--gpus", "64", "--pp", "4",
            "--zero", "1", "--act-ckpt", "--seq-len", "4096", "--micro-batch", "1", "--grad-accum", "16",
            "--tokens", "1e12", "--json"]
    plan = lambda *flags: json.loads(subprocess.run(base + list(flags), capture_output=True, text=True,
                                                    check=True, cwd=REPO).stdout)
    one, eight = plan(), plan("--ep", "8")
    assert eight["params"] == 46_702_792_704 and eight["active_params"] == 12_879_925_248
    assert eight["flops"] == 6 * 12_879_925_248 * 1e12
    experts = 32 // 4 * 8 * 3 * 4096 * 14336 * 2  # a stage's 8 layers' experts, in bf16
    assert one["memory_per_gpu"]["weights"] - eight["memory_per_gpu"]["weights"] == pytest.approx(experts * 7 / 8)
    assert one["comm_bytes_per_step"]["ep"] == 0 < eight["comm_bytes_per_step"]["ep"]
    rows = 4096 * 2 * 4096 * 2  # one micro-batch's top-2 rows of 4,096 numbers in bf16
    expected = 16 * 8 * 7 / 8 * (2 * (8 * 8 + 2 * rows) + 2 * rows)  # act-ckpt: each forward twice
    assert eight["comm_bytes_per_step"]["ep"] == pytest.approx(expected)
    refused = subprocess.run(base + ["--ep", "8", "--tp", "2"], capture_output=True, text=True, cwd=REPO)
    assert refused.returncode == 1 and "--tp 2: a mixture of experts does not train" in refused.stderr


def test_a_measured_row_under_ep_sends_what_its_estimate_says(tmp_path):
    """bench.py's timed run of moe-tiny at dp 2 x ep 2: MFU on the active parameters, the dense weights'
    gradients over dp exactly as estimated, and the all-to-all's bytes beside their estimate (which
    assumes balanced routing: what a rank sends depends on where the router sends its tokens)."""
    import os
    import subprocess
    cmd = multiproc.command(2, REPO / "bench.py", "--model", "moe-tiny", "--ep", "2", "--seq-len", "32",
                            "--micro-batch", "2", "--steps", "2", "--warmup-steps", "1", "--json")
    row = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=REPO,
                                    env={**os.environ, "OMP_NUM_THREADS": "1"}).stdout.splitlines()[-1])
    assert row["ep"] == 2 and row["params"] == costs.count_params(M.PRESETS["moe-tiny"])
    sent, est = row["comm_bytes_per_step"], row["comm_estimate_bytes"]
    assert sent["dp"] == pytest.approx(est["dp"], rel=1e-3, abs=64)
    assert 0.5 < sent["ep"] / est["ep"] < 2
