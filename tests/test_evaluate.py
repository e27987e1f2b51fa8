"""evaluate.py: multiple choice scores 1.0 / 0.0 with models rigged for the right / a wrong answer, bits per
byte against an independent computation, contamination finds exactly the planted items, the benchmark
readers on the mirror's files, generation (greedy equals model.generate, chat stops at <|eot_id|>), the CLI
on a train.py checkpoint, two processes give the numbers of one, and bad input ends in one error line."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import checkpoint as C
import config
import data
import evaluate as E
import multiproc
import model as M
import parallel as P
import train
import weights as W

REPO = Path(__file__).resolve().parents[1]


def rigged_model(favourite, then=None, vocab=320):
    """A model that always predicts `favourite` (log-prob ~0, every other token ~-32), whatever the input;
    with `then`, the token after `favourite` is `then`. Its blocks add nothing to the residual stream (wo =
    w2 = 0), so the logits are output(norm(embedding of the last token)): every token embeds as u,
    `favourite` as v (u, v orthogonal, rms 1), and the output rows of `favourite` and `then` are 0.5 u and
    0.5 v."""
    torch.manual_seed(0)
    m = M.Transformer(M.ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=vocab,
                                  max_seq_len=256))
    u, v = torch.ones(64), torch.tensor([1.0, -1.0] * 32)
    with torch.no_grad():
        for layer in m.layers.values():
            layer.attention.wo.weight.zero_()
            layer.feed_forward.w2.weight.zero_()
        m.tok_embeddings.weight[:] = u
        m.output.weight.zero_()
        m.output.weight[favourite] = 0.5 * u
        if then is not None:
            m.tok_embeddings.weight[favourite] = v
            m.output.weight[then] = 0.5 * v
    return m.eval()


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


BYTE = W.hf_tokens(data.get_tokenizer("byte"), chat=False)  # what an export of a byte model records


def cli(capsys, *argv) -> list[dict]:
    """evaluate.py's main in this process with --json: the JSON objects it printed."""
    E.main([*argv, "--json"])
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


# Every correct choice is made of "z"s, every wrong one of other letters (or only of "y"s); lengths vary so
# that acc_norm and acc_token are tested, and the last context is longer than the sequence (left truncation).
ITEMS = [{"context": "Pick one:", "choices": ["zz", "abc"], "label": 0},
         {"context": "Which?", "choices": ["yyyyyyyy", "y", "zzzzzzzzzzzz"], "label": 2},
         {"context": "Again", "choices": ["ab", "zzzzz", "cdefgh", "q"], "label": 1},
         {"context": "Long " * 40, "choices": ["zzz", "yy", "yyyyyy"], "label": 0}]


def test_multiple_choice_right_and_wrong_models(tmp_path, capsys):
    tok = data.get_tokenizer("byte")
    z, y = tok.encode_ordinary("z")[0], tok.encode_ordinary("y")[0]
    right = E.multiple_choice(rigged_model(z), tok, ITEMS, 64, 3, P.Mesh())
    assert right == {"acc": 1.0, "acc_norm": 1.0, "acc_token": 1.0, "items": 4, "seq_len": 64,
                     "choices_cut": 0}
    wrong_items = [{**it, "choices": ["y" * len(c) if k != it["label"] else c for k,
                                      c in enumerate(it["choices"])]}
                   for it in ITEMS]  # every wrong choice all "y"s
    wrong = E.multiple_choice(rigged_model(y), tok, wrong_items, 64, 3, P.Mesh())
    assert wrong == {"acc": 0.0, "acc_norm": 0.0, "acc_token": 0.0, "items": 4, "seq_len": 64,
                     "choices_cut": 0}
    # the same through the CLI, from a Hugging Face folder
    W.save_hf(rigged_model(z), tmp_path / "hf", BYTE)
    [out] = cli(capsys, "--init", str(tmp_path / "hf"), "--task", str(write_jsonl(tmp_path / "mc.jsonl",
                                                                                  ITEMS)))
    assert (out["kind"], out["acc"], out["acc_norm"], out["acc_token"], out["items"]) == ("multiple_choice",
                                                                                          1, 1, 1, 4)


def test_multiple_choice_scores_follow_their_definitions(capsys):
    """A random model on real items, the sequence shorter than most: each score computed here from scratch.
    Choices longer than the window are counted, and said once."""
    tok, seq_len = data.get_tokenizer("byte"), 48
    items = E.read_items("hellaswag")[:24]
    torch.manual_seed(2)  # a model whose three scores differ on these items (checked below)
    model = M.Transformer(M.ModelArgs(dim=32, n_layers=1, n_heads=2, vocab_size=320, max_seq_len=64)).eval()
    picks = []  # per item: the choice each rule picks
    for item in items:
        scores = []
        for choice in item["choices"]:
            context, cont = [data.bos_id(tok), *item["context"].encode()], list((" " + choice).encode())
            seq = torch.tensor((context + cont)[-(seq_len + 1):])  # truncated from the left
            with torch.no_grad():
                logp = torch.log_softmax(model(seq[None, :-1])[0].double(), -1)[torch.arange(len(seq) - 1),
                                                                                seq[1:]]
            n = min(len(cont), len(seq) - 1)
            scores.append([logp[-n:].sum().item(), len(choice), n])
        s = np.array(scores)
        picks.append([s[:, 0].argmax(), (s[:, 0] / s[:, 1]).argmax(), (s[:, 0] / s[:, 2]).argmax()])
    picks, labels = np.array(picks), np.array([item["label"] for item in items])
    got = E.multiple_choice(model, tok, items, seq_len, 5, P.Mesh())
    expected = (picks == labels[:, None]).mean(0)
    assert [got["acc"], got["acc_norm"], got["acc_token"]] == pytest.approx(list(expected))
    assert len(set(expected)) == 3  # three different scores here: none of the rules can stand in for another
    cut = sum(any(len((" " + c).encode()) > seq_len for c in item["choices"]) for item in items)
    assert got["choices_cut"] == cut > 0
    said = [line for line in capsys.readouterr().err.splitlines() if "longer than the" in line]
    assert said == [f"multiple choice: {cut} of 24 items have a choice longer than the 48-token window; each "
                    "such choice is scored on its last 48 tokens only"]


@pytest.mark.parametrize("tokenizer", ["byte", "gpt2"])
def test_bits_per_byte_matches_an_independent_computation(tokenizer):
    tok = data.get_tokenizer(tokenizer)
    text = ("Naïve café owners — «très bien» — sell crème brûlée.\nThe end of 日本語 text.\n") * 3
    torch.manual_seed(1)  # a fixed random model
    model = M.Transformer(M.ModelArgs(dim=32, n_layers=1, n_heads=2,
                                      vocab_size=64 * math.ceil(tok.n_vocab / 64), max_seq_len=64)).eval()
    seq_len = 16
    got = E.perplexity(model, tok, [E.text_tokens([text], tok)], seq_len, 3, P.Mesh())
    # independently: BOS text EOS, windows of seq_len + 1 at stride seq_len; bits per byte leaves out EOS
    ids = [data.bos_id(tok), *tok.encode_ordinary(text), data.eos_id(tok)]
    losses = []
    for start in range(0, len(ids) - 1, seq_len):
        w = torch.tensor(ids[start:start + seq_len + 1])
        with torch.no_grad():
            losses.append(F.cross_entropy(model(w[None, :-1])[0], w[1:], reduction="none"))
    losses = torch.cat(losses).double()
    n_bytes = len(text.encode("utf-8"))
    assert got["tokens"] == len(ids) - 1 and got["bytes"] == n_bytes
    assert got["loss"] == pytest.approx(losses.mean().item(), rel=1e-6)
    assert got["perplexity"] == pytest.approx(math.exp(losses.mean().item()), rel=1e-6)
    text_loss, text_tokens = losses[:-1].mean().item(), len(losses) - 1  # the EOS target is the last
    assert got["bits_per_byte"] == pytest.approx(text_loss * text_tokens / (n_bytes * math.log(2)), rel=1e-6)
    if tokenizer == "gpt2":
        assert text_tokens < n_bytes  # several bytes per token: bits per byte is not loss / ln 2
    # the loss by target position: each window's targets at positions 0, 1-2, 3-6, 7-14, 15
    windows = losses.split(seq_len)
    buckets = {"0-0": (0, 1), "1-2": (1, 3), "3-6": (3, 7), "7-14": (7, 15), "15-15": (15, 16)}
    for key, (lo, hi) in buckets.items():
        want = torch.cat([w[lo:hi] for w in windows]).mean().item()
        assert got["loss_by_position"][key] == pytest.approx(want, rel=1e-6), key
    assert len(got["loss_by_position"]) == 5


def random_items(n, seed=0):
    """Items of made-up words, so no n-gram of one can occur in another or in Shakespeare."""
    rng = np.random.default_rng(seed)
    word = lambda: "".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), rng.integers(3, 8)))
    sentence = lambda k: " ".join(word() for _ in range(k))
    return [{"context": sentence(18).capitalize() + "?", "choices": [sentence(6), sentence(6)],
             "label": i % 2}
            for i in range(n)]


def test_contamination_finds_exactly_the_planted_items(tmp_path, capsys, mirror, monkeypatch):
    items, planted = random_items(20), [2, 9, 15]
    bench = write_jsonl(tmp_path / "bench.jsonl", items)
    lines = (mirror / "text" / "tinyshakespeare.txt").read_text()[:60_000].split("\n")
    # verbatim: the context, a space (the last one: a newline), the right answer
    for k, i in enumerate(planted):
        gap = " " if k < 2 else "\n"
        lines.insert(500 + 700 * k, f"{items[i]['context']}{gap}{items[i]['choices'][items[i]['label']]}")
    train_txt = tmp_path / "train.txt"
    train_txt.write_text("\n".join(lines))
    shards = data.prepare(train_txt, "gpt2", out_dir=tmp_path / "shards", val_fraction=0)
    monkeypatch.setattr(E, "CHUNK", 100)  # pieces shorter than an item: n-grams across pieces must be found
    for source in (train_txt, shards):
        [out] = cli(capsys, "--contamination", str(bench), "--train", str(source), "--tokenizer", "gpt2")
        assert out["items"] == 20 and out["tokenizer"] == "gpt2" and out["train_words"] > 10_000
        for kind, n in (("words", 13), ("tokens", 8)):
            report = out[kind]
            assert report["n"] == n and report["indices"] == planted and report["contaminated"] == 3
            assert report["share"] == pytest.approx(3 / 20)
            assert [e["index"] for e in report["examples"]] == planted
            # every n-gram of a planted item is found, but for the token n-grams across the third one's
            # newline
            overlap = [e["overlap"] for e in report["examples"]]
            assert overlap[:2] == [1.0, 1.0] and (overlap[2] == 1.0) == (kind == "words")
    [clean] = cli(capsys, "--contamination", str(bench), "--train", "tinyshakespeare", "--ngram-words", "5")
    assert clean["words"]["contaminated"] == 0 and clean["words"]["n"] == 5


def test_readers_parse_the_mirror_benchmarks(mirror, tmp_path):
    hellaswag = E.read_items("hellaswag")  # the registry's .bz2 text form, through the mirror
    assert len(hellaswag) == 10_042 and all(len(it["choices"]) == 4 for it in hellaswag)
    as_jsonl = write_jsonl(tmp_path / "hellaswag.jsonl", [
        {"ind": i, "ctx": it["context"], "endings": it["choices"], "label": it["label"]}
        for i, it in enumerate(hellaswag)])
    assert E.read_items(str(as_jsonl)) == hellaswag  # the JSONL form ({ctx, endings, label}) agrees
    assert hellaswag[0]["context"] == "Roof shingle removal: A man is sitting on a roof. he"
    assert hellaswag[0]["label"] == 3 and sorted({it["label"] for it in hellaswag}) == [0, 1, 2, 3]
    piqa = E.read_items("piqa")
    assert len(piqa) == 1_838 and {it["label"] for it in piqa} == {0, 1}
    assert piqa[0]["context"].startswith("Question: How do I ready a guinea pig "
                                         "cage") and piqa[0]["label"] == 0
    assert E.read_items(str(mirror / "eval" / "piqa_valid.jsonl")) == piqa  # labels found next to the file


def test_arc_reader(tmp_path, mirror):
    records = [{"id": "a", "question": {"stem": "Which is a metal?", "choices": [
        {"text": "iron", "label": "A"}, {"text": "wood", "label": "B"}, {"text": "glass", "label": "C"}]},
        "answerKey": "A"},
        {"id": "b", "question": {"stem": "2 + 2?", "choices": [
            {"text": "3", "label": "1"}, {"text": "4", "label": "2"}, {"text": "5", "label": "3"},
            {"text": "6", "label": "4"}]}, "answerKey": "2"}]
    items = E.read_items(str(write_jsonl(tmp_path / "arc.jsonl", records)))
    assert items == [{"context": "Question: Which is a metal?\nAnswer:", "choices": ["iron", "wood", "glass"],
                      "label": 0},
                     {"context": "Question: 2 + 2?\nAnswer:", "choices": ["3", "4", "5", "6"], "label": 1}]
    # (the mirror's MANIFEST.md lists eval/arc_easy_dev.jsonl, but the file is absent from ../shared/data, so
    # the 570-item count cannot be checked offline; the reader is pinned by the records above)


def test_hellaswag_context_as_lm_evaluation_harness_builds_it(tmp_path):
    """rowanz/hellaswag's own records: activity label, then ctx_a, then ctx_b with its first letter
    capitalized, WikiHow markup removed from context and endings."""
    record = {"ind": 4, "activity_label": "Home and Garden", "ctx_a": "[header] How to plant a tree.",
              "ctx_b": "dig a hole [title] Make it  wide.", "ctx": "...", "label": 1,
              "endings": ["Put the tree in.", "Water it [step] well."]}
    [item] = E.read_items(str(write_jsonl(tmp_path / "hellaswag.jsonl", [record])))
    assert item == {"context": "Home and Garden: How to plant a tree. Dig a hole. make it wide.",
                    "choices": ["Put the tree in.", "Water it well."], "label": 1}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt")
    train.main(["--model", "tiny", "--seq-len", "64", "--max-steps", "5", "--warmup", "1", "--eval-batches", "1",
                "--sample-tokens", "0", "--out-dir", str(out)])
    return out


def test_the_tokenizer_comes_from_what_init_records(checkpoint, tmp_path):
    """A checkpoint records its tokenizer and seq_len; an export its tokenizer; a Hugging Face folder with
    Llama 3's vocabulary and no record gets llama3; with no record otherwise, --tokenizer must say."""
    found = C.recorded(checkpoint)
    assert (found["tokenizer"], found["seq_len"], found["chat"]) == ("byte", 64, False)
    assert C.tokenizer_for(checkpoint, None).name == C.tokenizer_for(checkpoint, "byte").name == "byte"
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 128_256}))  # a Llama 3 HF folder
    assert C.recorded(tmp_path) == {"vocab_size": 128_256}
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 50_304, "tokenizer": "gpt2"}))
    assert C.tokenizer_for(tmp_path, None).name == "gpt2"  # an export of a gpt2 model: never byte
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 320}))
    assert C.tokenizer_for(tmp_path, "byte").name == "byte"
    with pytest.raises(C.CheckpointError, match="does not record which tokenizer"):
        C.tokenizer_for(tmp_path, None)


def test_greedy_generation_equals_model_generate(checkpoint, capsys):
    tok = data.get_tokenizer("byte")
    [out] = cli(capsys, "--init", str(checkpoint), "--prompt", "ROMEO:", "--temperature", "0",
                "--max-new-tokens", "20")
    model = E.load_model(checkpoint, tok, torch.device("cpu"), torch.float32, P.Mesh())
    prompt = [data.bos_id(tok)] + tok.encode_ordinary("ROMEO:")
    expected = M.generate(model, prompt, 20, temperature=0, eos_id=data.eos_id(tok),
                          n_vocab=tok.n_vocab)[0].tolist()
    assert out["tokens"] == expected and len(expected) == 20 and not out["stopped"]
    assert out["completion"] == tok.decode(expected)


def test_chat_generation_stops_at_eot(tmp_path, capsys):
    tok = data.get_tokenizer("byte")
    x, eot = tok.encode_ordinary("x")[0], data.eot_id(tok)
    W.save_hf(rigged_model(x, then=eot), tmp_path / "hf", BYTE)  # "x", then <|eot_id|>, then "x" again ...
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Hello\nHow are you?\n")
    chat = cli(capsys, "--init", str(tmp_path / "hf"), "--prompts-file", str(prompts), "--chat",
               "--temperature", "0")
    assert [(r["prompt"], r["completion"], r["tokens"], r["stopped"]) for r in chat] == \
        [("Hello", "x", [x], True), ("How are you?", "x", [x], True)]
    [plain] = cli(capsys, "--init", str(tmp_path / "hf"), "--prompt", "Hello", "--temperature", "0",
                  "--max-new-tokens", "6")
    # without --chat only <|end_of_text|> stops
    assert plain["tokens"] == [x, eot] * 3 and not plain["stopped"]


def test_cli_on_a_checkpoint_and_two_processes_agree(checkpoint, tmp_path, capsys):
    [ts] = cli(capsys, "--init", str(checkpoint), "--task", "tinyshakespeare")
    assert ts["task"] == "tinyshakespeare" and ts["seq_len"] == 64  # the checkpoint's training --seq-len
    assert ts["perplexity"] == pytest.approx(math.exp(ts["loss"]))
    assert 3 < ts["loss"] < 6 and ts["tokens"] > 100_000  # the whole val split; byte vocab: 5.6 = ln 268
    # byte tokens: 1 byte each
    assert ts["bits_per_byte"] == pytest.approx(ts["loss"] / math.log(2), rel=1e-3)
    hellaswag = E.read_items("hellaswag")[:9]  # odd: the ranks get 5 and 4
    mc = write_jsonl(tmp_path / "mc.jsonl", hellaswag)
    argv = ["--init", str(checkpoint), "--task", str(mc), "--task", "tinyshakespeare", "--limit", "7",
            "--json"]
    one = cli(capsys, *argv[:-1])
    cmd = multiproc.command(2, REPO / "evaluate.py", *argv)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    two = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    assert len(two) == 2 and two[0]["items"] == 7 and two[1]["windows"] == 7
    assert {k: two[0][k] for k in ("acc", "acc_norm", "acc_token", "items")} == \
        {k: one[0][k] for k in ("acc", "acc_norm", "acc_token", "items")}
    for k in ("loss", "bits_per_byte"):
        assert two[1][k] == pytest.approx(one[1][k], rel=1e-6)
    assert (two[1]["tokens"], two[1]["bytes"]) == (one[1]["tokens"], one[1]["bytes"])


@pytest.mark.parametrize("argv, message", [
    (["--task", "piqa"], "--init"),
    (["--init", "{hf}", "--task", "no_such_task"], "unknown --task 'no_such_task'"),
    (["--init", "{hf}", "--task", "{bad_json}"], "bad.jsonl:2: malformed JSON"),
    (["--init", "{hf}", "--task", "{bad_label}"], "label 5 is not the index of one of 2 choices"),
    (["--init", "{tmp}", "--task", "piqa"], "not a checkpoint folder"),
    (["--init", "{bare}", "--task", "piqa"], "does not record which tokenizer it was trained with"),
    (["--init", "{hf}", "--tokenizer", "gpt2", "--task", "piqa"], "was trained with byte, whose ids mean"),
    (["--init", "{bare}", "--tokenizer", "gpt2", "--task", "piqa"], "has 50,269 ids but --init"),
    (["--contamination", "piqa"], "--contamination needs --train"),
    ([], "nothing to do"),
])
def test_cli_errors_are_one_line(tmp_path, capsys, argv, message):
    W.save_hf(rigged_model(0), tmp_path / "hf", BYTE)
    W.save_hf(rigged_model(0), tmp_path / "bare")  # records no tokenizer
    (tmp_path / "bad.jsonl").write_text('{"context": "a", "choices": ["b", "c"], "label": 0}\n{oops\n')
    write_jsonl(tmp_path / "label.jsonl", [{"context": "a", "choices": ["b", "c"], "label": 5}])
    names = {"{hf}": str(tmp_path / "hf"), "{bare}": str(tmp_path / "bare"),
             "{bad_json}": str(tmp_path / "bad.jsonl"),
             "{bad_label}": str(tmp_path / "label.jsonl"), "{tmp}": str(tmp_path)}
    with pytest.raises(SystemExit) as exit_info:
        config.run(E.main, [names.get(a, a) for a in argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 1 and err[-1].startswith("error: ") and message in err[-1]
    assert not any(line.startswith("Traceback") for line in err)


def test_plot_draws_a_run_and_says_when_matplotlib_is_missing(checkpoint, tmp_path, capsys, monkeypatch):
    """--plot turns <out-dir>/metrics.jsonl into <out-dir>/loss.png (losses against tokens, the learning
    rate); without matplotlib it is one line."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text((checkpoint / "metrics.jsonl").read_text())
    assert all("tokens" in r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
               if "loss" in r or "val_loss" in r)
    E.main(["--plot", str(run)])
    png = (run / "loss.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert capsys.readouterr().out == f"wrote {run / 'loss.png'}\n"
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # what an absent package looks like
    with pytest.raises(SystemExit) as exit_info:
        config.run(E.main, ["--plot", str(run)])
    assert exit_info.value.code == 1
    assert capsys.readouterr().err.strip() == "error: --plot needs matplotlib: pip install matplotlib"


def test_the_plot_draws_the_benchmarks_scored_during_training():
    """A run with --eval-tasks: a panel between the losses and the learning rate, a line per benchmark."""
    from matplotlib.figure import Figure
    records = [{"step": s, "tokens": 100 * s, "loss": 5 - s, "lr": 1e-3} for s in (1, 2)]
    records += [{"step": 2, "tokens": 200, "val_loss": 4.0, "piqa/acc": 0.5, "piqa/acc_norm": 0.55,
                 "hellaswag/acc": 0.25, "hellaswag/acc_norm": 0.3}]
    loss, scores, lr = E.run_figure(Figure(), records, "run").axes
    assert [line.get_label() for line in scores.get_lines()] == ["hellaswag", "piqa"]
    assert [list(line.get_ydata()) for line in scores.get_lines()] == [[0.3], [0.55]]
    assert len(E.run_figure(Figure(), records[:2], "run").axes) == 2  # none scored: no panel


@pytest.mark.parametrize("tokenizer", ["byte", "gpt2"])
def test_the_pass_key_sits_at_its_depth_and_is_scored_as_its_tokens(tokenizer):
    """needle_prompt: the prompt and the key fill exactly the length asked, the key stated once at the
    depth asked (0: after BOS, 1: just before the question); needle(): the key's mean log-prob is the one
    token_logprobs gives, and accuracy counts exact greedy retrievals."""
    tok = data.get_tokenizer(tokenizer)
    for depth in (0.0, 0.5, 1.0):
        prompt, answer = E.needle_prompt(tok, 200, depth, "12345")
        assert len(prompt) + len(answer) == 200 and tok.decode(answer) == " 12345"
        text = tok.decode(prompt[1:])
        assert text.count("The pass key is 12345.") == 1 and text.endswith("The pass key is")
        before = text.index(" The pass key is 12345")
        filler = len(text) - len(" The pass key is 12345. Remember it. 12345 is the pass key. ") - len(
            " What is the pass key? The pass key is")
        assert before == pytest.approx(depth * filler, abs=8)
    torch.manual_seed(0)
    vocab = 64 * math.ceil(tok.n_vocab / 64)
    model = M.Transformer(M.ModelArgs(dim=32, n_layers=1, n_heads=2, vocab_size=vocab, max_seq_len=256)).eval()
    got = E.needle(model, tok, 128, 0.5, 3, seed=7)
    keys = [str(k) for k in np.random.default_rng(7).integers(10000, 100000, size=3)]
    want = np.mean([E.token_logprobs(model, [p + a], [len(a)])[0].mean()
                    for p, a in (E.needle_prompt(tok, 128, 0.5, k) for k in keys)])
    assert got["key_logprob"] == pytest.approx(want) and got["accuracy"] in (0.0, 1 / 3, 2 / 3, 1.0)


def test_diff_finds_a_hand_made_low_rank_update_exactly(tmp_path, capsys):
    """B is A plus updates of rank 1, 3 and 4 on three matrices (equal singular values: the effective rank,
    the directions holding 90% of the change, is the rank too) and nothing else: --diff names those three
    alone as changed, with their exact relative change and rank; everything else moved 0."""
    torch.manual_seed(0)
    a = M.Transformer(M.ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=320, max_seq_len=64))
    b = M.Transformer(a.args)
    b.load_state_dict(a.state_dict())
    updates = {"layers.0.attention.wq.weight": 1, "layers.1.feed_forward.w2.weight": 3,
               "tok_embeddings.weight": 4}
    with torch.no_grad():
        for name, rank in updates.items():
            w = b.get_parameter(name)
            u = torch.linalg.qr(torch.randn(w.shape[0], rank))[0]  # orthonormal columns
            v = torch.linalg.qr(torch.randn(w.shape[1], rank))[0]
            w += 3.0 * u @ v.T  # singular values 3, rank times
    W.save_hf(a, tmp_path / "a", BYTE)
    W.save_hf(b, tmp_path / "b", BYTE)
    r = E.weight_diff(tmp_path / "a", tmp_path / "b")
    for name, v in r["params"].items():
        if name in updates:
            rank, w = updates[name], a.get_parameter(name).detach()
            assert (v["rank"], v["effective_rank"]) == (rank, rank), name
            assert v["relative_change"] == pytest.approx(3.0 * rank ** 0.5 / w.norm().item(), rel=1e-4)
        else:
            assert v["relative_change"] == 0 and v.get("rank", 0) == 0, name
    assert set(r["by_kind"]) >= {"attention.wq", "feed_forward.w2", "tok_embeddings", "attention_norm"}
    E.main(["--diff", str(tmp_path / "a"), str(tmp_path / "b")])
    out = capsys.readouterr().out
    assert "layers.1.feed_forward.w2.weight" in out and "rank     3, effective     3 of 64" in out


def test_diff_of_two_different_models_is_one_line(tmp_path, capsys):
    small = M.Transformer(M.ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=320))
    W.save_hf(small, tmp_path / "a", BYTE)
    W.save_hf(M.Transformer(M.ModelArgs(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=320)),
              tmp_path / "b", BYTE)
    gpt2 = data.get_tokenizer("gpt2", os.environ.get("DATA_MIRROR"))
    W.save_hf(small, tmp_path / "gpt2", W.hf_tokens(gpt2, chat=False))
    mixture = M.ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=320, n_experts=4)
    W.save_hf(M.Transformer(mixture), tmp_path / "moe", BYTE)
    for other, said in (("b", "are different models (n_layers 2 vs 3)"), ("gpt2", "reads the tokenizer"),
                        ("moe", "are different models (n_experts 0 vs 4, hidden_dim 192 vs None, expert_dim "
                                "None vs 192, moe_every None vs 1)")):
        with pytest.raises(SystemExit):
            config.run(E.main, ["--diff", str(tmp_path / "a"), str(tmp_path / other)])
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1 and said in err, err
