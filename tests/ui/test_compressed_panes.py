"""A compressed cache on screen (issue 54): the layers pane says slots held of tokens fed and which positions each
layer holds, a strip gives the fraction each layer kept, the buffer's title names the selected layer's held runs,
and the buffer greys exactly the positions that layer no longer holds. The snapshot comes from a real watched
eviction on a tiny Llama (the program keeps the sinks 0-3 and the last 12 of 48 tokens of layer 0 only)."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from kvtui.engine.watch.probe import watch
from kvtui.widgets.step.layers_pane import kept_strip, layer_cells
from kvtui.widgets.step.token_grid import buffer_title


def _evicted_snapshot(tiny_model):
    model, _ = tiny_model("llama")
    ids = (torch.randperm(model.config.vocab_size - 8, generator=torch.Generator().manual_seed(3))[:48] + 4)[None]
    kept = torch.tensor(list(range(4)) + list(range(36, 48)))
    snapshots = []
    cache = DynamicCache()
    with watch(model, on_snapshot=snapshots.append), torch.no_grad():
        out = model(input_ids=ids, past_key_values=cache)
        layer = cache.layers[0]
        layer.keys, layer.values = layer.keys[:, :, kept], layer.values[:, :, kept]
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        model(input_ids=token, position_ids=torch.tensor([[48]]), past_key_values=cache)
    return snapshots[-1]


def test_the_panes_tell_what_each_layer_holds(tiny_model):
    snapshot = _evicted_snapshot(tiny_model)
    first, second = snapshot.layers[0], snapshot.layers[1]
    cells = [c.plain for c in layer_cells(first)]
    assert "17 of 49" in cells and "holds 0–3, 36–48" in cells
    assert [c.plain for c in layer_cells(second)][3] == "49 of 49"  # a layer that kept everything
    strip = kept_strip(snapshot.layers).plain
    assert strip.startswith("kept ") and "35%–100% of 49 fed" in strip
    assert buffer_title(snapshot, first).endswith("layer 0 full holds 17 of 49: 0–3, 36–48")
    greyed = [i for i in range(len(snapshot.buffer)) if not first.holds(i)]
    assert greyed == list(range(4, 36))  # exactly the evicted middle
    assert all(second.holds(i) for i in range(len(snapshot.buffer)))
