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


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "shared_cluster" in item.fixturenames:
            item.add_marker(pytest.mark.xdist_group(SHARED_SYSTEM_GROUP))
        elif not any(item.iter_markers("xdist_group")) and uses_a_module_fixture(item):
            item.add_marker(pytest.mark.xdist_group(f"module:{item.module.__name__}"))


def uses_a_module_fixture(item: pytest.Item) -> bool:
    """Whether the test uses a module-scoped fixture: such a module's tests then run on one xdist worker (as one
    group), so that the fixture, often a loaded model and its reference outputs, is made once instead of once per
    worker (SmolLM2's bf16 pair and its target-only answers took 19 s on each of the two)."""
    info = getattr(item, "_fixtureinfo", None)  # pytest's own record of the test's fixtures (no public accessor)
    if info is None:
        return False
    return any(defs and defs[-1].scope == "module" for defs in (info.name2fixturedefs.get(name)
                                                                 for name in item.fixturenames))


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
