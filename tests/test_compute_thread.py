"""One thread computes: an engine warns when a second live thread runs it, and the in-process generator
runs its engines on the calling thread (tandem.compute_thread explains the OpenMP cost)."""

from __future__ import annotations

import threading
import warnings
from concurrent.futures import ThreadPoolExecutor

import pytest

from tandem.compute_thread import CallingThreadExecutor, ComputeThreadWarning
from tandem.config import EngineConfig
from tandem.engine import ForwardItem, ModelEngine
from tandem.inprocess import GenerationRequest, SpeculativeGenerator
from tandem.spec.options import SpecOptions


def load(model_dir) -> ModelEngine:
    return ModelEngine.load(EngineConfig(model_dir, dtype="float32", kv_cache_tokens=512, block_size=4))


def forward(engine: ModelEngine, seq_id: str) -> None:
    engine.forward([ForwardItem(seq_id, [3, 4, 5])])
    engine.release(seq_id)


def test_an_engine_warns_once_when_a_second_live_thread_computes(tiny_qwen2_dir):
    engine = load(tiny_qwen2_dir)
    forward(engine, "home")
    with ThreadPoolExecutor(max_workers=1) as other, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        other.submit(forward, engine, "a").result()
        other.submit(forward, engine, "b").result()
        forward(engine, "home again")
    thread_warnings = [w for w in caught if issubclass(w.category, ComputeThreadWarning)]
    assert len(thread_warnings) == 1
    assert "still alive" in str(thread_warnings[0].message)
    assert thread_warnings[0].filename == __file__  # it names the code that computed, not an engine or torch frame


def test_an_engine_built_on_a_thread_that_exited_belongs_to_the_next(tiny_qwen2_dir):
    built: list[ModelEngine] = []
    loader = threading.Thread(target=lambda: built.append(load(tiny_qwen2_dir)))
    loader.start()
    loader.join()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ComputeThreadWarning)
        forward(built[0], "s")
    assert built[0].home_thread.thread is threading.current_thread()


def test_the_in_process_generator_computes_on_the_calling_thread(tiny_qwen2_dir):
    target, draft = load(tiny_qwen2_dir), load(tiny_qwen2_dir)
    forward(target, "loaded here")
    requests = [GenerationRequest([5, 17, 33], max_new_tokens=12), GenerationRequest([9, 9, 9], max_new_tokens=12)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", ComputeThreadWarning)  # a batch on another thread would raise here
        results = SpeculativeGenerator(target, draft, SpecOptions("draft", 3, False)).generate(requests)
    assert [len(r.token_ids) for r in results] == [12, 12]
    assert all(r.stats.drafted > 0 for r in results)


def test_the_calling_thread_executor_runs_at_once_and_hands_errors_to_the_future():
    ran_on: list[threading.Thread] = []
    executor = CallingThreadExecutor()
    future = executor.submit(lambda x: ran_on.append(threading.current_thread()) or x * 2, 21)
    assert future.done() and future.result() == 42 and ran_on == [threading.current_thread()]
    failing = executor.submit(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        failing.result()
