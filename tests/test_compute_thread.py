"""furlong.kit.compute_thread: one thread for a sync run's torch work (the engine's decode loop, the
train backend's passes, weight copies), the event loop's thread at one intra-op thread."""

from __future__ import annotations

import asyncio
import threading

import pytest

torch = pytest.importorskip("torch")

from furlong.core.config.launch_args import launch_args  # noqa: E402
from furlong.core.run.loop import shares_compute_thread  # noqa: E402
from furlong.kit.compute_thread import run_compute, shared_compute_thread  # noqa: E402


@pytest.fixture
def two_torch_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def where() -> tuple[int, str, int]:
    thread = threading.current_thread()
    return thread.ident, thread.name, torch.get_num_threads()


@pytest.mark.usefixtures("two_torch_threads")
def test_inside_the_block_every_call_runs_in_one_thread_with_the_entry_thread_count():
    async def main():
        with shared_compute_thread():
            inside = [await run_compute(where) for _ in range(4)]
            caller = torch.get_num_threads()
            concurrent = await asyncio.gather(*(run_compute(where) for _ in range(3)))
        after = await run_compute(where)
        return inside, caller, concurrent, after

    inside, caller, concurrent, after = asyncio.run(main())
    assert len({ident for ident, _, _ in inside + concurrent}) == 1
    assert all(name.startswith("furlong-compute") and threads == 2 for _, name, threads in inside + concurrent)
    assert caller == 1  # the event loop's thread computes with one thread inside the block
    assert torch.get_num_threads() == 2  # and gets its count back after it
    assert not after[1].startswith("furlong-compute")  # outside: asyncio.to_thread's workers


@pytest.mark.usefixtures("two_torch_threads")
def test_a_disabled_block_changes_nothing():
    async def main():
        with shared_compute_thread(enabled=False):
            return await run_compute(where), torch.get_num_threads()

    (_, name, _), caller = asyncio.run(main())
    assert not name.startswith("furlong-compute") and caller == 2


def test_one_torch_thread_changes_nothing():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        async def main():
            with shared_compute_thread():
                return await run_compute(where)

        assert not asyncio.run(main())[1].startswith("furlong-compute")
    finally:
        torch.set_num_threads(before)


@pytest.mark.usefixtures("two_torch_threads")
def test_errors_reach_the_caller_and_the_block_cannot_be_nested():
    def fails():
        raise ValueError("from the compute thread")

    async def main():
        with shared_compute_thread():
            with pytest.raises(ValueError, match="from the compute thread"):
                await run_compute(fails)
            with pytest.raises(RuntimeError, match="already open"):
                with shared_compute_thread():
                    pass
            return await run_compute(where)

    assert asyncio.run(main())[1].startswith("furlong-compute")  # still usable after both
    assert torch.get_num_threads() == 2


def test_only_sync_runs_share_the_compute_thread():
    assert shares_compute_thread(launch_args(train_mode="sync"))
    assert not shares_compute_thread(launch_args(train_mode="async"))


@pytest.mark.usefixtures("two_torch_threads")
def test_a_weight_update_mid_generation_does_not_wait_for_the_paused_decode_loop():
    """Paused mid-generation, the embedded engine's decode loop waits for the pause's lock inside the
    compute thread; the weight copy runs beside it, so the update completes and generation resumes."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from furlong.builtin_plugins.engines.embedded.engine import EmbeddedEngine

    demo = Path(__file__).resolve().parents[1] / "examples" / "demo" / "model"
    model, tokenizer = AutoModelForCausalLM.from_pretrained(demo), AutoTokenizer.from_pretrained(demo)
    engine = EmbeddedEngine(model, tokenizer, max_batch_size=2)
    weights = [(name, tensor.clone()) for name, tensor in model.state_dict().items()]

    async def main():
        with shared_compute_thread():
            prompt = tokenizer("1+2=")["input_ids"]
            params = {"max_new_tokens": 40, "temperature": 1.0, "ignore_eos": True}
            generating = asyncio.ensure_future(asyncio.gather(*(engine.generate(prompt, params) for _ in range(40))))
            while engine._running is None:
                await asyncio.sleep(0.01)
            decoding = not engine._running.done()
            await asyncio.wait_for(engine.update_weights(weights, 1), 30)
            outputs = await asyncio.wait_for(generating, 120)
        return decoding, outputs

    decoding, outputs = asyncio.run(main())
    assert decoding  # the update came while the decode loop ran in the compute thread
    assert len(outputs) == 40 and engine.weight_version == 1
