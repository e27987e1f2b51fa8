"""model.py: exact preset sizes, packed documents, KV-cache generation, and parity with Hugging Face's
LlamaForCausalLM (an independent implementation) through load_hf / save_hf / load_meta."""

import json
import math
import warnings

import pytest
import torch

import costs
import data
import helpers
import model as M
import weights as W


def tiny_args(**kw):
    base = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=300, ffn_hidden=176,
                rope_scaling=dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                  original_max_seq_len=64),
                max_seq_len=256)
    base.update(kw)
    return M.ModelArgs(**base)


@pytest.mark.parametrize("name,expected", [
    ("llama3-8b", 8_030_261_248), ("llama3.1-8b", 8_030_261_248), ("llama3-70b", 70_553_706_496),
    ("llama3.1-70b", 70_553_706_496), ("llama3.1-405b", 405_853_388_800),
    ("llama3.2-1b", 1_235_814_400), ("llama3.2-3b", 3_212_749_824)])
def test_preset_parameter_counts_on_meta_device(name, expected):
    with torch.device("meta"):
        model = M.Transformer(M.PRESETS[name])
    assert sum(p.numel() for p in model.parameters()) == expected
    assert costs.count_params(M.PRESETS[name]) == expected


def test_small_presets_span_cpu_sizes():
    sizes = [costs.count_params(M.PRESETS[n]) for n in ("tiny", "mini", "small", "medium")]
    assert sizes[0] < 1_000_000 and 50_000_000 < sizes[-1] < 200_000_000
    assert sizes == sorted(sizes)


def test_ffn_hidden_rule_matches_published_sizes():
    assert [M.PRESETS[n].hidden_dim for n in ("llama3-8b", "llama3-70b", "llama3.1-405b", "llama3.2-1b")] == \
        [14336, 28672, 53248, 8192]


def test_forward_shape_and_seeded_init():
    torch.manual_seed(0)
    a = M.Transformer(tiny_args())
    torch.manual_seed(0)
    b = M.Transformer(tiny_args())
    tokens = torch.randint(0, 300, (2, 17))
    out = a(tokens)
    assert out.shape == (2, 17, 300)
    assert torch.equal(out, b(tokens))
    # another seed, another model: in every weight matrix (the generator of each parameter is seeded from
    # the run's seed and the parameter's name, and a CPU generator keeps only 32 bits of its seed)
    c = M.Transformer(tiny_args())
    c.init_weights(seed=1)
    a.init_weights(seed=2)
    mats = [(n, p, q) for (n, p), (_, q) in zip(a.named_parameters(), c.named_parameters()) if p.dim() == 2]
    assert mats and not any(torch.equal(p, q) for _, p, q in mats)
    # and no two weights of the same shape are copies of each other. A CPU generator keeps 32 bits of its
    # seed, so two same-shaped weights start equal only if their (seed, name) digests collide: odds about
    # n^2 / 2^33 for n weights, 1e-4 for the 1,100 of Llama 3.1 405B.
    wk, wv = a.layers["0"].attention.wk.weight, a.layers["0"].attention.wv.weight
    assert wk.shape == wv.shape and not torch.equal(wk, wv)
    # 1/sqrt(2L)
    assert a.layers["0"].attention.wo.weight.std() < 0.8 * a.layers["0"].attention.wq.weight.std()


def test_dropout_drops_while_training_only_and_keeps_the_mean():
    """set_dropout(p) reaches the embedding and every block; in eval mode the logits are p = 0's exactly, in
    training mode they change with the RNG's state and repeat with it; the masks zero about p of a branch's
    elements and scale the rest by 1/(1-p)."""
    torch.manual_seed(0)
    model = M.Transformer(tiny_args())
    tokens = torch.randint(0, 300, (2, 17))
    plain = model.train()(tokens)
    M.set_dropout(model, 0.25)
    assert model.dropout == 0.25 and all(b.dropout == 0.25 for b in model.layers.values())
    assert torch.equal(model.eval()(tokens), plain)  # eval: nothing dropped
    model.train()
    torch.manual_seed(1)
    first = model(tokens)
    torch.manual_seed(1)
    assert torch.equal(model(tokens), first) and not torch.allclose(first, plain)
    x = torch.ones(200_000)
    kept = M.dropped(x, 0.25, training=True)
    assert abs((kept == 0).float().mean().item() - 0.25) < 0.01
    assert torch.equal(kept[kept != 0], torch.full_like(kept[kept != 0], 1 / 0.75))
    assert M.dropped(x, 0.25, training=False) is x and M.dropped(x, 0.0, training=True) is x


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # the CPU runs it as is
@pytest.mark.parametrize("mask", ["dense", "block"])
def test_packed_documents_equal_separate_runs(monkeypatch, mask):
    """Three documents packed in one row of 300 tokens (and a row holding one) give each document the
    outputs it has alone, with SDPA's dense mask and with FlexAttention's block mask (CUDA's path; on the
    CPU forward only: its backward has no CPU kernel, tests/gpu_check.py compares gradients on a GPU)."""
    if mask == "block":
        monkeypatch.setattr(M, "BLOCK_MASK_DEVICES", ("cpu",))
    torch.manual_seed(0)
    model = M.Transformer(tiny_args(max_seq_len=512)).eval()
    docs = [torch.randint(0, 300, (1, n)) for n in (100, 60, 140)]
    packed = torch.cat([torch.cat(docs, dim=1), torch.randint(0, 300, (1, 300))])
    doc_ids = torch.tensor([[0] * 100 + [1] * 60 + [2] * 140, [0] * 300])
    built = M.document_mask(doc_ids)
    assert isinstance(built, M.BlockMask) == (mask == "block")
    if mask == "block":  # tiles of 128 x 128: 9 per row, and of the first row's 6 causal ones, 1 is empty
        assert built.kv_num_blocks.sum() + built.full_kv_num_blocks.sum() == 5 + 6
    with torch.no_grad():
        out = model(packed, doc_ids=doc_ids)
        start = 0
        for doc in docs:
            n = doc.shape[1]
            torch.testing.assert_close(out[:1, start:start + n], model(doc), atol=1e-5, rtol=1e-5)
            start += n
        torch.testing.assert_close(out[1:], model(packed[1:]), atol=1e-5, rtol=1e-5)
        # without document ids the later documents see the earlier ones, so the outputs differ
        assert not torch.allclose(model(packed[:1])[:, 100:160], model(docs[1]), atol=1e-4)


@pytest.mark.parametrize("causal", [True, False])
def test_every_attention_backend_computes_the_same_attention(causal):
    """--attn-backend: SDPA's own choice, FlashAttention (K and V grouped: enable_gqa, no copies) and the
    unfused reference (K and V repeated to every query head) give the same output and gradients; 8 query
    heads over 2 key/value heads. (cudnn, CUDA only, is checked by tests/gpu_check.py.)"""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, h, 16, 8, dtype=torch.float64, requires_grad=True) for h in (8, 2, 2))
    out = {}
    for backend in ("auto", "flash", "math"):
        y = M.attention(q, k, v, None, causal, backend)
        out[backend] = (y, *torch.autograd.grad((y * torch.linspace(-1, 1, 8)[None, None, None]).sum(),
                                                (q, k, v)))
    for backend in ("auto", "flash"):
        for a, b in zip(out[backend], out["math"]):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    model = M.Transformer(tiny_args())
    M.set_attn_backend(model, "flash")
    assert {m.backend for m in model.modules() if isinstance(m, M.Attention)} == {"flash"}


def test_bf16_attention_on_a_cpu_is_computed_in_fp32():
    """On a CPU, SDPA's bf16 kernels are slower than its fp32 ones (the flash kernel's forward and backward
    3.5 times, for 8 x 4 heads x 128 tokens): bf16 attention there is fp32 attention, rounded once."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, h, 16, 8).bfloat16() for h in (8, 2, 2))
    got = M.attention(q, k, v, None, True)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, M.attention(q.float(), k.float(), v.float(), None, True).bfloat16())


def test_rope_scaling_changes_only_low_frequencies():
    a = tiny_args(dim=512, n_heads=4, n_kv_heads=4, rope_scaling=M.LLAMA31_ROPE)
    plain = M.rope_frequencies(tiny_args(dim=512, n_heads=4, n_kv_heads=4, rope_scaling=None))
    scaled = M.rope_frequencies(a)
    wavelen = 2 * math.pi / plain
    assert torch.equal(scaled[wavelen < 8192 / 4], plain[wavelen < 8192 / 4])
    torch.testing.assert_close(scaled[wavelen > 8192], plain[wavelen > 8192] / 8)


def test_greedy_generation_with_cache_equals_recomputation():
    torch.manual_seed(0)
    model = M.Transformer(tiny_args()).eval()
    prompt = torch.randint(0, 300, (2, 5))
    cached = M.generate(model, prompt, max_new_tokens=20, temperature=0)
    seq = prompt
    for _ in range(20):  # no cache: run the whole sequence again for every new token
        nxt = model(seq)[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], dim=1)
    assert torch.equal(cached, seq[:, 5:])


def test_sampling_filters():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    g = torch.Generator().manual_seed(0)
    assert {M.sample_next(logits, 1.0, top_k=1, generator=g).item() for _ in range(20)} == {3}
    # top_p 0.5: token 3 alone has p=0.64 >= 0.5, so only it survives
    assert {M.sample_next(logits, 1.0, top_p=0.5, generator=g).item() for _ in range(20)} == {3}
    assert len({M.sample_next(logits, 5.0, generator=g).item() for _ in range(200)}) == 4


# ---------------------------------------------------------------------------------------------------
# Hugging Face parity

import transformers  # noqa: E402  (test-only dependency: requirements-test.txt)


def hf_tiny(tied: bool):
    cfg = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=300, rms_norm_eps=1e-5, max_position_embeddings=256, tie_word_embeddings=tied,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64}, rope_theta=500000.0)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # HF zero-inits nothing odd, but make norms non-trivial so they are really tested
        for n, p in hf.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    return hf


@pytest.mark.parametrize("tied", [False, True])
def test_load_hf_matches_transformers_logits_and_round_trips(tmp_path, tied):
    hf = hf_tiny(tied)
    hf.save_pretrained(tmp_path / "hf")
    ours = helpers.load_hf(tmp_path / "hf")
    assert ours.args.tie_embeddings == tied and ours.args.rope_scaling["factor"] == 8.0
    tokens = torch.randint(0, 300, (2, 100))  # past original_max_position_embeddings, scaled RoPE matters
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), hf(tokens).logits, atol=1e-5, rtol=1e-5)
    # round trip: ours -> HF directory -> the same tensors, loadable by transformers itself
    W.save_hf(ours, tmp_path / "back")
    again = W.read_safetensors(tmp_path / "back" / "model.safetensors")
    reference = {k: v for k, v in hf.state_dict().items() if not (tied and k == "lm_head.weight")}
    assert again.keys() == reference.keys()
    for k, v in reference.items():
        assert torch.equal(again[k], v), k
    hf2 = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        torch.testing.assert_close(hf2(tokens).logits, hf(tokens).logits, atol=0, rtol=0)


def test_generation_matches_transformers_greedy(tmp_path):
    hf = hf_tiny(False)
    hf.save_pretrained(tmp_path / "hf")
    ours = helpers.load_hf(tmp_path / "hf")
    prompt = torch.randint(0, 300, (1, 6))
    theirs = hf.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0)[:, 6:]
    assert torch.equal(M.generate(ours, prompt, 12, temperature=0), theirs)


@pytest.mark.parametrize("n_shards", [1, 2])
def test_load_meta_permutes_rope_rows_and_joins_model_parallel_shards(tmp_path, n_shards):
    torch.manual_seed(0)
    args = M.ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, multiple_of=32,
                       ffn_dim_multiplier=1.3, rope_scaling=dict(M.LLAMA31_ROPE), max_seq_len=128)
    ours = M.Transformer(args).eval()
    # Write what Meta's release looks like: interleaved-pair q/k rows, split as its model-parallel ranks were.
    state = {k: v.clone() for k, v in ours.state_dict().items()}
    for k in state:
        if k.endswith("wq.weight"):
            state[k] = helpers.hf_to_meta_rope_permute(state[k], args.n_heads)
        elif k.endswith("wk.weight"):
            state[k] = helpers.hf_to_meta_rope_permute(state[k], args.n_kv_heads)
    for r in range(n_shards):
        shard = {}
        for k, v in state.items():
            dim = W._META_CAT_DIM.get(k.split(".")[-2])
            shard[k] = v.chunk(n_shards, dim=dim)[r].clone() if dim is not None and n_shards > 1 else v
        torch.save(shard, tmp_path / f"consolidated.{r:02d}.pth")
    (tmp_path / "params.json").write_text(json.dumps(dict(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, multiple_of=32, ffn_dim_multiplier=1.3,
        norm_eps=1e-5, rope_theta=500000.0, use_scaled_rope=True, max_seq_len=128)))
    loaded = W.load_meta(tmp_path)
    tokens = torch.randint(0, 256, (1, 40))
    with torch.no_grad():
        assert torch.equal(loaded(tokens), ours(tokens))


def test_load_hf_refuses_wrong_shapes(tmp_path):
    hf = hf_tiny(False)
    hf.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["intermediate_size"] = 128
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="mlp|feed_forward"):
        helpers.load_hf(tmp_path)


# ---------------------------------------------------------------------------------------------------
# FLOPs and memory arithmetic


def test_flops_per_token_conventions():
    a = M.PRESETS["llama3-8b"]
    n_matmul = costs.count_params(a) - a.vocab_size * a.dim  # everything but the embedding table
    f = costs.flops_per_token(a, 8192)
    assert f["palm"] == 6 * n_matmul + 12 * 32 * 4096 * 8192
    assert f["megatron"] == 6 * n_matmul + 6 * 32 * 4096 * 8192
    tied = M.PRESETS["llama3.2-1b"]  # a tied head still costs its matmul
    assert costs.flops_per_token(tied, 1)["palm"] == 6 * costs.count_params(tied) + 12 * 16 * 2048


# ---------------------------------------------------------------------------------------------------
# Hostile inputs: impossible model args, damaged safetensors and JSON files, interrupted exports

import errno  # noqa: E402
import re  # noqa: E402
import struct  # noqa: E402
from dataclasses import asdict  # noqa: E402

ROPE = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_seq_len=64)


@pytest.mark.parametrize("kw,message", [
    (dict(rope_scaling=ROPE | dict(factor=0.0)), "factor must be a positive number"),
    (dict(rope_scaling=ROPE | dict(factor=-8.0)), "factor must be a positive number"),
    (dict(rope_scaling=ROPE | dict(factor=0.5)), "factor must be at least 1"),
    (dict(rope_scaling=ROPE | dict(factor=math.nan)), "factor must be a positive number"),
    (dict(rope_scaling=ROPE | dict(factor=math.inf)), "factor must be a positive number"),
    (dict(rope_scaling=ROPE | dict(factor="8")), "factor must be a positive number"),
    (dict(rope_scaling=ROPE | dict(factor=True)), "factor must be a positive number"),
    (dict(rope_scaling=ROPE | dict(factor=None)), "factor must be a positive number"),
    (dict(rope_scaling=ROPE | dict(low_freq_factor=0.0)), "low_freq_factor must be a positive number"),
    (dict(rope_scaling=ROPE | dict(high_freq_factor=1.0)), "high_freq_factor .* must be larger"),
    (dict(rope_scaling=ROPE | dict(high_freq_factor=0.5)), "high_freq_factor .* must be larger"),
    (dict(rope_scaling=ROPE | dict(high_freq_factor=math.nan)), "high_freq_factor must be a positive number"),
    (dict(rope_scaling=ROPE | dict(original_max_seq_len=0)), "original_max_seq_len must be a positive"),
    (dict(rope_scaling=ROPE | dict(original_max_seq_len=-64)), "original_max_seq_len must be a positive"),
    (dict(rope_scaling=ROPE | dict(original_max_seq_len=math.nan)), "original_max_seq_len must be a"),
    (dict(rope_scaling=ROPE | dict(original_max_seq_len="64")), "original_max_seq_len must be a positive"),
    (dict(rope_scaling={k: v for k, v in ROPE.items() if k != "factor"}), "missing factor"),
    (dict(rope_scaling=ROPE | dict(rope_type="llama3")), "unknown 'rope_type'"),
    (dict(rope_scaling={}), "missing factor"),
    (dict(rope_scaling="llama3"), "rope_scaling must be null or an object"),
    (dict(rope_scaling=[8.0, 1.0, 4.0, 64]), "rope_scaling must be null or an object"),
    (dict(ffn_hidden=None, ffn_dim_multiplier=math.nan), "ffn_dim_multiplier must be a positive number"),
    (dict(ffn_hidden=None, ffn_dim_multiplier=math.inf), "ffn_dim_multiplier must be a positive number"),
    (dict(ffn_hidden=None, ffn_dim_multiplier=-1.3), "ffn_dim_multiplier must be a positive number"),
    (dict(ffn_hidden=None, ffn_dim_multiplier="1.3"), "ffn_dim_multiplier must be a positive number"),
    (dict(ffn_hidden=None, ffn_dim_multiplier=1e-9), "FFN hidden size"),
    (dict(ffn_hidden=None, ffn_dim_multiplier=1e300), "FFN hidden size"),
    (dict(tie_embeddings="false"), "tie_embeddings must be true or false"),
    (dict(tie_embeddings=1), "tie_embeddings must be true or false"),
    (dict(tie_embeddings=None), "tie_embeddings must be true or false"),
    (dict(norm_eps=True), "norm_eps must be a positive number"),
    (dict(rope_theta=10 ** 400), "rope_theta must be a positive number"),
    (dict(vocab_size=10 ** 5000), "vocab_size must be at most"),
    (dict(max_seq_len=2 ** 63), "max_seq_len must be at most"),
])
def test_model_args_refuse_impossible_values(kw, message):
    """Each would build a model that trains on with NaN frequencies or loss, or crash later inside torch."""
    with pytest.raises(ValueError, match=message):
        tiny_args(**kw)


def test_model_args_from_dict_round_trips_every_preset():
    for args in M.PRESETS.values():
        assert M.ModelArgs.from_dict(json.loads(json.dumps(asdict(args)))) == args


@pytest.mark.parametrize("d,message", [
    (None, "must be an object"), ([["dim", 64]], "must be an object"), ("dim=64", "must be an object"),
    (asdict(tiny_args()) | {"n_expert": 8, "moe": True}, "unknown keys 'n_expert', 'moe'"),
    (asdict(tiny_args()) | {3: 1}, "unknown keys 3"),
    ({k: v for k, v in asdict(tiny_args()).items() if k != "dim"}, "miss dim"),
    (asdict(tiny_args()) | {"dim": "64"}, "dim must be a positive integer"),
    (asdict(tiny_args()) | {"dim": 64.0}, "dim must be a positive integer"),
    (asdict(tiny_args()) | {"rope_scaling": ROPE | {"factor": 0}}, "factor must be a positive number"),
])
def test_model_args_from_dict_refuses_with_one_value_error(d, message):
    with pytest.raises(ValueError, match=message):
        M.ModelArgs.from_dict(d)


def write_st(path, header, data=b"", length=None):
    """A hand-made safetensors file: the 8-byte length (`length` if given), the header (an object, dumped,
    or raw bytes), then `data`."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)
    return path


F32x4 = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}


def short_id(v):
    """Test ids of at most 40 characters (some inputs are 5000 digits or 100,000 brackets long)."""
    return repr(v)[:40] if isinstance(v, (str, bytes)) and len(v) > 40 else None


@pytest.mark.parametrize("header,data,length,message", [
    (b"", b"", None, "not valid JSON"),  # a file of 8 bytes: an empty header
    ({"w": F32x4}, bytes(16), 10 ** 6, "past the end of the file"),  # truncated
    ({"w": F32x4}, bytes(16), 2 ** 63 - 1, "past the end of the file"),  # would allocate exabytes
    (b"{not json", b"", None, "not valid JSON"),
    (b'{"w": "\xff\xfe"}', b"", None, "not valid JSON"),  # not UTF-8
    (b"[" * 100_000 + b"]" * 100_000, b"", None, "not valid JSON.*RecursionError"),
    (b'{"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, ' + b"9" * 5000 + b"]}}", b"", None,
     "not valid JSON"),
    ([1, 2], b"", None, "not a JSON object"),
    ({"w": 3}, b"", None, "not an object with dtype, shape and data_offsets"),
    ({"w": {"dtype": "F32", "shape": [2, 2]}}, bytes(16), None, "not an object with dtype"),
    ({"w": F32x4 | {"dtype": "Q7"}}, bytes(16), None, "dtype 'Q7'"),
    ({"w": F32x4 | {"dtype": ["F32"]}}, bytes(16), None, "dtype"),
    ({"w": F32x4 | {"shape": "2x2"}}, bytes(16), None, "shape '2x2'"),
    ({"w": F32x4 | {"shape": [-2, -2]}}, bytes(16), None, "not a list of non-negative integers"),
    ({"w": F32x4 | {"shape": [2.0, 2.0]}}, bytes(16), None, "not a list of non-negative integers"),
    ({"w": F32x4 | {"shape": [4, None]}}, bytes(16), None, "not a list of non-negative integers"),
    ({"w": F32x4 | {"data_offsets": [0, 400]}}, bytes(16), None, "within its 16 bytes"),
    ({"w": F32x4 | {"data_offsets": [16, 0]}}, bytes(16), None, "data_offsets"),
    ({"w": F32x4 | {"data_offsets": [-16, 0]}}, bytes(16), None, "data_offsets"),
    ({"w": F32x4 | {"data_offsets": [0]}}, bytes(16), None, "data_offsets"),
    ({"w": F32x4 | {"data_offsets": [0, "16"]}}, bytes(16), None, "data_offsets"),
    ({"w": F32x4 | {"data_offsets": [0, 8]}}, bytes(16), None, "8 bytes of data, but F32 x .2, 2. takes 16"),
    ({"w": F32x4 | {"shape": [4, 4]}}, bytes(16), None, "takes 64"),
], ids=short_id)
def test_damaged_safetensors_are_one_value_error_naming_the_file(tmp_path, header, data, length, message):
    """Refused from the header alone, by both the header reader (hf_state's shape checks) and the reader."""
    f = write_st(tmp_path / "bad.safetensors", header, data, length)
    for read in (W._safetensors_header, W.read_safetensors):
        with pytest.raises(ValueError, match=re.escape(str(f)) + ".*" + message):
            read(f)


@pytest.mark.parametrize("size", [0, 3, 7])
def test_safetensors_shorter_than_its_length_field(tmp_path, size):
    (tmp_path / "short.safetensors").write_bytes(b"\x10" * size)
    with pytest.raises(ValueError, match="short.safetensors.*too few for the header length"):
        W.read_safetensors(tmp_path / "short.safetensors")


def test_safetensors_round_trip_odd_shapes_and_a_missing_name(tmp_path):
    tensors = {"scalar": torch.tensor(3.5), "empty": torch.zeros(0, 3), "bf16": torch.randn(3, 5).bfloat16(),
               "ids": torch.arange(7), "mask": torch.tensor([True, False])}
    W.write_safetensors(tensors, tmp_path / "ok.safetensors")
    back = W.read_safetensors(tmp_path / "ok.safetensors")
    assert back.keys() == tensors.keys() and all(torch.equal(back[k], v) for k, v in tensors.items())
    with pytest.raises(ValueError, match="holds no tensor 'nope'"):
        W.read_safetensors(tmp_path / "ok.safetensors", ["nope"])


HF_CONFIG = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=300, rms_norm_eps=1e-5, max_position_embeddings=256,
                 rope_theta=500000.0,
                 rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 64})


@pytest.mark.parametrize("text,message", [
    ("{not json", "not valid JSON"),
    ("[" * 100_000, "not valid JSON.*RecursionError"),
    ('{"hidden_size": ' + "9" * 5000 + "}", "not valid JSON"),
    ("[1, 2]", "must hold a JSON object"),
    ("null", "must hold a JSON object"),
    (json.dumps({"hidden_size": 64}), "misses num_hidden_layers"),
    (json.dumps(HF_CONFIG | {"rope_scaling": "llama3"}), "rope_scaling must be an object"),
    (json.dumps(HF_CONFIG | {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}),
     "llama3 needs low_freq_factor"),
    (json.dumps(HF_CONFIG | {"rope_scaling": {"type": "linear", "factor": 2.0}}), "unsupported rope type"),
    (json.dumps(HF_CONFIG | {"rope_scaling": HF_CONFIG["rope_scaling"] | {"factor": math.nan}}),
     "factor must be a positive number"),
    (json.dumps(HF_CONFIG | {"rope_scaling": HF_CONFIG["rope_scaling"] | {"high_freq_factor": 1.0}}),
     "must be larger than low_freq_factor"),
    (json.dumps(HF_CONFIG | {"hidden_size": "64"}), "dim must be a positive integer"),
    (json.dumps(HF_CONFIG | {"tie_word_embeddings": "no"}), "tie_embeddings must be true or false"),
    (json.dumps(HF_CONFIG | {"head_dim": 32}), "head_dim 32"),
], ids=short_id)
def test_bad_hf_config_is_one_value_error_naming_it(tmp_path, text, message):
    (tmp_path / "config.json").write_text(text)
    write_st(tmp_path / "model.safetensors", {})  # a folder that would otherwise be read
    for read in (W.hf_state, helpers.load_hf):
        with pytest.raises(ValueError, match=re.escape(str(tmp_path / "config.json")) + ".*" + message):
            read(tmp_path)


def test_hf_state_names_a_damaged_safetensors_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(HF_CONFIG))
    write_st(tmp_path / "model.safetensors", {"w": F32x4}, bytes(16), length=10 ** 9)
    with pytest.raises(ValueError, match="model.safetensors.*past the end of the file"):
        W.hf_state(tmp_path)


META_PARAMS = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, multiple_of=32,
                   ffn_dim_multiplier=1.3, norm_eps=1e-5, rope_theta=500000.0, use_scaled_rope=True,
                   max_seq_len=128)


@pytest.mark.parametrize("text,message", [
    ("{not json", "not valid JSON"),
    ("[" * 100_000, "not valid JSON.*RecursionError"),
    ("[]", "must hold a JSON object"),
    (json.dumps({k: v for k, v in META_PARAMS.items() if k != "norm_eps"}), "misses norm_eps"),
    (json.dumps(META_PARAMS | {"rope_scaling_factor": 0}), "factor must be a positive number"),
    (json.dumps(META_PARAMS | {"rope_scaling_factor": -32.0}), "factor must be a positive number"),
    (json.dumps(META_PARAMS | {"rope_scaling_factor": math.nan}), "factor must be a positive number"),
    (json.dumps(META_PARAMS | {"rope_scaling_factor": "32"}), "factor must be a positive number"),
    (json.dumps(META_PARAMS | {"use_scaled_rope": "yes"}), "use_scaled_rope must be true or false"),
    (json.dumps(META_PARAMS | {"ffn_dim_multiplier": math.inf}), "ffn_dim_multiplier must be a positive"),
], ids=short_id)
def test_bad_meta_params_is_one_value_error_naming_it(tmp_path, text, message):
    (tmp_path / "params.json").write_text(text)
    with pytest.raises(ValueError, match=re.escape(str(tmp_path / "params.json")) + ".*" + message):
        W.load_meta(tmp_path)


def export_files(path):
    return {f.name: f.read_bytes() for f in path.iterdir()}


def test_save_hf_replaces_an_earlier_export_and_syncs(tmp_path, monkeypatch):
    torch.manual_seed(0)
    a, b = M.Transformer(tiny_args(n_layers=1)), M.Transformer(tiny_args(n_layers=1))
    synced = []
    real_fsync = W.os.fsync
    monkeypatch.setattr(W.os, "fsync", lambda fd: synced.append(fd) or real_fsync(fd))
    (tmp_path / "out").mkdir()  # an empty folder is taken
    byte = data.get_tokenizer("byte")
    W.save_hf(a, tmp_path / "out", W.hf_tokens(byte, False), W.hf_tokenizer_files(byte, False))
    assert sorted(export_files(tmp_path / "out")) == sorted(W.HF_EXPORT_FILES) and len(synced) >= 7
    W.save_hf(b, tmp_path / "out")  # an earlier export is replaced as a whole: no stale generation config
    assert sorted(export_files(tmp_path / "out")) == ["config.json", "model.safetensors"]
    assert torch.equal(helpers.load_hf(tmp_path / "out").output.weight, b.output.weight)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary or old folder left


@pytest.mark.parametrize("existing", ["notes.txt", "checkpoint/meta.json", "model.safetensors/x", "file"])
def test_save_hf_refuses_a_folder_holding_other_files(tmp_path, existing):
    out = tmp_path / "out"
    if existing == "file":
        out.write_text("not a folder")
    else:
        (out / existing).parent.mkdir(parents=True)
        (out / existing).write_text("mine")
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    with pytest.raises(FileExistsError, match="nothing was written"):
        W.save_hf(M.Transformer(tiny_args(n_layers=1)), out)
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before


@pytest.mark.parametrize("earlier", [False, True])
def test_save_hf_interrupted_leaves_no_half_export(tmp_path, monkeypatch, earlier):
    """A full disk halfway through model.safetensors: the target is absent, or the earlier export intact,
    and no temporary folder is left beside it."""
    out = tmp_path / "out"
    if earlier:
        W.save_hf(M.Transformer(tiny_args(n_layers=1)), out)
        before = export_files(out)

    def half_then_full(tensors, path):
        with open(path, "wb") as f:
            f.write(b"\0" * 1000)
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(W, "write_safetensors", half_then_full)
    with pytest.raises(OSError, match="No space left"):
        W.save_hf(M.Transformer(tiny_args(n_layers=1)), out)
    assert sorted(p.name for p in tmp_path.iterdir()) == (["out"] if earlier else [])
    if earlier:
        assert export_files(out) == before


def test_the_kernel_that_computes_attention_is_asked_of_sdpa(monkeypatch):
    """costs.attention_kernel names the kernel attention() runs (flex for a BlockMask), as SDPA itself picks it
    under --attn-backend; a kernel that cannot take the inputs is a ValueError carrying SDPA's reasons, which
    checks.attention_kernel turns into one line naming the flag, the precision and the device."""
    import checks
    import config
    q, kv = torch.randn(1, 4, 16, 8), torch.randn(1, 2, 16, 8)
    assert costs.attention_kernel(q, kv, kv, None, True, "math") == "math"
    assert costs.attention_kernel(q, kv, kv, None, True, "flash") == "flash"  # (the CPU's flash kernel)
    mask = torch.ones(16, 16, dtype=torch.bool).tril()
    assert costs.attention_kernel(q, kv, kv, mask, False, "auto") in ("flash", "math")  # SDPA's own choice
    block = M.create_block_mask(lambda b, h, i, j: j <= i, None, None, 16, 16, device="cpu", _compile=False)
    assert costs.attention_kernel(q, kv, kv, block, False) == "flex"

    def no_kernel(*args, **kwargs):  # what SDPA does on a GPU for flash in fp32
        warnings.warn("Flash attention only supports fp16 and bf16 data types; got torch.float32")
        return -1
    monkeypatch.setattr(torch, "_fused_sdp_choice", no_kernel)
    with pytest.raises(ValueError, match="Flash attention only supports fp16 and bf16"):
        costs.attention_kernel(q, kv, kv, None, True, "flash")
    args = config.get_parser().parse_args(["--model", "tiny", "--attn-backend", "flash"])
    with pytest.raises(config.ConfigError, match=r"--attn-backend flash cannot compute this run's attention "
                                                  r"\(fp32, head_dim 16\) on cpu: Flash attention only"):
        checks.attention_kernel(args, M.PRESETS["tiny"], torch.device("cpu"), "fp32", None)
