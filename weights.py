"""Weights in other programs' formats, an appendix train.py never calls (as gpt-fast keeps its
converter out of its model file): Hugging Face folders read and written, Meta's consolidated
checkpoints read. checkpoint.py consolidates into them; --init reads them.

  1. safetensors     by hand: an 8-byte header length, a JSON header, the raw tensors; every entry
                     checked against the file before a byte of it is read
  2. Hugging Face    our names and config as transformers' (LlamaForCausalLM, and
                     LlamaForSequenceClassification for a reward model); hf_state reads a folder
                     lazily, tensor by tensor; save_hf writes one, all or nothing (write_export)
  3. Meta            params.json and consolidated.*.pth, whose wq/wk rows pair adjacent dimensions
                     for RoPE where ours pair (i, i + head_dim/2): meta_to_hf_rope_permute
  4. The tokenizer   a tiktoken Encoding as tokenizer.json, tokenizer_config.json (with the chat
                     template) and special_tokens_map.json
"""

from __future__ import annotations

import json
import math
import mmap
import os
import re
import shutil
import struct
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

import torch

import data
import model as M
import parallel as P
from model import ModelArgs, Transformer


# Simple enough to need no package. The header: {name: {dtype, shape, data_offsets}}; little-endian.
_ST_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool}


_ST_MAX_HEADER = 100_000_000  # the safetensors library's limit: a longer header is damaged


def _one_line(e: BaseException, limit: int = 120) -> str:
    text = " ".join(f"{type(e).__name__}: {e}".split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _parse_json(raw: bytes, what: str):
    """json.loads, every failure (deep nesting raises RecursionError) a ValueError naming `what`."""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise ValueError(f"{what} is not valid JSON ({_one_line(e)})") from None


def args_in(file: Path, parse) -> "ModelArgs":
    """The ModelArgs a config file holds, by parse (args_from_hf_config, args_from_meta_params)."""
    found = read_json_object(file)
    try:
        return parse(found)
    except ValueError as e:
        raise ValueError(f"{file}: {e}") from None


def read_json_object(path) -> dict:
    """A JSON file that must hold an object (config.json, params.json) -> the dict."""
    obj = _parse_json(data.regular_file(path, "file").read_bytes(), str(path))  # (a FIFO would hang the read)
    if not isinstance(obj, dict):
        raise ValueError(f"{path} must hold a JSON object {{...}}, not {M.show(obj)}")
    return obj


def _safetensors_entry_problem(info, data_len: int) -> str | None:
    """What is wrong with a tensor's header entry, judged by the data size alone; None: nothing."""
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
        return f"is {M.show(info)}, not an object with dtype, shape and data_offsets"
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str) or dtype not in _ST_DTYPES:
        return f"has dtype {M.show(dtype)}, not one of {', '.join(_ST_DTYPES)}"
    # a zero dimension makes any others legal, but their product must fit torch's int64 strides
    if not isinstance(shape, list) or not all(M.is_int(d) and d >= 0 for d in shape) or \
            math.prod(max(d, 1) for d in shape) > 2 ** 62:
        return f"has shape {M.show(shape)}, not a list of non-negative integers"
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(M.is_int, offsets))
            and 0 <= offsets[0] <= offsets[1] <= data_len):
        return f"has data_offsets {M.show(offsets)}, not [start, end] within its {data_len} bytes of data"
    need = math.prod(shape) * _ST_DTYPES[dtype].itemsize
    if offsets[1] - offsets[0] != need:
        return f"has {offsets[1] - offsets[0]} bytes of data, but {dtype} x {shape} takes {need}"
    return None


def _safetensors_header(path) -> tuple[int, dict]:
    """(where data starts, {name: {dtype, shape, data_offsets}}), reading no tensor. Each entry is
    checked here: a damaged or hostile file is one ValueError, not a struct, memory or torch one."""
    size = os.path.getsize(data.regular_file(path, "weight file"))  # (a FIFO would hang every reader)
    damaged = f"{path} is not a valid safetensors file"
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ValueError(f"{damaged}: {size} bytes, too few for the header length")
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8:  # before reading: the length alone could ask for exabytes
            raise ValueError(f"{damaged}: its header length {n} is past the end of the file ({size} bytes); "
                             "is it truncated?")
        if n > _ST_MAX_HEADER:
            raise ValueError(f"{damaged}: its header of {n} bytes is over the format's {_ST_MAX_HEADER}")
        header = _parse_json(f.read(n), f"the header of {path}")
    if not isinstance(header, dict):
        raise ValueError(f"{damaged}: its header is {M.show(header)}, not a JSON object")
    header.pop("__metadata__", None)
    for name, info in header.items():
        problem = _safetensors_entry_problem(info, size - 8 - n)
        if problem:
            raise ValueError(f"{damaged}: tensor {M.show(name)} {problem}")
    return 8 + n, header


def read_safetensors(path, names=None) -> dict[str, torch.Tensor]:
    """A .safetensors file (or only `names`) -> CPU tensors, via a memory map (files can be big)."""
    base, header = _safetensors_header(path)
    out = {}
    # copy-on-write: torch wants writable memory
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) as m:
        for name in header if names is None else names:
            if name not in header:
                raise ValueError(f"{path} holds no tensor {M.show(name)}")
            info = header[name]
            dtype, count = _ST_DTYPES[info["dtype"]], math.prod(info["shape"])
            t = torch.frombuffer(m, dtype=dtype, count=count, offset=base + info["data_offsets"][0]) \
                if count else torch.empty(0, dtype=dtype)
            out[name] = t.reshape(info["shape"]).clone()
            del t  # no view of the map may outlive it
    return out


def write_safetensors(tensors: dict[str, torch.Tensor], path):
    names = {v: k for k, v in _ST_DTYPES.items()}
    header, offset, blobs = {}, 0, []
    for name, t in tensors.items():
        t = t.detach().contiguous().cpu()
        b = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""  # a 0-dim one too
        header[name] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset
                                                                                          + len(b)]}
        blobs.append(b)
        offset += len(b)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)  # the format pads the header to 8-byte alignment
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


_HF_LAYER_NAMES = {  # ours -> Hugging Face, inside layers.N / model.layers.N
    "attention.wq.weight": "self_attn.q_proj.weight", "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight", "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight", "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight", "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}


STEP_RE = re.compile(r"step_(\d+)")  # a checkpoint's step folder (checkpoint.py writes them)


def folder_format(path) -> str | None:
    """Which weights a folder holds: "checkpoint" (an out-dir of this project's scripts or one of its step
    folders), "hf" (a Hugging Face folder: config.json), "meta" (a Meta folder: params.json), or None."""
    path = Path(path)
    if not path.is_dir():
        return None
    steps = any(STEP_RE.fullmatch(d.name) and d.is_dir() for d in path.glob("step_*"))
    if (path / "latest").exists() or steps or ((path / "meta.json").is_file() and any(path.glob("shard_pp*_tp*.pt"))):
        return "checkpoint"
    # (exists, not is_file: a description that is no regular file is refused when it is read, not passed over)
    return "hf" if (path / "config.json").exists() else "meta" if (path / "params.json").exists() else None


def hf_name(ours: str, classifier: bool = False) -> str:
    """Our parameter name -> Hugging Face's; classifier: LlamaForSequenceClassification's head. A
    mixture's router and experts keep Mistral's names (feed_forward.gate, feed_forward.experts.E.w1)
    under Mixtral's block_sparse_moe, as transformers writes them."""
    if ours.startswith("layers."):
        _, i, rest = ours.split(".", 2)
        moe = rest.startswith(("feed_forward.gate.", "feed_forward.experts."))
        return f"model.layers.{i}." + (rest.replace("feed_forward.", "block_sparse_moe.", 1) if moe
                                       else _HF_LAYER_NAMES[rest])
    return {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
            "output.weight": "score.weight" if classifier else "lm_head.weight"}[ours]


_HF_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size")
_HF_ROPE_KEYS = {"factor": "factor", "low_freq_factor": "low_freq_factor",  # ours -> Hugging Face's
                 "high_freq_factor": "high_freq_factor",
                 "original_max_seq_len": "original_max_position_embeddings"}


def args_from_hf_config(cfg: dict) -> ModelArgs:
    """A Hugging Face config.json's contents -> ModelArgs; ValueError for a config not of a Llama,
    with a rope type other than llama3, or with impossible values (ModelArgs checks those)."""
    if not isinstance(cfg, dict):
        raise ValueError(f"the config must be a JSON object, got {M.show(cfg)}")
    missing = [k for k in _HF_REQUIRED if k not in cfg]
    if missing:
        raise ValueError(f"the config misses {', '.join(missing)}: is it a Llama model's config.json?")
    # transformers >= 5 nests rope settings in rope_parameters; before, rope_theta + rope_scaling
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise ValueError(f"rope_scaling must be an object, got {M.show(rope)}")
    theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
    kind, scaling = rope.get("rope_type", rope.get("type")), None
    if kind == "llama3":
        missing = [hf for hf in _HF_ROPE_KEYS.values() if hf not in rope]
        if missing:
            raise ValueError(f"rope type llama3 needs {', '.join(missing)} in rope_scaling")
        scaling = {ours: rope[hf] for ours, hf in _HF_ROPE_KEYS.items()}
    elif kind not in ("default", None):  # another scaling (linear, yarn...): ignoring it is wrong
        raise ValueError(f"unsupported rope type {M.show(kind)}: only llama3 and default are")
    labels, experts = classifier_labels(cfg), hf_experts(cfg)
    args = ModelArgs(dim=cfg["hidden_size"], n_layers=cfg["num_hidden_layers"],
                     n_heads=cfg["num_attention_heads"], n_kv_heads=cfg.get("num_key_value_heads"),
                     vocab_size=cfg["vocab_size"], ffn_hidden=cfg["intermediate_size"],
                     norm_eps=cfg.get("rms_norm_eps", 1e-5), rope_theta=theta, rope_scaling=scaling,
                     max_seq_len=cfg.get("max_position_embeddings", 2048),
                     # (a classifier's head is its own "score": nothing to tie)
                     tie_embeddings=False if labels else cfg.get("tie_word_embeddings", False),
                     num_labels=labels, **experts)
    if cfg.get("head_dim") not in (None, args.head_dim):
        raise ValueError(f"head_dim {M.show(cfg['head_dim'])} is not hidden_size / num_attention_heads = "
                         f"{args.head_dim}, which this model requires")
    return args


def hf_experts(cfg: dict) -> dict:
    """A Mixtral config's experts as ModelArgs fields (every layer a mixture; intermediate_size is
    each expert's); {} for a Llama. Mixtral's sliding-window attention is refused: ours attends to
    the whole context."""
    if cfg.get("model_type") != "mixtral":
        return {}
    if cfg.get("sliding_window") is not None:
        raise ValueError(f"sliding_window {M.show(cfg['sliding_window'])}: this model attends to the whole "
                         "context (Mixtral's sliding window is not supported)")
    return {"n_experts": cfg.get("num_local_experts", 8), "top_k": cfg.get("num_experts_per_tok", 2)}


def classifier_labels(cfg: dict) -> int | None:
    """A sequence classifier's number of outputs (transformers' id2label, default 2), else None."""
    if not any("ForSequenceClassification" in str(a) for a in cfg.get("architectures") or []):
        return None
    labels = cfg.get("id2label")
    return len(labels) if isinstance(labels, dict) and labels else cfg.get("num_labels", 2)


def hf_config(args: ModelArgs) -> dict:
    """config.json of a LlamaForCausalLM (a MixtralForCausalLM for a mixture of experts in every
    layer), or its ForSequenceClassification given num_labels."""
    family = "Mixtral" if args.n_experts else "Llama"
    if args.n_experts and args.moe_every > 1:
        raise ValueError(f"a Hugging Face Mixtral has experts in every layer, this model in one of every "
                         f"{args.moe_every}: it has no Hugging Face form here (its checkpoints load with --init)")
    kind = f"{family}ForSequenceClassification" if args.num_labels else f"{family}ForCausalLM"
    ffn = args.expert_dim if args.n_experts else args.hidden_dim
    cfg = {"architectures": [kind], "model_type": family.lower(), "hidden_act": "silu",
           "hidden_size": args.dim, "intermediate_size": ffn, "num_hidden_layers": args.n_layers,
           "num_attention_heads": args.n_heads, "num_key_value_heads": args.n_kv_heads,
           "head_dim": args.head_dim, "vocab_size": args.vocab_size, "rms_norm_eps": args.norm_eps,
           "rope_theta": args.rope_theta, "max_position_embeddings": args.max_seq_len,
           "tie_word_embeddings": args.tie_embeddings, "attention_bias": False, "mlp_bias": False,
           "torch_dtype": "float32"}
    if args.rope_scaling:
        s = args.rope_scaling
        cfg["rope_scaling"] = {"rope_type": "llama3", "factor": s["factor"],
                               "low_freq_factor": s["low_freq_factor"],
                               "high_freq_factor": s["high_freq_factor"],
                               "original_max_position_embeddings": s["original_max_seq_len"]}
    if args.num_labels:
        cfg["id2label"] = {str(i): f"LABEL_{i}" for i in range(args.num_labels)}
    if args.n_experts:
        cfg.update(num_local_experts=args.n_experts, num_experts_per_tok=args.top_k, sliding_window=None)
    return cfg


def empty_model(args: ModelArgs, dtype=torch.float32, device="cpu") -> Transformer:
    """A model to load into, built on the meta device (no random init), cast, then given storage."""
    with torch.device("meta"):
        model = Transformer(args)
    return P.with_storage(model.to(dtype), device)


def _load_state(model: Transformer, state: dict[str, torch.Tensor], source: str) -> Transformer:
    expected = {k: v.shape for k, v in model.state_dict().items()}
    if model.args.tie_embeddings:
        expected.pop("output.weight")
        state.pop("output.weight", None)
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{source}: missing {missing[:4]} unexpected {unexpected[:4]}")
    for k, shape in expected.items():
        if tuple(state[k].shape) != tuple(shape):
            raise ValueError(f"{source}: {k} has shape {tuple(state[k].shape)}, the config says "
                             f"{tuple(shape)}")
    model.load_state_dict(state, strict=False)
    return model


class LazyState(Mapping):
    """A state dict whose tensors are read from disk when looked up, and not kept: a rank building
    only its own shards (parallel.materialize) reads just the weights it needs, one at a time."""

    def __init__(self, readers: dict):
        self._readers = readers  # name -> () -> tensor

    def __getitem__(self, name):
        return self._readers[name]()

    def __contains__(self, name):  # without reading (Mapping's default would look the tensor up)
        return name in self._readers

    def __iter__(self):
        return iter(self._readers)

    def __len__(self):
        return len(self._readers)


def hf_state(path) -> tuple[ModelArgs, LazyState]:
    """A Hugging Face Llama directory (config.json + *.safetensors) -> (model args, a LazyState
    under our names). Names and shapes are checked against the config from the headers alone."""
    path = Path(path)
    args = args_in(path / "config.json", args_from_hf_config)
    where = {}  # Hugging Face name -> (file, shape)
    for f in sorted(path.glob("*.safetensors")):
        where.update({name: (f, info["shape"]) for name, info in _safetensors_header(f)[1].items()})
    if not where:
        raise FileNotFoundError(f"no *.safetensors files holding a tensor in {path}")
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in Transformer(args).state_dict().items()}
    if args.tie_embeddings:
        expected.pop("output.weight")  # the head is the embedding
    theirs = lambda ours: hf_name(ours, classifier=args.num_labels is not None)
    missing = [theirs(k) for k in expected if theirs(k) not in where]
    if missing:
        raise ValueError(f"{path}: missing {missing[:4]}")
    for k, shape in expected.items():
        if tuple(where[theirs(k)][1]) != shape:
            raise ValueError(f"{path}: {k} has shape {tuple(where[theirs(k)][1])}, the config says {shape}")
    read = lambda hf: (lambda: read_safetensors(where[hf][0], [hf])[hf])
    readers = {k: read(theirs(k)) for k in expected}
    if args.tie_embeddings:
        readers["output.weight"] = readers["tok_embeddings.weight"]
    return args, LazyState(readers)


HF_EXPORT_FILES = ("model.safetensors", "config.json", "generation_config.json",  # all save_hf writes
                   "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def save_hf(model: Transformer, path, tokens: dict | None = None, files: dict | None = None):
    """Write a Hugging Face Llama directory: config.json, model.safetensors (in the model's dtype),
    `files` (hf_tokenizer_files). `tokens` (hf_tokens) go in config.json and generation_config.json,
    which tells generate() where to stop: transformers would assume bos 1 and eos 2, wrong here."""
    classifier = model.args.num_labels is not None  # (LlamaForSequenceClassification's head: "score")
    state = {hf_name(k, classifier): v for k, v in model.state_dict().items()
             if not (k == "output.weight" and model.args.tie_embeddings)}
    cfg = hf_config(model.args) | (tokens or {})
    cfg["torch_dtype"] = str(model.tok_embeddings.weight.dtype).removeprefix("torch.")
    jsons = {"config.json": cfg, **(files or {})}
    if tokens:
        ids = ("bos_token_id", "eos_token_id", "pad_token_id")
        jsons["generation_config.json"] = {k: tokens[k] for k in ids}
    write_export(path, {"model.safetensors": state}, jsons, HF_EXPORT_FILES)


def write_export(path, tensors: dict, jsons: dict, ours=HF_EXPORT_FILES):
    """A folder of safetensors files ({name: state dict}) and JSON files ({name: object}), all or
    nothing: written and fsynced in a temporary sibling folder, then renamed to `path`, so a full
    disk or a kill never leaves a truncated model in a folder that looks complete. An existing
    `path` is replaced only if it holds nothing but an earlier export's files (`ours`)."""
    path = Path(os.path.abspath(path))  # "." and "x/.." have no name to put a sibling next to
    _check_export_target(path, ours)
    replacing = path.exists()  # (an earlier export, replaced; else nothing may appear there meanwhile)
    tmp = path.parent / f".tmp-{path.name}-{os.getpid()}"
    try:
        shutil.rmtree(tmp, ignore_errors=True)  # left by an earlier, killed process with our pid
        tmp.mkdir(parents=True)
        for name, state in tensors.items():
            write_safetensors(state, tmp / name)
        for name, obj in jsons.items():
            (tmp / name).write_text(json.dumps(obj, indent=2, ensure_ascii=False), encoding="utf-8")
        for f in [*tmp.iterdir(), tmp]:  # on disk before the rename makes them the export
            data.fsync(f)
        data.swap_folder(tmp, path, replacing, "this export")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _check_export_target(path: Path, ours):
    """Refuse a file, a link, or a folder holding anything but `ours` (a checkpoint, notes)."""
    if path.is_symlink() or (path.exists() and not path.is_dir()):  # a link would be replaced, not followed
        raise FileExistsError(f"{path} exists and is a file or a link, not a folder; nothing was written: "
                              "remove it or export to another path")
    if path.is_dir():
        others = sorted(p.name for p in path.iterdir()
                        if p.name not in ours or p.is_symlink() or not p.is_file())
        if others:
            raise FileExistsError(f"{path} holds files an export does not write ({', '.join(others[:5])}"
                                  f"{', ...' if len(others) > 5 else ''}); nothing was written: export to a "
                                  "new or empty folder, or move them away")


def meta_to_hf_rope_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder wq/wk rows from Meta's RoPE pairs (0,1),(2,3).. to ours, (i, i+head_dim/2)."""
    out_dim, in_dim = w.shape
    return w.view(n_heads, out_dim // n_heads // 2, 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


# In Meta's model-parallel checkpoints each consolidated.NN.pth holds one slice: column-parallel
# weights and the vocab-parallel embedding split along dim 0, row-parallel ones (wo, w2) on dim 1.
_META_CAT_DIM = {"wq": 0, "wk": 0, "wv": 0, "w1": 0, "w3": 0, "output": 0, "tok_embeddings": 0, "wo": 1,
                 "w2": 1}


def args_from_meta_params(p: dict) -> ModelArgs:
    """A Meta params.json's contents -> ModelArgs; scaling is built first so ModelArgs checks it."""
    missing = [k for k in ("dim", "n_layers", "n_heads", "vocab_size", "multiple_of", "norm_eps")
               if k not in p]
    if missing:
        raise ValueError(f"misses {', '.join(missing)}: is it a Llama 3 params.json?")
    if not isinstance(p.get("use_scaled_rope", False), bool):
        raise ValueError(f"use_scaled_rope must be true or false, got {M.show(p['use_scaled_rope'])}")
    scaling = None
    if p.get("use_scaled_rope"):
        factor = p.get("rope_scaling_factor")
        scaling = dict(M.LLAMA31_ROPE) | ({"factor": factor} if factor is not None else {})
    return ModelArgs(dim=p["dim"], n_layers=p["n_layers"], n_heads=p["n_heads"],
                     n_kv_heads=p.get("n_kv_heads"), vocab_size=p["vocab_size"], multiple_of=p["multiple_of"],
                     ffn_dim_multiplier=p.get("ffn_dim_multiplier"), norm_eps=p["norm_eps"],
                     rope_theta=p.get("rope_theta", 500000.0), rope_scaling=scaling,
                     max_seq_len=p.get("max_seq_len", 8192))


def load_meta(path, dtype=torch.float32) -> Transformer:
    """A Meta Llama 3 checkpoint directory (params.json + consolidated.*.pth) -> Transformer."""
    path = Path(path)
    args = args_in(path / "params.json", args_from_meta_params)
    files = sorted(path.glob("consolidated.*.pth"))
    if not files:
        raise FileNotFoundError(f"no consolidated.*.pth files in {path}")
    shards = [torch.load(data.regular_file(f, "weight file"), map_location="cpu", weights_only=True, mmap=True)
              for f in files]
    state = {}
    for name in shards[0]:
        if name.endswith("rope.freqs"):
            continue  # some releases store RoPE frequencies; we recompute them
        parts = [s[name] for s in shards]
        kind = name.split(".")[-2]
        t = torch.cat(parts,
                      dim=_META_CAT_DIM[kind]) if len(parts) > 1 and kind in _META_CAT_DIM else parts[0]
        if kind == "wq":
            t = meta_to_hf_rope_permute(t, args.n_heads)
        elif kind == "wk":
            t = meta_to_hf_rope_permute(t, args.n_kv_heads)
        state[name] = t.to(dtype)
    if "output.weight" not in state:
        args = replace(args, tie_embeddings=True)
    return _load_state(empty_model(args, dtype), state, str(path))


# ----------------------------------------------------------------------------------------------------
# 4. The tokenizer, for a Hugging Face export


def hf_tokens(enc, chat: bool) -> dict:
    """What save_hf records of a tokenizer: the name that loads it here, its special ids. A chat
    reply ends with <|eot_id|>, so it stops generation first; <|end_of_text|> ends any document."""
    eos = [data.eot_id(enc), data.eos_id(enc)] if chat else data.eos_id(enc)
    return {"tokenizer": enc.name, "bos_token_id": data.bos_id(enc), "eos_token_id": eos,
            "pad_token_id": data.pad_id(enc)}


# tokenizer.json describes a tiktoken Encoding's byte-level BPE in Hugging Face's terms:
#  - tokens are spelled in "byte-level characters", one per byte (GPT-2's map): JSON holds text;
#  - tiktoken ranks pieces, Hugging Face lists merges: each split of the rank-r token into two
#    tokens is a merge, ordered by r; ignore_merges first looks a pre-token up whole, like tiktoken;
#  - the pre-tokenizer splits text with the Encoding's own pattern, then maps bytes to characters;
#  - the post-processor adds <|begin_of_text|> in front, as prepare() does to every document.

# chat.encode_chat's format in Jinja, for tokenizer_config.json (apply_chat_template). Rendered and
# encoded, it gives encode_chat's ids except for content starting with a newline (joining the
# header's "\n\n" in one piece) or holding a special token's text (which becomes that token, an
# injected turn, unless the caller passes sanitize_control_tokens=True: no template keeps it text).
LLAMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")


def hf_tokenizer_files(enc, chat: bool, max_len: int | None = None) -> dict:
    """{file name: JSON object} of a Hugging Face tokenizer for `enc`, for save_hf's `files`."""
    names = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>" if chat else "<|end_of_text|>",
             "pad_token": "<|finetune_right_pad_id|>"}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **names, "clean_up_tokenization_spaces": False,
              "model_input_names": ["input_ids", "attention_mask"], "model_max_length": max_len or 131_072}
    if chat:
        config["chat_template"] = LLAMA3_CHAT_TEMPLATE
    return {"tokenizer.json": _tokenizer_json(enc), "tokenizer_config.json": config,
            "special_tokens_map.json": names}


def _tokenizer_json(enc) -> dict:
    char = _byte_chars()
    spell = lambda token: "".join(char[b] for b in token)
    ranks, specials = enc._mergeable_ranks, sorted(enc._special_tokens.items(), key=lambda item: item[1])
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    split = {"type": "Split", "pattern": {"Regex": _onig(enc._pat_str)}, "behavior": "Isolated",
             "invert": False}
    bpe = {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
           "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": True,
           # special tokens too: where their ids leave gaps (cl100k_base, o200k_base), the
           # tokenizers library would number them after the vocabulary unless the model names them
           "vocab": {**{spell(token): rank for token, rank in ranks.items()}, **dict(specials)},
           "merges": [[spell(a), spell(b)] for a, b in _merges(ranks)]}
    return {"version": "1.0", "truncation": None, "padding": None, "normalizer": None,
            "added_tokens": [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                              "normalized": False, "special": True} for t, i in specials],
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": [split, byte_level]},
            "post_processor": _bos_first(data.bos_id(enc)), "decoder": byte_level, "model": bpe}


def _bos_first(bos: int) -> dict:
    token = lambda type_id: {"SpecialToken": {"id": "<|begin_of_text|>", "type_id": type_id}}
    text = lambda name, type_id: {"Sequence": {"id": name, "type_id": type_id}}
    return {"type": "TemplateProcessing", "single": [token(0), text("A", 0)],
            "pair": [token(0), text("A", 0), token(1), text("B", 1)],
            "special_tokens": {"<|begin_of_text|>": {"id": "<|begin_of_text|>", "ids": [bos],
                                                     "tokens": ["<|begin_of_text|>"]}}}


def _byte_chars() -> list[str]:
    """GPT-2's byte -> character map: printable Latin-1 bytes stand for themselves; the other 68
    (controls, space, soft hyphen) take U+0100 on, in byte order. So a space is "\u0120" (Ġ)."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    others = iter(range(0x100, 0x200))
    return [chr(b) if b in printable else chr(next(others)) for b in range(256)]


def _onig(pattern: str) -> str:
    """The pattern for Oniguruma (Hugging Face tokenizers' regex engine), where "{1,3}+" means
    "{1,3}, one or more times", not tiktoken's possessive {1,3}: cl100k_base's "7500" would be one
    piece, not "750" + "0". Ending its alternative, as there, a possessive interval matches what a
    greedy one does, since nothing after it can make it give digits back."""
    return re.sub(r"(\{\d+(?:,\d*)?\})\+", r"\1", pattern)


def _merges(ranks: dict) -> list[tuple[bytes, bytes]]:
    """Every (left, right) pair of tokens that spells another token, ordered by that token's rank
    (then by the two halves' ranks): tiktoken merges the adjacent pair whose union ranks lowest."""
    found = []
    for token, rank in ranks.items():
        for i in range(1, len(token)):
            left, right = ranks.get(token[:i]), ranks.get(token[i:])
            if left is not None and right is not None:
                found.append((rank, left, right, token[:i], token[i:]))
    return [(a, b) for *_, a, b in sorted(found)]
