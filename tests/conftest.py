from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.tiny_models import save_tiny_model, save_tiny_served_model

# `make test` runs two pytest workers (pytest-xdist) on the two cores: one thread each, so that they do not contend
# for each other's core; alone, a run takes both.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else max(1, min(2, os.cpu_count() or 1)))

# The tests on the shared SmolLM2 system (tests/integration/conftest.py) run on one xdist worker under
# `--dist loadgroup` (tests/xdist_groups.py says why and how): one system started, never two tests on it at once.
SHARED_SYSTEM_GROUP = "shared-system"


def pytest_configure(config: pytest.Config) -> None:
    if config.pluginmanager.hasplugin("xdist"):
        from tests.xdist_groups import register

        register(config)


# Where tests marked `alone` live: `make test` collects only this directory for its `alone` part (4 s; the whole suite
# took 14-18 s to collect), so a test marked `alone` elsewhere would never run, and is refused.
ALONE_TESTS_DIR = "tests/tensor_parallel/"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("alone") is not None and not item.nodeid.startswith(ALONE_TESTS_DIR):
            raise pytest.UsageError(f"{item.nodeid} is marked alone outside {ALONE_TESTS_DIR}, the only directory "
                                    "`make test` runs alone tests from (Makefile, ALONE_TESTS)")
        if "shared_cluster" in item.fixturenames:
            item.add_marker(pytest.mark.xdist_group(SHARED_SYSTEM_GROUP))


@pytest.fixture(scope="module")
def every_linear_packed():
    """Engines loaded in this module pack a tiny model's layers too (tandem/models/packed.py leaves test-sized
    layers dense), so that their rows are fixed by position as a real model's are: a token's KV is then the same
    decoded or in a prompt, and a target caches generated tokens' blocks (``ModelEngine.rows_fixed_by_position``)."""
    from tandem.models import packed

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(packed, "MIN_PACKED_ELEMENTS", 0)
        yield


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2", seed=1)


@pytest.fixture(scope="session")
def tiny_qwen2_other_dir(tmp_path_factory) -> Path:
    """Same shapes and vocabulary as tiny_qwen2, unrelated weights: a draft that rarely agrees."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny-qwen2-other"), "qwen2", seed=7)


@pytest.fixture(scope="session")
def tiny_served_dir(tmp_path_factory) -> Path:
    """A tiny Llama with a tokenizer and chat template, for tests about the system rather than the text."""
    return save_tiny_served_model(tmp_path_factory.mktemp("tiny-served"))


def prepared_model_dir(name: str) -> Path | None:
    """The prepared directory of a catalog model in the default cache, or None."""
    from tandem.model_store import default_cache_root

    path = default_cache_root(os.environ) / "models" / name
    return path if (path / "config.json").is_file() else None


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    path = prepared_model_dir("smollm2")
    if path is None:
        pytest.skip("SmolLM2 not prepared: run `tandem models prepare smollm2` (make test does)")
    return path
