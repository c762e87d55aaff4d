"""CUDA graphs for the vision tower: one per batch layout (the step's list of grids).

A ViT forward is hundreds of small kernels whose launches cost more host time than the
GPU spends on them. A graph replays the whole tower in one launch. Shapes follow the grids,
so a graph serves only the exact layout it was captured for; the graphs are kept in an LRU of
``max_graphs`` layouts sharing one memory pool (replays run one at a time, and each
replay's output is copied out before the next one).

The first time a layout is seen it runs eagerly (a one-off size costs no capture); the
second time it is captured, then replayed (an evicted layout is captured on its next call).
The graph runs the same kernels as the eager forward on the same inputs, so its rows equal
the eager rows exactly.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from services.engine.model.vision import GridList, VisionLayout, VisionTransformer

Layout = tuple[tuple[int, int, int], ...]


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    pixels: torch.Tensor  # [patches, C*T*P*P] in the tower's dtype: the graph's fixed input
    output: torch.Tensor  # [tokens, out_hidden]: the graph's fixed output
    layout: VisionLayout  # its index and rotary tensors, read by the graph


class VisionGraphs:
    """The vision tower's forward through cached CUDA graphs (see the module docstring)."""

    def __init__(self, visual: VisionTransformer, max_graphs: int) -> None:
        assert max_graphs > 0, max_graphs
        self.visual = visual
        self.max_graphs = max_graphs
        weight = visual.patch_embed.proj.weight
        self.device, self.dtype = weight.device, weight.dtype
        assert self.device.type == "cuda", "CUDA graphs need a CUDA device"
        self._graphs: OrderedDict[Layout, _Graph] = OrderedDict()
        self._seen: OrderedDict[Layout, None] = OrderedDict()  # run eagerly once, no graph yet
        self._pool = torch.cuda.graph_pool_handle()
        self.num_captures = 0
        self.num_replays = 0

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor, grids: GridList) -> torch.Tensor:
        """``visual(pixel_values, grids)``: a new tensor, [sum of image tokens, out_hidden]."""
        key: Layout = tuple(tuple(g) for g in grids)
        entry = self._graphs.get(key)
        if entry is None:
            if key not in self._seen:
                self._remember(key)
                return self.visual(pixel_values, grids)
            del self._seen[key]
            entry = self._capture(key, pixel_values)
        self._graphs.move_to_end(key)
        entry.pixels.copy_(pixel_values)
        entry.graph.replay()
        self.num_replays += 1
        return entry.output.clone()

    def _remember(self, key: Layout) -> None:
        self._seen[key] = None
        while len(self._seen) > 4 * self.max_graphs:
            self._seen.popitem(last=False)

    def _capture(self, key: Layout, pixel_values: torch.Tensor) -> _Graph:
        while len(self._graphs) >= self.max_graphs:
            evicted, _ = self._graphs.popitem(last=False)
            self._remember(evicted)  # seen before: its next call captures it again
        layout = self.visual.layout(list(key), self.device)
        pixels = torch.empty(pixel_values.shape, dtype=self.dtype, device=self.device)
        pixels.copy_(pixel_values)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            output = self.visual.forward_layout(pixels, layout)
        entry = _Graph(graph, pixels, output, layout)
        self._graphs[key] = entry
        self.num_captures += 1
        return entry
