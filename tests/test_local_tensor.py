"""A numerics gate past our cores: torch's LocalTensorMode (torch.distributed._local_tensor) runs every rank of
adapter=tensor_parallel in one process with real numbers (on torch's fake process group, as torch's own
LocalDTensor tests do), and the result must equal one device: the logits, the loss of two training steps and
the parameters after them.

Tolerances (on the difference over the largest magnitude, when that is above 1): fp64 1e-12 for the logits and for the gradients of an fp64 objective over them; the workload computes
its loss in fp32 whatever the model's dtype (Workload.loss, workloads/gpt2.py), so the losses of the two training
steps compare within 1e-5 and the fp64 parameters after them within 1e-10 (6.6e-12 seen at W=4); fp32 1e-5.
The vocabulary is a multiple of W: an uneven split gives each simulated rank another shape, which the adapter's
own host-side integers cannot hold under the mode."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torch.distributed._local_tensor")

TOL = {torch.float64: (1e-12, 1e-10), torch.float32: (1e-5, 1e-5)}  # (logits and gradients, parameters)
LOSS_TOL = 1e-5  # an fp32 loss in both dtypes


def _config(world: int):
    from ptbench.runner.compose import compose, typed

    return typed(
        compose(
            [
                "adapter=tensor_parallel",
                f"adapter.tensor_parallel={world}",
                "workload=gpt2_tiny",
                "workload.n_head=8",  # whole heads on every one of 8 ranks
                "workload.vocab_size=1024",
                "optimizer=sgd",  # momentum and weight decay: the second step reads the first's state
                f"launcher.nprocs={world}",
            ]
        )
    )


def _one_device(cfg, workload, x, y, weight):
    from ptbench.core.optim import build_optimizer

    torch.manual_seed(cfg.trainer.seed)
    model = workload.build_model()
    optimizer = build_optimizer(model.parameters(), cfg.optimizer)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    logits = model(x)
    grads = _objective_grads(model, logits, weight)
    losses = []
    for _ in range(2):
        loss = workload.loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    moved = max(float((p.detach() - start[n]).abs().max()) for n, p in model.named_parameters())
    return logits.detach(), grads, losses, {n: p.detach() for n, p in model.named_parameters()}, moved


def _objective_grads(model, logits, weight) -> dict:
    """Gradients of sum(logits x weight), in the model's dtype (no fp32 loss in between); cleared after."""
    (logits * weight).sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = None
    return grads


def _all_ranks(cfg, workload, x, y, weight, world: int):
    """The adapter's own setup and train_step for every rank at once; each result per rank."""
    import torch.distributed as dist
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.distributed.tensor import DTensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from ptbench.adapters import get_adapter_class
    from ptbench.core.dist import DistContext
    from ptbench.core.timing import PhaseTimer

    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    try:
        with LocalTensorMode(world):
            torch.manual_seed(cfg.trainer.seed)
            adapter = get_adapter_class("tensor_parallel")(cfg, workload, DistContext(world_size=world, backend="fake"))
            adapter.setup()
            logits = adapter.model(x).full_tensor()
            grads = _objective_grads(adapter.model, logits, weight)
            grads = {n: g.full_tensor() if isinstance(g, DTensor) else g for n, g in grads.items()}
            losses = [adapter.train_step([(x, y)], PhaseTimer()) for _ in range(2)]
            params = {n: p.full_tensor() if isinstance(p, DTensor) else p for n, p in adapter.model.named_parameters()}
    finally:
        dist.destroy_process_group()
    return logits.detach(), grads, losses, params


def _worst(local, ref) -> float:
    """The largest difference of any rank's value from one device's, over the largest magnitude when above 1 (an
    objective over 128k logits has gradients near 1e3, whose last fp32 bits are 1e-4)."""
    scale = max(1.0, float(ref.abs().max()))
    return max(float((v - ref).abs().max()) for v in local._local_tensors.values()) / scale


@pytest.mark.parametrize("world", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_tensor_parallel_on_every_rank_equals_one_device(world, dtype):
    from ptbench.workloads import build_workload

    cfg = _config(world)
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        workload = build_workload(cfg.workload, cfg.data)
        gen = torch.Generator().manual_seed(1)
        x = torch.randint(0, cfg.workload.vocab_size, (2, cfg.workload.seq_len), generator=gen)
        y = torch.randint(0, cfg.workload.vocab_size, (2, cfg.workload.seq_len), generator=gen)
        weight = torch.randn((*x.shape, cfg.workload.vocab_size), generator=gen)  # made here: the mode draws per rank
        ref_logits, ref_grads, ref_losses, ref_params, moved = _one_device(cfg, workload, x, y, weight)
        logits, grads, losses, params = _all_ranks(cfg, workload, x, y, weight, world)
    finally:
        torch.set_default_dtype(before)
    tol, param_tol = TOL[dtype]
    assert len(logits._local_tensors) == world
    worst = {"logits": _worst(logits, ref_logits)}
    worst["gradients"] = max(_worst(grads[n], ref_grads[n]) for n in ref_grads)
    worst["losses"] = max(_worst(loss, ref) for loss, ref in zip(losses, ref_losses))
    assert set(params) == set(ref_params)
    worst["parameters"] = max(_worst(params[n], ref_params[n]) for n in params)
    print(f"tensor_parallel W={world} {dtype}: largest difference from one device: {worst}")
    assert worst["logits"] <= tol and worst["gradients"] <= tol
    assert worst["losses"] <= LOSS_TOL and worst["parameters"] <= param_tol
    assert moved > 100 * param_tol  # the two steps moved the weights by far more than the tolerance
