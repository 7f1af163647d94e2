"""Who writes and who reads each tensor of an ONNX graph: the index every graph rewrite starts from."""

from __future__ import annotations

from typing import Any


class GraphIndex:
    """Producer, consumers and initializers of one graph's tensors (top level; Loop/If bodies not indexed)."""

    def __init__(self, model: Any) -> None:
        self.graph = model.graph
        self.producer: dict[str, Any] = {out: node for node in self.graph.node for out in node.output}
        self.consumers: dict[str, list[Any]] = {}
        for node in self.graph.node:
            for name in node.input:  # once per read: a node reading a tensor twice is listed twice
                self.consumers.setdefault(name, []).append(node)
        self.initializers: dict[str, Any] = {init.name: init for init in self.graph.initializer}

    def uses(self, name: str) -> list[tuple[Any, int]]:
        """(node, input position) for every place `name` is read."""
        nodes = {id(node): node for node in self.consumers.get(name, [])}.values()
        return [(node, i) for node in nodes for i, x in enumerate(node.input) if x == name]


def drop_unused_initializers(model: Any) -> None:
    """Remove initializers no top-level node reads any more (left behind by a rewrite)."""
    used = {name for node in model.graph.node for name in node.input}
    kept = [init for init in model.graph.initializer if init.name in used]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
