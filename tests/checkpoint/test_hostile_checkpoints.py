"""Hostile Hugging Face checkpoints: file names that leave the checkpoint directory (`paths.resolve_inside`), bad
safetensors indexes and headers (`safetensors_io`), and config.json files that would size the model wrongly
(`spec.validate_config`, `quant_layout.check_checkpoint_header`).

Each is refused with a ValueError naming the file and the key / tensor / name, before anything large is
allocated (tracemalloc peaks) and without opening a file outside the checkpoint or reading tensor data (an
audit hook records every file opened). Checkpoints are built in tmp_path: tiny crafted safetensors files, or a
copy of the qwen3_moe test fixture with its config.json corrupted."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import struct
import sys
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tutel_jax.checkpoint._paths import hf_cache_repo, resolve_inside
from tutel_jax.checkpoint._safetensors_io import SafetensorsFile, open_checkpoint
from tutel_jax.models import from_pretrained, hf_tensor_shapes, spec_from_config
from tutel_jax.models._family import MAX_EXPERTS, MAX_LAYERS
from tutel_jax.models._hf_tables import implied_tensor_count
from support.paths import HF

MiB = 1 << 20

# ---------------------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------------------

_OPENED: list[str] | None = None


def _audit(event: str, args: tuple) -> None:
    """Records the path of every file opened while `_opens` is active (open(), io.open, os.open, Path.open)."""
    if _OPENED is not None and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        _OPENED.append(os.path.realpath(os.fsdecode(args[0])))


sys.addaudithook(_audit)  # inert unless a test is recording


@contextlib.contextmanager
def _opens() -> Iterator[list[str]]:
    """The resolved paths of the files opened inside the block."""
    global _OPENED
    _OPENED = opened = []
    try:
        yield opened
    finally:
        _OPENED = None


@contextlib.contextmanager
def _peak(limit: int) -> Iterator[None]:
    """Fails unless the traced memory peak inside the block stays below `limit` bytes."""
    tracemalloc.start()
    try:
        yield
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < limit, f"traced peak {peak} bytes"


def _safetensors(path: Path, header: dict | bytes, data: bytes = b"", header_len: int | None = None) -> Path:
    """A safetensors file with a raw header (dict: JSON-encoded) and data section, written byte by byte."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if header_len is None else header_len) + raw + data)
    return path


def _tiny(path: Path, *names: str) -> Path:
    """A valid safetensors file with one F32 [1] tensor per name."""
    header = {n: {"dtype": "F32", "shape": [1], "data_offsets": [4 * i, 4 * i + 4]} for i, n in enumerate(names)}
    return _safetensors(path, header, np.arange(len(names), dtype=np.float32).tobytes())


def _index(directory: Path, weight_map: Any, raw: bytes | None = None) -> Path:
    """model.safetensors.index.json in `directory` with this weight_map (or these raw bytes)."""
    directory.mkdir(parents=True, exist_ok=True)
    index = directory / "model.safetensors.index.json"
    index.write_bytes(raw if raw is not None else json.dumps({"metadata": {}, "weight_map": weight_map}).encode())
    return index


def _refuse(call, *needles: str, error: type = ValueError) -> str:
    """Runs `call`; it must raise exactly `error` with every needle in the message. Returns the message."""
    with pytest.raises(Exception) as info:
        call()
    assert type(info.value) is error, f"{type(info.value).__name__}: {info.value}"
    message = str(info.value)
    for needle in needles:
        assert needle in message, (needle, message)
    return message


# ---------------------------------------------------------------------------------------------------------------
# resolve_inside
# ---------------------------------------------------------------------------------------------------------------


def test_resolve_inside_accepts_names_inside(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "x.safetensors").write_bytes(b"")
    os.symlink("sub/x.safetensors", tmp_path / "inner_link")
    assert resolve_inside(tmp_path, "sub/x.safetensors", "w") == tmp_path / "sub" / "x.safetensors"
    assert resolve_inside(tmp_path, "inner_link", "w") == tmp_path / "inner_link"
    assert resolve_inside(tmp_path, "not_there_yet.json", "w") == tmp_path / "not_there_yet.json"


@pytest.mark.parametrize("name, why", [
    ("", "non-empty"), ("a\x00b", "NUL"), ("/etc/passwd", "absolute"), ("../x", "'..'"), ("a/../../x", "'..'"),
    ("..\\x", "'..'"), ("C:\\x", "absolute"), ("\\\\server\\share\\x", "absolute"), (5, "non-empty"),
    (None, "non-empty"),
], ids=["empty", "nul", "absolute", "dotdot", "inner-dotdot", "backslash-dotdot", "drive", "unc", "int", "none"])
def test_resolve_inside_refuses_names(tmp_path: Path, name: Any, why: str) -> None:
    _refuse(lambda: resolve_inside(tmp_path, name, "index.json: weight_map shard"),
            "index.json: weight_map shard", repr(name), why)


def test_resolve_inside_refuses_escaping_symlinks(tmp_path: Path) -> None:
    root, outside = tmp_path / "ckpt", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (outside / "secret").write_bytes(b"x")
    os.symlink(outside / "secret", root / "file_link")
    os.symlink(outside, root / "dir_link")
    for name in ("file_link", "dir_link/secret"):
        _refuse(lambda: resolve_inside(root, name, "what"), "what", repr(name), "outside the checkpoint directory")


def _hf_cache(tmp_path: Path, prefix: str = "models--org--name") -> tuple[Path, Path]:
    """(repo folder, snapshot folder) of a Hugging Face cache layout with one blob linked from the snapshot."""
    repo = tmp_path / "hub" / prefix
    snapshot = repo / "snapshots" / "0123abcd"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (repo / "blobs" / "deadbeef").write_bytes(b"x")
    os.symlink("../../blobs/deadbeef", snapshot / "model.safetensors")
    return repo, snapshot


def test_hf_cache_snapshot_links_into_blobs_are_accepted(tmp_path: Path) -> None:
    repo, snapshot = _hf_cache(tmp_path)
    assert hf_cache_repo(snapshot) == Path(os.path.realpath(repo))
    assert resolve_inside(snapshot, "model.safetensors", "w") == snapshot / "model.safetensors"
    (snapshot / "sub").mkdir()  # a checkpoint in a subfolder of the snapshot
    os.symlink("../../../blobs/deadbeef", snapshot / "sub" / "shard.safetensors")
    assert resolve_inside(snapshot / "sub", "shard.safetensors", "w") == snapshot / "sub" / "shard.safetensors"


def test_hf_cache_links_leaving_the_repo_are_refused(tmp_path: Path) -> None:
    _, snapshot = _hf_cache(tmp_path)
    (tmp_path / "elsewhere").write_bytes(b"x")
    os.symlink(tmp_path / "elsewhere", snapshot / "evil.safetensors")
    _refuse(lambda: resolve_inside(snapshot, "evil.safetensors", "w"), "'evil.safetensors'", "outside")


def test_cache_like_folder_without_the_repo_prefix_is_not_a_cache(tmp_path: Path) -> None:
    _, snapshot = _hf_cache(tmp_path, prefix="org--name")
    assert hf_cache_repo(snapshot) is None
    _refuse(lambda: resolve_inside(snapshot, "model.safetensors", "w"), "'model.safetensors'", "outside")


# ---------------------------------------------------------------------------------------------------------------
# safetensors index
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["dotdot", "absolute", "symlink"])
def test_index_naming_a_file_outside_is_refused_unopened(tmp_path: Path, kind: str) -> None:
    outside = _tiny(tmp_path / "outside.safetensors", "w")  # a valid file: only the name is wrong
    root = tmp_path / "ckpt"
    root.mkdir()
    shard = {"dotdot": "../outside.safetensors", "absolute": str(outside), "symlink": "link.safetensors"}[kind]
    if kind == "symlink":
        os.symlink(outside, root / "link.safetensors")
    index = _index(root, {"w": shard})
    with _opens() as opened:
        _refuse(lambda: open_checkpoint(root), str(index), "weight_map shard", repr(shard))
    assert os.path.realpath(outside) not in opened
    assert opened == [os.path.realpath(index)]


@pytest.mark.parametrize("weight_map, needle", [
    (["model.safetensors"], "weight_map must be an object"),
    ("model.safetensors", "weight_map must be an object"),
    (None, "weight_map must be an object"),
    ({"w": 3}, "weight_map['w'] must be a shard file name"),
    ({"w": ""}, "weight_map['w'] must be a shard file name"),
    ({"w": ["a.safetensors"]}, "weight_map['w'] must be a shard file name"),
], ids=["list", "string", "null", "int-shard", "empty-shard", "list-shard"])
def test_index_weight_map_of_the_wrong_type(tmp_path: Path, weight_map: Any, needle: str) -> None:
    _tiny(tmp_path / "model.safetensors", "w")
    index = _index(tmp_path, weight_map)
    _refuse(lambda: open_checkpoint(tmp_path), str(index), needle)


@pytest.mark.parametrize("raw, needle", [
    (b'{"metadata": {}}', "needs a 'weight_map' object"),
    (b'[1, 2]', "needs a 'weight_map' object"),
    (b'{"weight_map": {"w": "a.safetensors", "w": "b.safetensors"}}', "key 'w' occurs twice"),
    (b'{"weight_map": ' + b"[" * 200_000 + b"]" * 200_000 + b"}", "nested deeper than"),
    (b'{"weight_map": {', "not valid JSON"),
    (b'\xff\xfe{}', "not valid UTF-8"),
], ids=["no-weight-map", "not-an-object", "tensor-twice", "deeply-nested", "truncated", "not-utf8"])
def test_malformed_index_files(tmp_path: Path, raw: bytes, needle: str) -> None:
    _tiny(tmp_path / "a.safetensors", "w")
    index = _index(tmp_path, None, raw=raw)
    with _peak(8 * MiB):
        _refuse(lambda: open_checkpoint(tmp_path), str(index), needle)


def test_tensor_in_two_shards_is_refused(tmp_path: Path) -> None:
    _tiny(tmp_path / "a.safetensors", "x", "w")
    _tiny(tmp_path / "b.safetensors", "w", "y")
    index = _index(tmp_path, {"x": "a.safetensors", "w": "a.safetensors", "y": "b.safetensors"})
    _refuse(lambda: open_checkpoint(tmp_path), str(index), "tensor 'w' is in two shards",
            "'a.safetensors'", "'b.safetensors'")


def test_weight_map_name_missing_from_its_shard(tmp_path: Path) -> None:
    _tiny(tmp_path / "a.safetensors", "x")
    index = _index(tmp_path, {"x": "a.safetensors", "w": "a.safetensors"})
    _refuse(lambda: open_checkpoint(tmp_path), str(index), "tensor 'w' is mapped to 'a.safetensors'")


def test_valid_sharded_checkpoint_opens(tmp_path: Path) -> None:
    (tmp_path / "shards").mkdir()
    _tiny(tmp_path / "shards" / "a.safetensors", "x")
    _tiny(tmp_path / "b.safetensors", "w")
    _index(tmp_path, {"x": "shards/a.safetensors", "w": "b.safetensors"})
    with open_checkpoint(tmp_path) as ckpt:
        assert sorted(ckpt) == ["w", "x"] and ckpt.nbytes() == 8
        np.testing.assert_array_equal(ckpt["w"], np.zeros(1, np.float32))


# ---------------------------------------------------------------------------------------------------------------
# safetensors headers
# ---------------------------------------------------------------------------------------------------------------


def _entry(dtype: Any = "F32", shape: Any = (2,), offsets: Any = (0, 8), **extra: Any) -> dict:
    return {"dtype": dtype, "shape": list(shape) if isinstance(shape, tuple) else shape,
            "data_offsets": list(offsets) if isinstance(offsets, tuple) else offsets, **extra}


@pytest.mark.parametrize("header, needle", [
    ({"t": _entry(extra=1)}, "exactly the fields"),
    ({"t": {"dtype": "F32", "shape": [2]}}, "exactly the fields"),
    ({"t": [1, 2]}, "header entry must be an object"),
    ({"t": _entry(dtype="F128")}, "unsupported dtype 'F128'"),
    ({"t": _entry(dtype=7)}, "unsupported dtype 7"),
    ({"t": _entry(shape=(-2,))}, "non-negative integers"),
    ({"t": _entry(shape=[True, 2])}, "non-negative integers"),
    ({"t": _entry(shape=[2.0])}, "non-negative integers"),
    ({"t": _entry(shape="2")}, "non-negative integers"),
    ({"t": _entry(shape=[1] * 65, offsets=(0, 4))}, "at most 64"),
    ({"t": _entry(shape=(3,))}, "8 data bytes but shape [3] x F32 needs 12"),
    ({"t": _entry(shape=[1 << 40, 1 << 40], offsets=(0, 8))}, "needs 4835703278458516698824704"),
    ({"t": _entry(dtype="F4", shape=(3,), offsets=(0, 2))}, "not a whole number of bytes"),
    ({"t": _entry(offsets=(0, 16))}, "beyond the 8-byte data section"),
    ({"t": _entry(offsets=(8, 0))}, "bad data_offsets"),
    ({"t": _entry(offsets=(0, 8, 8))}, "data_offsets must be [begin, end]"),
    ({"t": _entry(), "u": _entry(shape=(1,), offsets=(4, 8))}, "overlap"),
    ({"t": _entry(), "__metadata__": ["x"]}, "__metadata__ must be an object of strings"),
    ({"t": _entry(), "__metadata__": {"format": 1}}, "__metadata__ must be an object of strings"),
    (b'{"t": ' + json.dumps(_entry()).encode() + b', "t": ' + json.dumps(_entry()).encode() + b"}",
     "key 't' occurs twice"),
    ([1, 2], "header must be a JSON object"),
], ids=["extra-field", "missing-field", "entry-not-object", "unknown-dtype", "dtype-not-str", "negative-dim",
        "bool-dim", "float-dim", "shape-not-list", "rank-65", "size-mismatch", "huge-shape", "f4-half-byte",
        "past-the-end", "reversed-offsets", "three-offsets", "overlap", "metadata-list", "metadata-int",
        "tensor-twice", "not-an-object"])
def test_header_schema_violations(tmp_path: Path, header: Any, needle: str) -> None:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path = _safetensors(tmp_path / "bad.safetensors", raw, bytes(8))
    message = _refuse(lambda: SafetensorsFile(path), str(path), needle)
    if isinstance(header, dict) and "t" in header and needle not in ("overlap",) and "__metadata__" not in header:
        assert "tensor 't'" in message


def test_deeply_nested_header_is_a_value_error(tmp_path: Path) -> None:
    path = _safetensors(tmp_path / "deep.safetensors", b"[" * 1_000_000 + b"]" * 1_000_000)
    with _peak(16 * MiB):
        _refuse(lambda: SafetensorsFile(path), str(path), "nested deeper than")
    nested_in_entry = b'{"t": {"dtype": "F32", "shape": ' + b"[" * 5000 + b"]" * 5000 + b', "data_offsets": [0, 0]}}'
    path = _safetensors(tmp_path / "deep2.safetensors", nested_in_entry)
    _refuse(lambda: SafetensorsFile(path), str(path), "nested deeper than")


def test_header_length_over_the_limit_is_refused_before_reading(tmp_path: Path) -> None:
    path = _safetensors(tmp_path / "huge.safetensors", b"{}", header_len=(100 << 20) + 1)
    with _peak(1 * MiB):
        _refuse(lambda: SafetensorsFile(path), str(path), "exceeds the 104857600-byte limit")


def test_sub_byte_dtypes_are_validated_but_not_readable(tmp_path: Path) -> None:
    header = {"p": _entry(dtype="F4", shape=(4, 4), offsets=(0, 8)), "e": _entry(dtype="F8_E8M0", shape=(2,),
                                                                                offsets=(8, 10))}
    path = _safetensors(tmp_path / "packed.safetensors", header, bytes(8) + bytes([127, 128]))
    with SafetensorsFile(path) as f:
        assert f.info("p") == ("F4", (4, 4)) and f.nbytes("p") == 8
        assert f.get("e").astype(np.float32).tolist() == [1.0, 2.0]
        _refuse(lambda: f.get("p"), str(path), "tensor 'p'", "dtype F4 packs several values per byte")


# ---------------------------------------------------------------------------------------------------------------
# config.json
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture
def qwen3(tmp_path: Path) -> Path:
    """A copy of the qwen3_moe fixture checkpoint (config.json + model.safetensors) to corrupt."""
    root = tmp_path / "qwen3_moe"
    root.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(HF / "qwen3_moe" / name, root / name)
    return root


def _config(root: Path, **changes: Any) -> Path:
    """Rewrites root/config.json with `changes` (a value of `...` deletes the key); returns its path."""
    path = root / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is ...:
            del config[key]
        else:
            config[key] = value
    path.write_text(json.dumps(config))
    return path


def _refuse_load(root: Path, *needles: str, peak: int = 4 * MiB, opens_weights: bool = False) -> str:
    """from_pretrained(root) must raise a ValueError naming config.json and the needles, with the traced peak
    below `peak` bytes, opening nothing outside `root` and (unless opens_weights) not even model.safetensors."""
    with _opens() as opened, _peak(peak):
        message = _refuse(lambda: from_pretrained(root, progress=False), str(root / "config.json"), *needles)
    real_root = os.path.realpath(root)
    assert all(p.startswith(real_root + os.sep) for p in opened), opened
    assert (os.path.realpath(root / "model.safetensors") in opened) == opens_weights, opened
    return message


@pytest.mark.parametrize("changes, needles", [
    ({"num_local_experts": 10_000_000}, ["num_local_experts: must be an integer in [1, 16384]"]),
    ({"num_hidden_layers": 10_000_000}, ["num_hidden_layers: must be an integer in [1, 16384]"]),
    ({"head_dim": 1_000_000_000}, ["head_dim: must be an integer in [1, 4096]"]),
    ({"num_hidden_layers": -1}, ["num_hidden_layers: must be an integer"]),
    ({"num_hidden_layers": 0}, ["num_hidden_layers: must be an integer"]),
    ({"num_hidden_layers": "2"}, ["num_hidden_layers: must be an integer", "'2'"]),
    ({"num_hidden_layers": 2.0}, ["num_hidden_layers: must be an integer"]),
    ({"hidden_size": True}, ["hidden_size: must be an integer", "True"]),
    ({"num_attention_heads": None}, ["num_attention_heads: must not be null"]),
    ({"num_experts_per_tok": ...}, ["num_experts_per_tok: missing (required)"]),
    ({"vocab_size": ...}, ["vocab_size: missing (required)"]),
    ({"decoder_sparse_step": 0}, ["decoder_sparse_step: must be an integer in [1, 16384]"]),
    ({"decoder_sparse_step": None}, ["decoder_sparse_step: must not be null"]),
    ({"num_experts_per_tok": 9}, ["num_experts_per_tok: 9 is more than the 8 experts"]),
    ({"num_key_value_heads": 3}, ["num_key_value_heads: 3 must divide num_attention_heads 4"]),
    ({"rms_norm_eps": "1e-6"}, ["rms_norm_eps: must be a finite number"]),
    ({"rms_norm_eps": 0}, ["rms_norm_eps: must be a finite number in (0, 1]"]),
    ({"mlp_only_layers": ["0"]}, ["mlp_only_layers: item 0 must be an integer"]),
    ({"mlp_only_layers": 1}, ["mlp_only_layers: must be a list"]),
    ({"norm_topk_prob": "yes"}, ["norm_topk_prob: must be true or false"]),
    ({"layer_types": ["full_attention"]}, ["layer_types: 1 entries for num_hidden_layers 2"]),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4}}, ["rope_parameters.rope_type: must be one of"]),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, ["rope_parameters.factor: missing"]),
    ({"rope_parameters": "default"}, ["rope_parameters: must be an object"]),
    ({"head_dim": 15}, ["rotary width 15 must be a positive even number"]),
    ({"num_local_experts": ..., "num_experts": 0}, ["num_experts: must be an integer in [1, 16384]"]),
    ({"num_local_experts": ...}, ["num_local_experts / num_experts / n_routed_experts: missing"]),
    ({"model_type": "llama"}, ["unsupported model_type 'llama'"]),
    ({"quantization_config": "fp8"}, ["quantization_config: must be an object"]),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128]}},
     ["weight_block_size: must be [rows, columns]"]),
], ids=lambda v: "-".join(f"{k}={v[k]!r}"[:40] for k in v) if isinstance(v, dict) else None)
def test_bad_config_is_refused_before_anything_is_sized(qwen3: Path, changes: dict, needles: list[str]) -> None:
    _config(qwen3, **changes)
    _refuse_load(qwen3, *needles)


def test_every_bad_key_is_named_in_one_error(qwen3: Path) -> None:
    _config(qwen3, num_hidden_layers=-3, head_dim="16", num_experts_per_tok=..., rms_norm_eps=None)
    message = _refuse_load(qwen3, "num_hidden_layers:", "head_dim:", "num_experts_per_tok: missing",
                           "rms_norm_eps: must not be null")
    assert message.count(";") == 3


@pytest.mark.parametrize("raw, needle", [
    (b"[" * 100_000 + b"]" * 100_000, "nested deeper than"),
    (b'{"model_type": "qwen3_moe", "model_type": "mixtral"}', "key 'model_type' occurs twice"),
    (b"[1]", "expected a JSON object"),
    (b"{", "not valid JSON"),
], ids=["deeply-nested", "key-twice", "not-an-object", "truncated"])
def test_malformed_config_files(qwen3: Path, raw: bytes, needle: str) -> None:
    (qwen3 / "config.json").write_bytes(raw)
    _refuse_load(qwen3, needle, peak=8 * MiB)


def test_implied_tensor_count_matches_the_tensor_table() -> None:
    """The closed-form count the size check uses is the table's length, for every fixture family."""
    for config_file in sorted(HF.glob("*/config.json")):
        config = json.loads(config_file.read_text())
        spec = spec_from_config(config)
        assert implied_tensor_count(spec, config, optional=True) == len(hf_tensor_shapes(config)), config_file
        assert implied_tensor_count(spec, config) <= len(hf_tensor_shapes(config))


@pytest.mark.parametrize("changes, needles", [
    ({"num_hidden_layers": 3}, ["implies at least 102 tensors (3 layers, 8 experts per MoE layer)", "holds only 69"]),
    ({"num_local_experts": 16}, ["16 experts per MoE layer", "holds only 69"]),
    ({"num_hidden_layers": MAX_LAYERS, "num_local_experts": MAX_EXPERTS}, ["holds only 69"]),
    ({"hidden_size": 8192}, ["tensors take at least", "hold only 759296 bytes"]),
    ({"vocab_size": 1 << 24}, ["tensors take at least", "hold only 759296 bytes"]),
], ids=["layers", "experts", "max-layers-and-experts", "width", "vocab"])
def test_config_needing_more_than_the_checkpoint_holds(qwen3: Path, changes: dict, needles: list[str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Counts and bytes from the headers only: no tensor is read (SafetensorsFile.get fails the test)."""
    monkeypatch.setattr(SafetensorsFile, "get", lambda *a, **k: pytest.fail("tensor data read"))
    _config(qwen3, **changes)
    _refuse_load(qwen3, *needles, opens_weights=True)


@pytest.mark.parametrize("changes, needles", [
    ({"moe_intermediate_size": 40}, ["model.safetensors", "tensor 'model.layers.0.mlp.experts.0.gate_proj.weight' "
                                     "has shape [48, 64]; the config implies [40, 64]"]),
    ({"mlp_only_layers": [1]}, ["config.json", "tensor 'model.layers.1.mlp.gate_proj.weight' [128, 64]",
                                "does not hold"]),
], ids=["expert-width", "dense-layer-without-tensors"])
def test_config_whose_tensors_do_not_match_the_headers(qwen3: Path, changes: dict, needles: list[str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(SafetensorsFile, "get", lambda *a, **k: pytest.fail("tensor data read"))
    _config(qwen3, **changes)
    with _opens() as opened:
        with pytest.raises(ValueError) as info:
            from_pretrained(qwen3, progress=False)
    assert type(info.value) is ValueError
    for needle in needles:
        assert needle in str(info.value), (needle, str(info.value))
    assert all(p.startswith(os.path.realpath(qwen3) + os.sep) for p in opened), opened
