"""`fused/plan.json` as a typed contract: what the `fuse` stage writes and the fused generator runs.

The plan comes with the artifact, and a fetched artifact's files are only as safe as its pusher: a plan is read
through these models (known fields of known types, segment files of its own folder, a data flow in which every
step reads what an earlier step made, a constant or a feed), so a crafted or damaged one is one UserError naming
the field when the artifact loads, not a KeyError in a request.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from kokoro_opt.errors import UserError, read_validated

PLAN_FILE = "plan.json"
CONSTANTS_FILE = "constants.npz"
PLAN_HINT = "rebuild or fetch the artifact again"


def _finite(value: float) -> float:
    if not math.isfinite(value):
        raise ValueError("must be a finite number")
    return value


Finite = Annotated[float, AfterValidator(_finite)]
Tensor = Annotated[str, Field(min_length=1, max_length=512)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class NormChain(_Strict):
    """A norm, Snake and QuantizeLinear after one generator InstanceNormalization. `level`: its input is a
    convolution's uint8 levels; `float`: a float tensor; `residual`: a residual stream plus a convolution's levels
    (`q`), the sum kept as `x_new`. `post_gain`/`post_shift`: AdaIN applied after a norm the branches share."""

    name: Annotated[str, Field(pattern=r"^chain_\d{2,3}$")]
    kind: Literal["level", "float", "residual"]
    norm: str = ""  # the InstanceNormalization it replaces: for a reader of the plan
    x: Tensor
    out: Tensor
    eps: Annotated[Finite, Field(gt=0)]
    poly: tuple[Finite, Finite, Finite]
    norm_scale: Tensor
    norm_bias: Tensor
    post_gain: Tensor | None = None
    post_shift: Tensor | None = None
    q: Tensor | None = None
    x_new: Tensor | None = None
    reads: list[Tensor]
    in_place: bool = False

    @model_validator(mode="after")
    def _parts_of_its_kind(self) -> NormChain:
        if (self.kind == "residual") != (self.q is not None and self.x_new is not None):
            raise ValueError(f"{self.name}: q and x_new go with kind 'residual', and only with it")
        if (self.post_gain is None) != (self.post_shift is None):
            raise ValueError(f"{self.name}: post_gain and post_shift go together")
        if self.in_place and self.kind != "residual":
            raise ValueError(f"{self.name}: only a residual chain or a branch sum writes in place")
        return self

    def made(self) -> list[str]:
        return [self.out, *([self.x_new] if self.x_new else [])]


class BranchSum(_Strict):
    """A stage's output: the mean of its three branches' residual streams plus their convolutions' levels."""

    name: Annotated[str, Field(pattern=r"^chain_\d{2,3}$")]
    kind: Literal["sum"]
    q: tuple[Tensor, Tensor, Tensor]
    x: tuple[Tensor, Tensor, Tensor]
    divisor: Finite
    out: Tensor
    reads: list[Tensor]
    in_place: bool = False

    @model_validator(mode="after")
    def _divides(self) -> BranchSum:
        if self.divisor == 0:
            raise ValueError(f"{self.name}: divisor must not be 0")
        return self

    def made(self) -> list[str]:
        return [self.out]


Chain = Annotated[NormChain | BranchSum, Field(discriminator="kind")]


class KernelStep(_Strict):
    """Chains run by the native kernels (runtime/glue); `release`: the tensors nothing after the step reads."""

    chains: list[Chain]
    release: list[Tensor] = Field(default_factory=list)


class SegmentStep(_Strict):
    """One ONNX Runtime segment: what it reads and makes; `release` as a KernelStep's."""

    segment: Annotated[str, Field(pattern=r"^segment_\d{2,3}\.onnx$")]  # a file of the plan's own folder
    inputs: list[Tensor]
    outputs: Annotated[list[Tensor], Field(min_length=1)]
    release: list[Tensor] = Field(default_factory=list)


def _step_kind(step: Any) -> str:
    """A step runs a segment or chains: told apart by its `segment` field, so an error names the field of the one."""
    if isinstance(step, dict):
        return "segment" if "segment" in step else "chains"
    return "segment" if isinstance(step, SegmentStep) else "chains"


Step = Annotated[Annotated[KernelStep, Tag("chains")] | Annotated[SegmentStep, Tag("segment")], Discriminator(_step_kind)]


class FusedPlan(_Strict):
    format: Literal[1]
    inputs: Annotated[list[Tensor], Field(min_length=1)]
    outputs: Annotated[list[Tensor], Field(min_length=1)]
    steps: Annotated[list[Step], Field(min_length=1)]

    def segments(self) -> list[str]:
        return [step.segment for step in self.steps if isinstance(step, SegmentStep)]

    def chains(self) -> list[NormChain | BranchSum]:
        return [chain for step in self.steps if isinstance(step, KernelStep) for chain in step.chains]

    def check_flow(self, constants: Iterable[str]) -> None:
        """Every tensor a step reads is a feed, a constant or made by an earlier step and not yet released, every
        chain has its own constants, and the output is made: ValueError naming the first that is not."""
        held, stored = set(self.inputs), set(constants)
        for k, step in enumerate(self.steps):
            parts = [step] if isinstance(step, SegmentStep) else step.chains
            in_step: set[str] = set()  # a step's chains are all prepared before any of them runs (runtime/fused.py)
            for part in parts:
                if isinstance(part, NormChain) and (early := [n for n in _prepared_reads(part) if n in in_step]):
                    raise ValueError(f"{part.name} reads {early[0]!r}, which a chain of its own step makes")
                reads = part.inputs if isinstance(part, SegmentStep) else [*part.reads, *_kernel_reads(part)]
                missing = [name for name in reads if name not in held and name not in stored]
                if missing:
                    raise ValueError(f"step {k} reads {missing[0]!r}, which nothing before it makes")
                if not isinstance(part, SegmentStep) and (absent := [c for c in own_constants(part) if c not in stored]):
                    raise ValueError(f"{part.name} has no constant {absent[0]!r} in {CONSTANTS_FILE}")
                held.update(part.outputs if isinstance(part, SegmentStep) else part.made())
                in_step.update([] if isinstance(part, SegmentStep) else part.made())
            held.difference_update(step.release)
        if missing := [name for name in self.outputs if name not in held]:
            raise ValueError(f"the output {missing[0]!r} is not made")

    @classmethod
    def read(cls, folder: Path, constants: Iterable[str]) -> FusedPlan:
        """The folder's plan, checked against the names of its `constants`."""
        plan = read_validated(folder / PLAN_FILE, cls, PLAN_HINT)
        try:
            plan.check_flow(constants)
        except ValueError as exc:
            raise UserError(f"{folder / PLAN_FILE} is not a fused generator's plan: {exc}", PLAN_HINT) from None
        return plan


def _kernel_reads(chain: NormChain | BranchSum) -> list[str]:
    """What the kernels read beside `reads`: the tensors named in the chain's fields (a plan whose `reads` leaves
    one out must not reach a lookup that fails mid-request)."""
    if isinstance(chain, BranchSum):
        return [*chain.q, *chain.x]
    named = [chain.x, chain.norm_scale, chain.norm_bias, chain.post_gain, chain.post_shift, chain.q]
    return [name for name in named if name]


def _prepared_reads(chain: NormChain) -> list[str]:
    """What a chain's arguments copy when they are prepared: its norm's scale and bias, and its gain and shift."""
    return [name for name in (chain.norm_scale, chain.norm_bias, chain.post_gain, chain.post_shift) if name]


def own_constants(chain: NormChain | BranchSum) -> list[str]:
    """The constants a chain's kernel reads by its name: the next convolution's quantization, and its input's."""
    if isinstance(chain, BranchSum):
        return [f"{chain.name}.{key}{j}" for j in range(3) for key in ("scale", "zero")]
    keys = ("qscale", "qzero") if chain.kind == "float" else ("qscale", "qzero", "scale", "zero")
    return [f"{chain.name}.{key}" for key in keys]
