"""A watched continuous-batching manager run the serving tests share: requests sent one after another, as a server
gets them, so a later request can find an earlier one's blocks held (a prefix hit at its first forward)."""

from __future__ import annotations

from collections.abc import Callable


def run_watched_manager(
    model,
    tokenizer,
    prompts: dict[str, list[int]],
    page_size: int,
    num_blocks: int,
    on_snapshot: Callable | None = None,
):
    """The prompts one after another (2 greedy tokens each) on a watched continuous-batching manager with prefix
    sharing on; the Watcher, detached, with what it saw (`on_snapshot`: given each step's snapshot as well)."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    from kvtui.engine.watch.probe import Watcher

    generation = GenerationConfig(max_new_tokens=2, do_sample=False, eos_token_id=-1)
    config = ContinuousBatchingConfig(
        page_size=page_size, max_batch_tokens=256, num_blocks=num_blocks, allow_block_sharing=True
    )
    watcher = Watcher(tokenizer=tokenizer, on_snapshot=on_snapshot)
    watcher.attach(model)
    manager = model.init_continuous_batching(generation_config=generation, continuous_batching_config=config)
    manager.start()
    try:
        for rid, prompt in prompts.items():
            manager.add_request(prompt, request_id=rid, max_new_tokens=2)
            manager.get_result(request_id=rid, timeout=120)
    finally:
        manager.stop(block=True, timeout=60)
        watcher.detach()
    return watcher
