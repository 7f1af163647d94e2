"""The whole generator cut at its chains: ONNX Runtime segments between them, and each chain's constants.

A chain is the pattern the `snake` stage writes after each generator InstanceNormalization (its input,
optionally AdaIN's gain and shift applied after a norm shared by the three branches of a stage, Snake's
rounding and polynomial, and the QuantizeLinear the `quantize` stage put before the next convolution). The
fused generator (runtime/fused.py) runs the chains with native kernels (runtime/glue) and everything else in
ONNX Runtime: nodes are grouped by how many chains stand before them, so the three branches of a stage share
their segments, and a chain runs as soon as its inputs exist. A chain's input that is a convolution's
DequantizeLinear is taken as the uint8 levels (a table per channel), and one that is a residual add of a
convolution's output is computed by the chain itself (runtime/glue/chains.c).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kokoro_opt.onnx_graph import PatternIndex

SNAKE_OPS = ("Add", "Sub", "Sub", "Mul", "Mul", "Add", "Mul", "Add", "QuantizeLinear")


@dataclass
class ChainNodes:
    """One chain as found in the graph: its description for the plan, its constants, the nodes it replaces."""

    spec: dict[str, Any]
    constants: dict[str, np.ndarray]
    nodes: list[Any] = field(default_factory=list)

    def inputs(self) -> list[str]:
        return [n for n in self.spec["reads"] if n not in self.constants]

    def outputs(self) -> list[str]:
        return [self.spec["out"], *([self.spec["x_new"]] if self.spec.get("x_new") else [])]


class _Chains(PatternIndex):
    """The graph index with what the chain matcher asks of it."""

    def only(self, name: str) -> Any:
        """The one node reading `name` (a node reading it twice, `r * r`, counts once)."""
        readers = {id(n): n for n in self.consumers.get(name, [])}
        if len(readers) != 1:
            raise LookupError(name)
        return next(iter(readers.values()))

    def first_const(self, node: Any) -> np.ndarray:
        return next(self.const[i] for i in node.input if i in self.const)

    def vector(self, name: str) -> np.ndarray:
        return self.const[name].astype(np.float32).reshape(-1)

    def single_dq(self, name: str) -> Any | None:
        """The DequantizeLinear of constant scale and zero point that makes `name` and is its only reader."""
        p = self.producer.get(name)
        if p is None or p.op_type != "DequantizeLinear" or len(self.consumers.get(name, [])) != 1:
            return None
        return p if all(i in self.const for i in p.input[1:]) else None


def _scalar(value: np.ndarray) -> float:
    return float(np.asarray(value).reshape(-1)[0])


def find_chains(model: Any) -> list[ChainNodes]:
    g = _Chains(model)
    chains = []
    for shifted in g.graph.node:
        if not (shifted.op_type == "Add" and shifted.name.endswith("y_shifted") and shifted.input[1] in g.const):
            continue
        y = shifted.input[0]
        try:
            rounded = g.only(shifted.output[0])
            rest = next(c for c in g.consumers[y] if c.op_type == "Sub")  # y is read by the shift, this and the sum
            square = g.only(rest.output[0])
            scaled = next(c for c in g.consumers[square.output[0]] if any(i in g.const for i in c.input))
            horner = g.only(scaled.output[0])
            sin2 = g.only(horner.output[0])
            added = g.only(sin2.output[0])
            quantize = g.only(added.output[0])
        except (LookupError, StopIteration):  # begins like a chain and is not one: left to ONNX Runtime
            continue
        snake = [shifted, rounded, rest, square, scaled, horner, sin2, added, quantize]
        if tuple(n.op_type for n in snake) != SNAKE_OPS or y not in g.producer:
            continue
        spec: dict[str, Any] = {"poly": [_scalar(g.first_const(n)) for n in (shifted, scaled, horner)]}
        nodes = list(snake)
        made = g.producer[y]
        if made.op_type == "InstanceNormalization":
            norm = made
        else:  # AdaIN after a norm the three branches share
            gain = g.producer[made.input[0]]
            norm = g.producer[gain.input[0]]
            spec.update(post_gain=gain.input[1], post_shift=made.input[1])
            nodes += [made, gain]
        eps = next((a.f for a in norm.attribute if a.name == "epsilon"), 1e-5)
        name = f"chain_{len(chains):02d}"
        constants = {f"{name}.qscale": g.vector(quantize.input[1]), f"{name}.qzero": g.vector(quantize.input[2])}
        spec.update(name=name, norm=norm.name, eps=eps, norm_scale=norm.input[1], norm_bias=norm.input[2], out=quantize.output[0])
        for key in ("norm_scale", "norm_bias"):
            if spec[key] in g.const:
                constants[spec[key]] = g.vector(spec[key])
        x = norm.input[0]
        kind, source = "float", g.producer.get(x)
        if (dq := g.single_dq(x)) is not None:
            kind, x = "level", dq.input[0]
            nodes.append(dq)
        elif source is not None and source.op_type == "Add" and "post_gain" not in spec:
            for j, addend in enumerate(source.input):
                if (dq := g.single_dq(addend)) is not None:  # x = prev + DequantizeLinear(a convolution's levels)
                    kind = "residual"
                    spec.update(q=dq.input[0], x_new=x)
                    x = source.input[1 - j]
                    nodes += [source, dq]
                    break
        if kind != "float":
            constants[f"{name}.scale"], constants[f"{name}.zero"] = g.vector(dq.input[1]), g.vector(dq.input[2])
        nodes.append(norm)
        spec.update(kind=kind, x=x)
        reads = ("x", "q", "norm_scale", "norm_bias", "post_gain", "post_shift")
        spec["reads"] = [spec[k] for k in reads if spec.get(k)]
        chains.append(ChainNodes(spec, constants, nodes))
    return chains + find_branch_sums(g, len(chains))


def find_branch_sums(g: _Chains, first: int) -> list[ChainNodes]:
    """A stage's output: the mean of its three branches' last residual adds, ((r0 + r1) + r2) / 3, each
    r = DequantizeLinear(a convolution's levels) + the branch's residual stream; summed in one pass."""
    sums = []
    for div in g.graph.node:
        if div.op_type != "Div" or div.input[1] not in g.const or g.const[div.input[1]].size != 1:
            continue
        outer = g.producer.get(div.input[0])
        inner = g.producer.get(outer.input[0]) if outer is not None and outer.op_type == "Add" else None
        if inner is None or inner.op_type != "Add" or len(g.consumers.get(outer.output[0], [])) != 1:
            continue
        branches = [g.producer.get(r) for r in (*inner.input, outer.input[1])]
        if len(g.consumers.get(inner.output[0], [])) != 1 or any(b is None or b.op_type != "Add" for b in branches):
            continue
        parts = []
        for branch in branches:
            dq = next((d for i in branch.input if (d := g.single_dq(i)) is not None), None)
            if dq is None or len(g.consumers.get(branch.output[0], [])) != 1:
                break
            parts.append((dq, next(i for i in branch.input if i != dq.output[0]), branch))
        if len(parts) != 3:
            continue
        name = f"chain_{first + len(sums):02d}"
        constants = {}
        for j, (dq, _, _) in enumerate(parts):
            constants[f"{name}.scale{j}"], constants[f"{name}.zero{j}"] = g.vector(dq.input[1]), g.vector(dq.input[2])
        spec = {"name": name, "kind": "sum", "q": [dq.input[0] for dq, _, _ in parts], "x": [x for _, x, _ in parts],
                "divisor": _scalar(g.const[div.input[1]]), "out": div.output[0]}  # fmt: skip
        spec["reads"] = [*spec["q"], *spec["x"]]
        nodes = [div, outer, inner, *(n for dq, _, branch in parts for n in (dq, branch))]
        sums.append(ChainNodes(spec, constants, nodes))
    return sums


def _constant_nodes(nodes: list[Any], inits: set[str]) -> set[int]:
    """Nodes computed from initializers alone (weights' DequantizeLinear): they go with their readers."""
    made: set[str] = set()
    found = set()
    for n in nodes:
        if all(not i or i in inits or i in made for i in n.input):
            found.add(id(n))
            made.update(n.output)
    return found


def cut_at_chains(model: Any) -> tuple[list[Any], dict[str, Any], dict[str, np.ndarray]]:
    """(segment models, plan, constants) for `model`, a whole generator; ValueError if it has no chains."""
    import onnx
    from onnx import helper, shape_inference

    model = shape_inference.infer_shapes(model)
    graph = model.graph
    chains = find_chains(model)
    if not chains:
        raise ValueError("no norm-Snake-quantize chains in the generator (is it the int8 generator of the snake stage?)")
    replaced = {id(n) for c in chains for n in c.nodes}
    nodes = [n for n in graph.node if id(n) not in replaced]
    inits = {i.name: i for i in graph.initializer}
    constant = _constant_nodes(nodes, set(inits))
    constant_maker = {o: n for n in nodes if id(n) in constant for o in n.output}
    outputs = [o.name for o in graph.output]
    node_depth, chain_depth = _depths(graph, nodes, chains, set(inits), constant, constant_maker)

    levels = max(node_depth.values()) + 1
    groups: list[list[Any]] = [[] for _ in range(levels)]
    for n in nodes:
        if id(n) not in constant:
            groups[node_depth[id(n)]].append(n)
    readers: dict[str, set[int]] = defaultdict(set)
    for d, group in enumerate(groups):
        for n in group:
            for i in n.input:
                readers[i].add(d)
    chain_reads = {i for c in chains for i in c.inputs()}
    uint8: set[str] = set()  # the convolutions' levels and the chains' outputs; a branch sum makes floats
    for c in chains:
        spec = c.spec
        if spec["kind"] == "sum":
            uint8.update(spec["q"])
        else:
            uint8.update([spec["out"], *([spec["q"]] if "q" in spec else []), *([spec["x"]] if spec["kind"] == "level" else [])])
    known = {v.name: v for v in [*graph.value_info, *graph.input, *graph.output]}

    def value_info(name: str) -> Any:
        if name in known and known[name].type.tensor_type.elem_type:
            return known[name]
        kind = onnx.TensorProto.UINT8 if name in uint8 else onnx.TensorProto.FLOAT
        return helper.make_tensor_value_info(name, kind, None)

    segments, steps = [], []
    for d, group in enumerate(groups):
        steps.append({"chains": [c.spec for c in chains if chain_depth[c.spec["name"]] == d]})
        needed, stack = set(), [i for n in group for i in n.input if i in constant_maker]  # ids of constant makers
        while stack:
            maker = constant_maker[stack.pop()]
            if id(maker) not in needed:
                needed.add(id(maker))
                stack += [i for i in maker.input if i in constant_maker]
        body = [n for n in nodes if id(n) in needed] + group
        made = {o for n in body for o in n.output}
        ins = list(dict.fromkeys(i for n in body for i in n.input if i and i not in made and i not in inits))
        outs = [o for n in group for o in n.output if o in outputs or o in chain_reads or readers[o] - {d}]
        used = {i: inits[i] for n in body for i in n.input if i in inits}
        segment = helper.make_graph(body, f"segment_{d:02d}", [value_info(i) for i in ins], [value_info(o) for o in outs],
                                    list(used.values()))  # fmt: skip
        segments.append(helper.make_model(segment, opset_imports=model.opset_import, ir_version=model.ir_version))
        steps.append({"segment": f"segment_{d:02d}.onnx", "inputs": ins, "outputs": outs})
    steps = [s for s in steps if s.get("chains", True)]
    _add_releases(steps, outputs)
    _mark_in_place(chains, steps, outputs)
    constants = {k: v for c in chains for k, v in c.constants.items()}
    plan = {"format": 1, "inputs": [i.name for i in graph.input], "outputs": outputs, "steps": steps}
    return segments, plan, constants


def _depths(
    graph: Any, nodes: list[Any], chains: list[ChainNodes], inits: set[str], constant: set[int], constant_maker: dict[str, Any]
) -> tuple[dict[int, int], dict[str, int]]:
    """How many chains stand before each node (by id) and each chain (by name): a segment holds the nodes of one
    depth, and a chain runs as soon as its inputs exist."""
    depth = {i.name: 0 for i in graph.input}
    node_depth: dict[int, int] = {}
    chain_depth: dict[str, int] = {}
    waiting = list(chains)
    for n in nodes:
        if id(n) in constant:
            continue
        d = max([depth[i] for i in n.input if i and i not in inits and i not in constant_maker] + [0])
        node_depth[id(n)] = d
        depth.update(dict.fromkeys(n.output, d))
        ready = True
        while ready:
            ready = [c for c in waiting if all(i in depth for i in c.inputs())]
            for c in ready:
                cd = max(depth[i] for i in c.inputs()) + 1
                chain_depth[c.spec["name"]] = cd
                depth.update(dict.fromkeys(c.outputs(), cd))
                waiting.remove(c)
    if waiting:
        raise ValueError(f"chains whose inputs no node makes: {[c.spec['norm'] for c in waiting]}")
    return node_depth, chain_depth


def _mark_in_place(chains: list[ChainNodes], steps: list[dict[str, Any]], outputs: list[str]) -> None:
    """A residual stream nothing else reads is overwritten by its sum (`in_place`): one tensor less alive."""
    read_by: dict[str, int] = defaultdict(int)
    for step in steps:
        for name in _step_reads(step):
            read_by[name] += 1
    for c in chains:
        kind, first = c.spec["kind"], c.spec["x"][0] if c.spec["kind"] == "sum" else c.spec["x"]
        c.spec["in_place"] = kind in ("residual", "sum") and read_by[first] == 1 and first not in outputs


def _add_releases(steps: list[dict[str, Any]], keep: list[str]) -> None:
    """Each step's `release`: tensors nothing after it reads, so a run holds only what it still needs."""
    last: dict[str, int] = {}
    for k, step in enumerate(steps):
        reads = _step_reads(step)
        for name in reads:
            last[name] = k
    for k, step in enumerate(steps):
        step["release"] = sorted(n for n, at in last.items() if at == k and n not in keep)


def _step_reads(step: dict[str, Any]) -> list[str]:
    """What a step of the plan reads: a segment's inputs and its chains' inputs."""
    return [*step.get("inputs", []), *(v for c in step.get("chains", []) for v in c["reads"])]
