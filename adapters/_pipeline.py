"""What the two pipeline adapters (gpipe, pipeline) share: layer counts, splits, checks, tied weights.

A pipeline cuts `workload.sequential(model)` into consecutive stages. Everything here is plain
PyTorch and runs before launch where it can, so bad input fails in the parent with one line:
the layer count comes from a model built on the meta device (no memory, no compute).

Tied weights (GPT-2's wte / lm_head): a pipeline that puts the embedding and the head on different
stages cannot share one Parameter between them. `untie` gives the second name its own Parameter,
initialised equal to the first; after every backward the two gradients are summed and both copies
receive the sum (`TiedPair`), so an optimizer that treats them alike keeps them bit-identical and
the update equals the tied model's. The copy really costs memory (weights, gradient, optimizer
state) and is counted in the record like any other tensor; gradient-norm clipping must count the
tied gradient once (`TiedPair.copy` is excluded). Megatron handles its tied embedding the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ptbench.core.errors import ConfigError
from ptbench.workloads.base import Workload


def layer_count(workload: Workload) -> int:
    """Layers of the workload's sequential form, from a model built on the meta device."""
    with torch.device("meta"):
        return len(workload.sequential(workload.build_model()))


def even_split(layers: int, stages: int) -> list[int]:
    """Layers per stage by count; the first `layers % stages` stages take one more."""
    q, r = divmod(layers, stages)
    return [q + (i < r) for i in range(stages)]


def check_split(balance: list[int] | None, layers: int, stages: int, workload: str, stages_from: str) -> list[int]:
    """Layers per stage (explicit `adapter.balance`, else an even split); ConfigError if impossible.

    `stages_from` names the setting the stage count came from, for the message (e.g. 'adapter.pipeline_parallel=2').
    """
    if stages < 1:
        raise ConfigError(f"{stages_from}: a pipeline needs at least 1 stage")
    if stages > layers:
        raise ConfigError(
            f"{stages_from} asks for {stages} pipeline stages but {workload} has only {layers} layers "
            f"in its sequential form; use at most {layers} stages"
        )
    if balance is None:
        return even_split(layers, stages)
    balance = [int(b) for b in balance]
    if len(balance) != stages:
        raise ConfigError(
            f"adapter.balance={balance} has {len(balance)} entries but {stages_from} means {stages} stages; "
            f"give one layer count per stage"
        )
    if any(b <= 0 for b in balance):
        raise ConfigError(f"adapter.balance={balance}: every stage needs at least one layer")
    if sum(balance) != layers:
        raise ConfigError(
            f"adapter.balance={balance} sums to {sum(balance)} but {workload} has {layers} layers; make "
            f"the entries sum to {layers}, e.g. adapter.balance=[{','.join(map(str, even_split(layers, stages)))}]"
        )
    return balance


def check_microbatches(batch: int, microbatches: int, what: str) -> None:
    if microbatches < 1:
        raise ConfigError(f"adapter.microbatches={microbatches} must be >= 1 (0 picks the adapter's default)")
    if batch % microbatches:
        raise ConfigError(
            f"{what} {batch} is not divisible by {microbatches} micro-batches; change trainer.batch_size "
            f"or adapter.microbatches"
        )


def stage_slices(balance: list[int]) -> list[slice]:
    out, start = [], 0
    for n in balance:
        out.append(slice(start, start + n))
        start += n
    return out


def stage_of_layer(balance: list[int], layer: int) -> int:
    for i, s in enumerate(stage_slices(balance)):
        if s.start <= layer < s.stop:
            return i
    raise IndexError(layer)


def layer_index(seq: nn.Sequential, param_name: str) -> int:
    """Index of the top-level layer of `seq` that holds the parameter `param_name` (e.g. 'head.lm_head.weight')."""
    return list(dict(seq.named_children())).index(param_name.split(".", 1)[0])


@dataclass
class TiedPair:
    """One weight held twice: `main` (e.g. the embedding) and `copy` (e.g. the head); either may be None
    on a rank that holds only the other one."""

    main_name: str
    copy_name: str
    main: nn.Parameter | None = None
    copy: nn.Parameter | None = None

    @torch.no_grad()
    def sum_local_grads(self) -> None:
        """Both copies in this process (GPipe, or one rank holding both stages): each gets the sum."""
        g = grad_or_zeros(self.main)
        g.add_(grad_or_zeros(self.copy).to(g.device))
        self.copy.grad.copy_(g)


def grad_or_zeros(p: nn.Parameter) -> torch.Tensor:
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    return p.grad


def untie(seq: nn.Sequential, pairs: list[tuple[str, str]]) -> list[TiedPair]:
    """Give the second parameter of each tied pair its own Parameter, initialised equal to the first."""
    out = []
    for main_name, copy_name in pairs:
        main = seq.get_parameter(main_name)
        owner, attr = copy_name.rsplit(".", 1)
        module = seq.get_submodule(owner)
        if getattr(module, attr) is not main:
            raise ValueError(f"{copy_name} is not tied to {main_name}")
        copy = nn.Parameter(main.detach().clone(), requires_grad=main.requires_grad)
        setattr(module, attr, copy)
        out.append(TiedPair(main_name, copy_name, main, copy))
    return out


def tied_copies(pairs: list[TiedPair]) -> set[int]:
    """ids of the copies: what gradient clipping and unique-parameter counts must skip."""
    return {id(p.copy) for p in pairs if p.copy is not None}
