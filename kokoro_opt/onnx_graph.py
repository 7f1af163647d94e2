"""Who writes and who reads each tensor of an ONNX graph: the index every graph rewrite starts from."""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator
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


class PatternIndex(GraphIndex):
    """The index plus initializer values and the lookups a pattern matcher needs."""

    def __init__(self, model: Any) -> None:
        from onnx import numpy_helper

        super().__init__(model)
        self.const = {name: numpy_helper.to_array(init) for name, init in self.initializers.items()}

    def sole(self, name: str, op_type: str) -> Any | None:
        """The only reader of `name` if it is an `op_type` node, else None."""
        users = self.consumers.get(name, [])
        return users[0] if len(users) == 1 and users[0].op_type == op_type else None

    def read_only_by(self, name: str, *nodes: Any) -> bool:
        """Whether `nodes`, and nothing else, read `name` (node names may be empty: compared by identity)."""
        return {id(n) for n in self.consumers.get(name, [])} == {id(n) for n in nodes}

    def made_by(self, names: Any, op_type: str) -> Any | None:
        return next((self.producer[i] for i in names if i in self.producer and self.producer[i].op_type == op_type), None)

    def const_operand(self, node: Any) -> tuple[str, str] | None:
        """(initializer input, other input) of a binary node with exactly one initializer input."""
        a, b = node.input
        if (a in self.const) == (b in self.const):
            return None
        return (a, b) if a in self.const else (b, a)


def node_reads(node: Any) -> set[str]:
    """What a top-level node reads: its inputs and what its Loop/If bodies read from around them."""
    return {name for name in node.input if name} | {t for sub in subgraphs(node) for t in outer_names(sub)}


def dependent_tensors(model: Any, inputs: list[str]) -> set[str]:
    """Every tensor computed from `inputs` (top level; a node reading one makes all its outputs depend on it)."""
    found = set(inputs)
    for node in model.graph.node:  # graph order is topological
        if node_reads(node) & found:
            found.update(name for name in node.output if name)
    return found


def sort_topologically(graph: Any) -> None:
    """Order the top-level nodes so that each comes after what it reads (subgraph reads count as its node's),
    keeping the present order wherever it already allows."""
    nodes = list(graph.node)
    produced_by = {out: i for i, node in enumerate(nodes) for out in node.output if out}
    users: dict[int, list[int]] = {i: [] for i in range(len(nodes))}
    remaining = []
    for i, node in enumerate(nodes):
        needs = {produced_by[r] for r in node_reads(node) if r in produced_by}
        remaining.append(len(needs))
        for d in needs:
            users[d].append(i)
    ready = [i for i, count in enumerate(remaining) if count == 0]
    order: list[int] = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for u in users[i]:
            remaining[u] -= 1
            if remaining[u] == 0:
                heapq.heappush(ready, u)
    if len(order) != len(nodes):
        raise ValueError("the graph has a cycle: a rewrite made a node read its own result")
    del graph.node[:]
    graph.node.extend(nodes[i] for i in order)


def drop_unused_initializers(model: Any) -> None:
    """Remove initializers no top-level node reads any more (left behind by a rewrite)."""
    used = {name for node in model.graph.node for name in node.input}
    kept = [init for init in model.graph.initializer if init.name in used]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)


def replace_nodes(model: Any, replaced: dict[str, list[Any]], drop_unused: bool = True) -> None:
    """Each node whose first output is a key of `replaced` gives way to its list, in place (keyed by
    output: node names may be empty); then, with `drop_unused`, initializers nothing reads any more
    are dropped (which copies every kept one: pass False when the rewrite frees none). A pattern's
    replacement goes where its last node was, so everything the pattern read is computed by then."""
    ordered = [new for node in model.graph.node for new in replaced.get(node.output[0], [node])]
    del model.graph.node[:]
    model.graph.node.extend(ordered)
    if drop_unused:
        drop_unused_initializers(model)


def subgraphs(node: Any) -> Iterator[Any]:
    import onnx

    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.GRAPH:
            yield attr.g
        elif attr.type == onnx.AttributeProto.GRAPHS:
            yield from attr.graphs


def outer_names(graph: Any) -> set[str]:
    """Names a subgraph reads from the scopes around it (not its inputs, initializers or node outputs)."""
    defined = {i.name for i in graph.input} | {i.name for i in graph.initializer}
    used = {o.name for o in graph.output}
    for node in graph.node:
        used.update(name for name in node.input if name)
        for sub in subgraphs(node):
            used |= outer_names(sub)
        defined.update(node.output)
    return used - defined


def read_names(nodes: Iterable[Any], graph_outputs: Iterable[Any]) -> set[str]:
    """Every tensor name something reads: the nodes, the subgraphs inside them (outer names), the graph's outputs."""
    nodes = list(nodes)
    read = {o.name for o in graph_outputs}
    for node in nodes:
        read.update(node.input)
        read.update(t for sub in subgraphs(node) for t in outer_names(sub))
    return read


def cut(
    model: Any,
    inputs: list[str],
    outputs: list[str],
    output_names: list[str] | tuple[str, ...],
    input_names: list[str] | tuple[str, ...] | None = None,
) -> Any:
    """The part of `model` computing `outputs` from `inputs`, renamed; unlike onnx.utils.Extractor it follows
    what Loop/If bodies read from the graph around them (Kokoro's alignment is a Loop)."""
    from onnx import helper

    graph = model.graph
    producer = {out: i for i, node in enumerate(graph.node) for out in node.output if out}
    wanted, keep, stack = set(inputs), set(), list(outputs)
    seen: set[str] = set()
    while stack:
        tensor = stack.pop()
        if tensor in seen or tensor in wanted or tensor not in producer:
            continue
        seen.add(tensor)
        index = producer[tensor]
        if index in keep:
            continue
        keep.add(index)
        node = graph.node[index]
        stack += [t for t in node.input if t] + [t for sub in subgraphs(node) for t in outer_names(sub)]
    reads = seen | {t for i in keep for t in graph.node[i].input}
    sub_reads = {t for i in keep for sub in subgraphs(graph.node[i]) for t in outer_names(sub)}
    initializers = [
        init for init in graph.initializer if (init.name in reads or init.name in sub_reads) and init.name not in inputs
    ]
    # The shapes known of what the part computes go with it: ONNX Runtime fuses by them (ALBERT's Add and
    # LayerNormalization into SkipLayerNormalization), and a part fused as the whole model is computes its
    # outputs bit for bit as the whole model does.
    known = {value.name: value for value in [*graph.value_info, *graph.output]}
    result = helper.make_model(
        helper.make_graph(
            [graph.node[i] for i in sorted(keep)],
            graph.name,
            [_input_value(graph, t) for t in inputs],
            [known.get(o) or helper.make_empty_tensor_value_info(o) for o in outputs],
            initializers,
            value_info=[known[t] for t in sorted(seen - set(outputs)) if t in known],
        ),
        opset_imports=model.opset_import,
        ir_version=model.ir_version,
    )
    overridable = [init.name for init in initializers if init.name in {v.name for v in graph.input}]
    result.graph.input.extend(_input_value(graph, name) for name in overridable)  # e.g. edge_keep stays feedable
    return _renamed(
        result, {**dict(zip(outputs, output_names, strict=True)), **dict(zip(inputs, input_names or inputs, strict=True))}
    )


def _input_value(graph: Any, name: str) -> Any:
    """The graph input's declaration, else a float tensor of unknown shape."""
    from onnx import TensorProto, helper

    for value in graph.input:
        if value.name == name:
            copy = type(value)()
            copy.CopyFrom(value)
            return copy
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, None)


def _renamed(model: Any, names: dict[str, str]) -> Any:
    """`model` with tensors renamed (graph inputs, outputs and every node's reads and writes)."""
    graph = model.graph
    for node in graph.node:
        node.input[:] = [names.get(t, t) for t in node.input]
        node.output[:] = [names.get(t, t) for t in node.output]
    for value in [*graph.input, *graph.output, *graph.value_info]:
        value.name = names.get(value.name, value.name)
    return model
