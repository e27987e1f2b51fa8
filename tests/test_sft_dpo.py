"""sft.py and dpo.py: response-only gradients, packing equals one-by-one, fitting a few conversations, the DPO
loss against its closed form and at its start (log 2), learning preferences, parallel parity, and the whole
pretrain -> SFT -> DPO -> chat pipeline in miniature."""

import copy
import json
import math
import os
import subprocess
from pathlib import Path

import pytest
import torch
import transformers  # test-only dependency: requirements-test.txt

import chat
import checkpoint as C
import costs
import data
import dpo
import helpers
import logs
import loss
import multiproc
import model as M
import parallel as P
import sft
import train
import weights as W

REPO = Path(__file__).resolve().parents[1]
TINY = ["--model", "tiny", "--seq-len", "64", "--warmup", "2", "--log-every", "1", "--eval-every", "0",
        "--eval-batches", "1", "--val-fraction", "0.2", "--ckpt-every", "1000"]

CONVERSATIONS = [
    {"messages": [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}]},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                  {"role": "assistant", "content": "4"}]},
    {"instruction": "Say hello", "input": "", "output": "Hello!"},
    {"prompt": "Opposite of up?", "response": "Down."},
    {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, friend."},
                  {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Goodbye."}]},
]


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def records(out_dir):
    return [json.loads(l) for l in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]


def tiny_model(vocab=320):
    torch.manual_seed(0)
    return M.Transformer(M.ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=vocab,
                                     max_seq_len=512))


def sft_rows(tmp_path, pack, batch_size=1, seq_len=256):
    tok = data.get_tokenizer("byte")
    convs = chat.read_sft(write_jsonl(tmp_path / "c.jsonl", CONVERSATIONS))
    examples, _ = chat.sft_examples(tok, convs, seq_len)
    return chat.SFTLoader(examples, batch_size, seq_len, seed=0, pack=pack, pad_id=data.pad_id(tok))


def test_prompt_positions_get_exactly_zero_gradient(tmp_path):
    model = tiny_model()
    x, y, doc = sft_rows(tmp_path, pack=True, batch_size=2).next()
    logits = model(x, doc_ids=doc)
    logits.retain_grad()
    loss.loss_sum(logits, y, 320, P.Mesh()).backward()
    prompt = y == data.IGNORE_INDEX
    assert prompt.any() and (~prompt).any()
    assert torch.all(logits.grad[prompt] == 0)  # exactly zero, not small
    assert torch.all(logits.grad[~prompt].abs().sum(-1) > 0)


def test_packed_batch_equals_examples_one_by_one(tmp_path):
    model = tiny_model().eval()
    packed, single = sft_rows(tmp_path, pack=True), sft_rows(tmp_path, pack=False)
    assert len(packed) < len(single) == len(CONVERSATIONS)  # several examples share a packed row

    def total(loader):
        s, n = 0.0, 0
        for _ in range(len(loader)):
            x, y, doc = loader.next()
            s += loss.loss_sum(model(x, doc_ids=doc), y, 320, P.Mesh()).item()
            n += (y != data.IGNORE_INDEX).sum().item()
        return s, n

    (sp, np_), (ss, ns) = total(packed), total(single)
    assert np_ == ns and sp == pytest.approx(ss, rel=1e-5)


def test_sft_fits_a_handful_of_conversations(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", CONVERSATIONS * 2)
    sft.main(TINY + ["--data", str(path), "--max-steps", "120", "--lr", "1e-2", "--micro-batch", "4",
                     "--out-dir", str(tmp_path / "o"), "--sample-prompt", "Name a colour.", "--val-fraction",
                     "0.1"])
    losses = [r["loss"] for r in records(tmp_path / "o") if "loss" in r]
    assert losses[0] > 3 and losses[-1] < 0.1, losses[::10]
    # exported, it stops where sft.chat stops: transformers' generate() reads <|eot_id|> from the export
    assert C.main(["consolidate", str(tmp_path / "o"), "--hf", str(tmp_path / "hf")]) == 0
    tok, messages = data.get_tokenizer("byte"), [{"role": "user", "content": "Name a colour."}]
    ours = chat.reply(helpers.load_hf(tmp_path / "hf"), tok, messages, max_new_tokens=30, temperature=0)
    ids, _ = chat.encode_chat(tok, messages, add_generation_prompt=True)
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf")
    new = hf.generate(torch.tensor([ids]), max_new_tokens=30, do_sample=False)[0, len(ids):].tolist()
    assert ours == "Blue." and new == tok.encode_ordinary("Blue.") + [data.eot_id(tok)]
    # and the folder carries its tokenizer: transformers' own pipeline reads it and its chat template
    pipe = transformers.pipeline("text-generation", str(tmp_path / "hf"))
    reply = pipe(messages, max_new_tokens=30, do_sample=False)[0]["generated_text"][-1]
    assert reply == {"role": "assistant", "content": "Blue."}


# ---------------------------------------------------------------------------------------------------
# DPO


def test_dpo_loss_closed_form():
    pc, pr, rc, rr = (torch.tensor([v]) for v in (-1.0, -2.0, -1.5, -1.5))
    z = 0.1 * ((-1.0 + 1.5) - (-2.0 + 1.5))  # beta * (log-ratio chosen - log-ratio rejected) = 0.1
    sig = lambda t: 1 / (1 + math.exp(-t))
    assert dpo.dpo_loss(pc, pr, rc, rr, 0.1).item() == pytest.approx(-math.log(sig(z)), rel=1e-6)
    assert dpo.dpo_loss(pc, pr, rc, rr, 0.1, label_smoothing=0.2).item() == pytest.approx(
        -0.8 * math.log(sig(z)) - 0.2 * math.log(sig(-z)), rel=1e-6)
    assert dpo.dpo_loss(pc, pr, rc, rr, 0.1, "ipo").item() == pytest.approx((1.0 - 1 / 0.2) ** 2, rel=1e-6)
    assert dpo.dpo_loss(pc, pr, rc, rr, 0.1, "hinge").item() == pytest.approx(1 - z, rel=1e-6)


PAIRS = [{"prompt": f"Question {i}: is {i} a number?", "chosen": f"Yes, {i} is a number.",
          "rejected": f"No idea about {i}."} for i in range(16)]


def test_dpo_starts_at_log2_and_learns_its_pairs(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", PAIRS)
    dpo.main(TINY + ["--data", str(path), "--max-steps", "60", "--lr", "3e-3", "--micro-batch", "4",
                     "--beta", "0.5", "--out-dir", str(tmp_path / "o"), "--val-fraction", "0.1"])
    recs = [r for r in records(tmp_path / "o") if "loss" in r]
    assert recs[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)  # policy == reference at the start
    assert recs[0]["rewards/margins"] == 0.0
    assert all(k in recs[0] for k in ("rewards/chosen", "rewards/rejected", "rewards/accuracies",
                                      "logps/chosen",
                                       "logps/rejected"))
    last = recs[-5:]
    assert sum(r["rewards/accuracies"] for r in last) / len(last) > 0.9
    assert last[-1]["loss"] < 0.3


def test_precomputed_reference_gives_the_same_training(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", PAIRS)
    common = TINY + ["--data", str(path), "--max-steps", "4", "--lr", "3e-3", "--micro-batch", "4",
                     "--eval-every", "2"]
    dpo.main(common + ["--out-dir", str(tmp_path / "a")])
    dpo.main(common + ["--out-dir", str(tmp_path / "b"), "--precompute-ref"])
    assert (tmp_path / "b" / "ref_logps.pt").exists()
    ra, rb = records(tmp_path / "a"), records(tmp_path / "b")
    assert len(ra) == len(rb) == 6
    for a, b in zip(ra, rb):
        for k in ("loss", "val_loss", "rewards/margins", "val_rewards/accuracies"):
            if k in a:
                assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-7), (k, a, b)


def test_reference_cache_is_never_served_for_other_pairs(tmp_path, capsys):
    """Another seed splits the pairs otherwise: the cache in the same --out-dir must be recomputed, so the
    first step, with the policy equal to the reference, is at log 2 again. --sample-prompt '' skips the
    closing chat sample."""
    path = write_jsonl(tmp_path / "p.jsonl", PAIRS)
    common = TINY + ["--data", str(path), "--max-steps", "1", "--warmup", "1", "--micro-batch", "4",
                     "--precompute-ref", "--ckpt-every", "0", "--out-dir", str(tmp_path / "o"),
                     "--sample-prompt", ""]
    for seed in ("1337", "5"):
        dpo.main(common + ["--seed", seed])
        first = next(r for r in records(tmp_path / "o") if "loss" in r)
        assert first["loss"] == pytest.approx(math.log(2), abs=1e-6), seed
        (tmp_path / "o" / "metrics.jsonl").unlink()
    assert "assistant:" not in capsys.readouterr().out


def test_reference_cache_key_covers_rows_weights_and_precision(tmp_path, monkeypatch):
    """Served from the cache only for the same token rows, weights, tokenizer and precision."""
    pairs = chat.read_preferences(write_jsonl(tmp_path / "p.jsonl", PAIRS))
    examples, _ = chat.preference_examples(data.get_tokenizer("byte"), pairs, 64)
    loader = lambda ex: [chat.PreferenceLoader(ex, 4, 64, with_index=True)]
    args = dpo.get_parser().parse_args(["--out-dir", str(tmp_path), "--micro-batch", "4", "--seq-len", "64"])
    cpu = torch.device("cpu")
    computed, real = [], dpo.precompute_reference
    monkeypatch.setattr(dpo, "precompute_reference", lambda *a: computed.append(1) or real(*a))
    torch.manual_seed(0)
    ref, other = M.Transformer(M.PRESETS["tiny"]), M.Transformer(M.PRESETS["tiny"])
    cases = [(ref, examples, "byte", True), (ref, examples, "byte", False),
             (ref, examples[::-1], "byte", True),  # the same pairs in another order: other rows
             (other, examples, "byte", True), (other, examples, "gpt2", True),
             (copy.deepcopy(other).double(), examples, "gpt2", True), (other, examples, "gpt2", True),
             (other, examples, "gpt2", False)]
    for model, ex, tokenizer, recompute in cases:
        computed.clear()
        got = dpo.cached_reference(model, loader(ex), P.Mesh(), args, cpu, tokenizer)
        assert bool(computed) == recompute
        assert torch.equal(got, real(model, loader(ex), P.Mesh(), args, cpu))
    # --mask-format-tokens: other log-probs (rows long enough to hold each reply's <|eot_id|>)
    skip = torch.tensor(data.format_ids(data.get_tokenizer("byte")))
    args.seq_len = 128
    whole = [chat.PreferenceLoader(chat.preference_examples(data.get_tokenizer("byte"), pairs, 128)[0], 4, 128,
                                  with_index=True)]
    for masked, recompute in ((False, True), (True, True), (True, False)):
        computed.clear()
        got = dpo.cached_reference(other, whole, P.Mesh(), args, cpu, "gpt2", skip if masked else None)
        assert bool(computed) == recompute
    assert torch.equal(got, real(other, whole, P.Mesh(), args, cpu, skip))
    assert not torch.equal(got, real(other, whole, P.Mesh(), args, cpu))


def test_llama3_dpo_masks_the_format_tokens_and_adds_the_chosen_nll():
    """Llama 3's two changes against their closed forms: --mask-format-tokens leaves the format's tokens
    out of every DPO log-prob (so out of the rewards and logps metrics too); --nll-coef c adds c times the
    chosen reply's NLL per token, over all its learned tokens, logged as nll_loss. Off, plain DPO."""
    torch.manual_seed(0)
    B, T, V = 2, 7, 13
    skip = torch.tensor([10, 11, 12])  # the format's ids (headers, eot) in this small vocabulary
    logits, ref = torch.randn(2 * B, T, V), torch.randn(2 * B)
    y = torch.randint(0, 10, (2 * B, T))
    y[:, -1], y[0, 2], y[3, 4] = 12, 10, 11  # every reply ends with eot; a header inside two of them
    y[0, :1] = y[1, :2] = y[2, :1] = y[3, :3] = data.IGNORE_INDEX
    token = torch.log_softmax(logits, -1).gather(-1, y.clamp(min=0)[..., None])[..., 0]
    token = token.masked_fill(y == data.IGNORE_INDEX, 0.0)
    nll = -token[:B].sum(-1) / (y[:B] != data.IGNORE_INDEX).sum(-1)
    for flags, logps, coef in ((["--mask-format-tokens", "--nll-coef", "0.2"],
                                token.masked_fill(torch.isin(y, skip), 0.0).sum(-1), 0.2),
                               ([], token.sum(-1), 0.0)):
        args = dpo.get_parser().parse_args(["--beta", "0.5", *flags])
        task = dpo.DPOTask(M.ModelArgs(vocab_size=V), P.Mesh(), args, cached={},
                           skip=skip if args.mask_format_tokens else None)
        margin = 0.5 * ((logps[:B] - ref[:B]) - (logps[B:] - ref[B:]))
        want = (-torch.nn.functional.logsigmoid(margin) + coef * nll).mean()
        assert task.loss(logits, (y, ref), torch.tensor(B)).item() == pytest.approx(want.item(), rel=1e-6)
        metrics = dict(zip(task.metric_names, task.metrics().tolist()))
        assert metrics["logps/chosen"] == pytest.approx(logps[:B].mean().item(), rel=1e-6)
        assert metrics["rewards/margins"] == pytest.approx(margin.mean().item(), rel=1e-6)
        assert metrics.get("nll_loss", 0.0) == pytest.approx(nll.mean().item() if coef else 0.0, rel=1e-6)


@pytest.mark.parametrize("precompute", [False, True])
def test_llama3_dpo_runs_and_logs_its_nll(tmp_path, precompute):
    path = write_jsonl(tmp_path / "p.jsonl", PAIRS)
    dpo.main(TINY + ["--data", str(path), "--max-steps", "2", "--micro-batch", "4", "--seq-len", "128",
                     "--mask-format-tokens", "--nll-coef", "0.2", "--out-dir", str(tmp_path / "o")]
             + (["--precompute-ref"] if precompute else []))
    first = [r for r in records(tmp_path / "o") if "loss" in r][0]
    assert first["rewards/margins"] == 0.0 and first["nll_loss"] > 0  # policy == reference at the start
    assert first["loss"] == pytest.approx(math.log(2) + 0.2 * first["nll_loss"], rel=1e-5)


def test_ipo_uses_per_token_log_probs_and_ipo_sum_the_sums():
    """--loss ipo divides each sequence's log-probs (policy and reference) by its response length, as the
    IPO authors and TRL do; ipo-sum squares the summed log-ratios (Eq. 17 as written). The metrics under
    TRL's names are of the summed log-probs whatever the loss, as TRL logs them; under ipo the per-token
    ones it uses are logged too, under their own names."""
    torch.manual_seed(0)
    B, T, V = 2, 6, 11
    logits = torch.randn(2 * B, T, V)
    y = torch.randint(0, V, (2 * B, T))
    y[0, :1] = y[1, :3] = y[2, :2] = y[3, :4] = data.IGNORE_INDEX  # response lengths 5, 3, 4, 2
    ref = torch.randn(2 * B)
    logps = torch.log_softmax(logits, -1).gather(-1, y.clamp(min=0)[..., None])[..., 0]
    logps = logps.masked_fill(y == data.IGNORE_INDEX, 0).sum(-1)
    length = torch.tensor([5.0, 3.0, 4.0, 2.0])
    for kind, (p, r) in (("ipo", (logps / length, ref / length)), ("ipo-sum", (logps, ref))):
        args = dpo.get_parser().parse_args(["--loss", kind, "--beta", "0.5"])
        task = dpo.DPOTask(M.ModelArgs(vocab_size=V), P.Mesh(), args, cached={})
        want = ((p[:B] - r[:B]) - (p[B:] - r[B:]) - 1 / (2 * 0.5)) ** 2
        loss = task.loss(logits, (y, ref), torch.tensor(B))
        assert loss.item() == pytest.approx(want.mean().item(), rel=1e-5)
        got = dict(zip(task.metric_names, task.metrics().tolist()))
        assert got["logps/chosen"] == pytest.approx(logps[:B].mean().item(), rel=1e-5)  # TRL's: summed
        margin = 0.5 * ((logps[:B] - ref[:B]) - (logps[B:] - ref[B:]))
        assert got["rewards/margins"] == pytest.approx(margin.mean().item(), rel=1e-5)
        assert got["rewards/accuracies"] == (margin > 0).float().mean().item()
        if kind == "ipo":
            assert got["logps_per_token/chosen"] == pytest.approx(p[:B].mean().item(), rel=1e-5)
            per_token = 0.5 * ((p[:B] - r[:B]) - (p[B:] - r[B:]))
            assert got["rewards_per_token/margins"] == pytest.approx(per_token.mean().item(), rel=1e-5)
        else:
            assert not any("per_token" in name for name in got)


def _torchrun(script, n, out, *flags):
    cmd = multiproc.command(n, REPO / script, *flags, "--out-dir", out)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    return [r for r in records(out) if "loss" in r]


def test_sft_packed_documents_under_context_and_data_parallelism_match_single_process(tmp_path):
    """cp 2 x dp 2 on packed conversations (documents that cross the cp chunks' boundaries): the losses and
    final weights of one process."""
    path = write_jsonl(tmp_path / "c.jsonl", CONVERSATIONS * 8)
    common = TINY + ["--data", str(path), "--max-steps", "3", "--lr", "3e-3", "--pack", "--seq-len", "128"]
    ref = _torchrun("sft.py", 1, tmp_path / "one", *common, "--micro-batch", "4")
    par = _torchrun("sft.py", 4, tmp_path / "cp", *common, "--micro-batch", "2", "--cp", "2")
    assert len(ref) == len(par) == 3
    for a, b in zip(par, ref):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), (a, b)
    weights = [{k: v["master"] for k, v in C.read_full_state(C.read_latest(out))[0].items()}
               for out in (tmp_path / "cp", tmp_path / "one")]
    for k, w in weights[1].items():  # relative to each tensor's norm, as tests/test_parallel.py compares
        assert ((weights[0][k] - w).norm() / w.norm()).item() <= 1e-5, k


# tp 2; dp 2 (same global batch); dp 2 with the reference precomputed, split over the two replicas
@pytest.mark.parametrize("flags,micro", [(["--tp", "2"], 4), ([], 2), (["--precompute-ref"], 2)])
def test_dpo_parallel_matches_single_process(tmp_path, flags, micro):
    path = write_jsonl(tmp_path / "p.jsonl", PAIRS)
    common = TINY + ["--data", str(path), "--max-steps", "3", "--lr", "3e-3", "--beta", "0.5"]
    ref = _torchrun("dpo.py", 1, tmp_path / "one", *common, "--micro-batch", "4")
    par = _torchrun("dpo.py", 2, tmp_path / "two", *common, "--micro-batch", str(micro), *flags)
    for a, b in zip(par, ref):
        for k in ("loss", "rewards/accuracies", "rewards/margins", "logps/chosen"):
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6), (k, a, b)


def test_dpo_interleaved_pipeline_matches_single_process(tmp_path):
    """pp 2 with 2 model chunks per rank: the policy through the interleaved schedule, the frozen reference
    (and validation) through the chunks one after another, round the ranks twice."""
    path = write_jsonl(tmp_path / "p.jsonl", PAIRS)
    common = TINY + ["--data", str(path), "--max-steps", "3", "--lr", "3e-3", "--beta", "0.5", "--n-layers",
                     "4"]
    ref = _torchrun("dpo.py", 1, tmp_path / "one", *common, "--micro-batch", "4")
    par = _torchrun("dpo.py", 2, tmp_path / "two", *common, "--micro-batch", "2", "--grad-accum", "2", "--pp",
                    "2", "--schedule", "interleaved", "--virtual-stages", "2",
                    "--eval-batches", "2")  # the same 4 validation pairs, as 2 micro-batches of 2
    assert len(ref) == len(par) == 3
    for a, b in zip(par, ref):
        for k in ("loss", "rewards/accuracies", "rewards/margins", "logps/chosen"):
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6), (k, a, b)
    val = [[r["val_loss"] for r in records(out) if "val_loss" in r] for out in (tmp_path / "two",
                                                                               tmp_path / "one")]
    assert val[0] and val[0] == pytest.approx(val[1], rel=1e-5)


def test_pipeline_pretrain_sft_dpo_chat(tmp_path):
    """The README's pipeline in miniature: each stage's checkpoint loads into the next."""
    pre, sft_out, dpo_out = tmp_path / "pre", tmp_path / "sft", tmp_path / "dpo"
    train.main(["--model", "tiny", "--seq-len", "64", "--max-steps", "20", "--warmup", "2", "--eval-batches", "2",
                "--sample-tokens", "0", "--out-dir", str(pre)])
    convs = write_jsonl(tmp_path / "c.jsonl", CONVERSATIONS * 2)
    sft_flags = ["--init", str(pre), "--data", str(convs), "--seq-len", "64", "--max-steps", "20",
                 "--micro-batch", "4", "--eval-batches", "1", "--val-fraction", "0.1",
                 "--out-dir", str(sft_out)]
    with pytest.raises(C.CheckpointError, match="was trained with byte, whose ids mean other text"):
        sft.main(sft_flags + ["--tokenizer", "gpt2"])  # refused before anything is written
    assert not sft_out.exists()
    sft.main(sft_flags)  # the tokenizer: the one --init records
    assert C.recorded(sft_out)["tokenizer"] == "byte" and C.recorded(sft_out)["chat"]
    pairs = write_jsonl(tmp_path / "p.jsonl", PAIRS)
    dpo.main(["--init", str(sft_out), "--data", str(pairs), "--seq-len", "64", "--max-steps", "5", "--warmup", "1",
              "--micro-batch", "2", "--eval-batches", "1", "--val-fraction", "0.1", "--out-dir",
              str(dpo_out)])
    tok = data.get_tokenizer("byte")
    margs, state = C.load_init(dpo_out, tok)
    chat_model = M.Transformer(margs)
    chat_model.load_state_dict(state)
    reply = chat.reply(chat_model, tok, [{"role": "user", "content": "Name a colour."}], max_new_tokens=20)
    assert isinstance(reply, str)
    assert [r["step"] for r in records(dpo_out) if "loss" in r][-1] == 5


def test_init_from_hf_grows_a_smaller_vocabulary(tmp_path):
    """A Hugging Face folder whose vocabulary (200) lacks the chat tokens of the byte tokenizer (268 ids):
    the embedding and output gain rows, initialized to the mean of the existing ones; old rows unchanged."""
    torch.manual_seed(0)
    small = M.Transformer(M.ModelArgs(dim=32, n_layers=1, n_heads=2, vocab_size=200, multiple_of=16,
                                      max_seq_len=128))
    W.save_hf(small, tmp_path / "hf")
    margs, state = C.load_init(tmp_path / "hf", data.get_tokenizer("byte"))
    assert margs.vocab_size == 320
    for name in ("tok_embeddings.weight", "output.weight"):
        old = small.state_dict()[name]
        assert torch.equal(state[name][:200], old)
        assert torch.allclose(state[name][200:], old.mean(0).expand(120, -1))
    grown = M.Transformer(margs)
    grown.load_state_dict(state)  # loads: the shapes agree with the grown arguments


def test_dpo_counts_both_rows_of_a_pair_and_the_reference_forward():
    """tokens/s and MFU count what the model computes: a DPO micro-batch of B pairs is 2B rows, and a
    reference computed alongside adds its forward (a third of forward + backward) to the FLOPs."""
    margs = M.PRESETS["tiny"]
    args = dpo.get_parser().parse_args(["--micro-batch", "4", "--seq-len", "32", "--grad-accum", "3"])
    mesh = P.Mesh(P.Layout(dp=2))
    live, cached = dpo.DPOTask(margs, mesh, args, reference=object()), dpo.DPOTask(margs, mesh, args,
                                                                                   cached={})
    lm = loss.LMTask(margs, mesh)
    assert logs.step_tokens(args, live, mesh) == 2 * logs.step_tokens(args, lm, mesh) == 2 * 4 * 32 * 3 * 2
    base = costs.flops_per_token(margs, 32)["palm"]
    assert logs.model_flops_per_token(margs, 32, lm) == logs.model_flops_per_token(margs, 32,
                                                                                     cached) == base
    assert logs.model_flops_per_token(margs, 32, live) == pytest.approx(base * 4 / 3)
