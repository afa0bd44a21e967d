"""adapter=pipedream cannot hang on NCCL: its real point-to-point issue order, replayed under NCCL's ordering rule.

Gloo buffers a send and matches it to a receive by tag whenever the receive comes, so any issue order runs on the
CPU. NCCL does not: a rank's batched sends and receives (and its collectives) run on one stream in issue order, and
a send completes only when its peer's matching receive runs (tags are ignored; the n-th send from a to b meets the
n-th receive at b from a). An order that runs on gloo can therefore hang on a GPU at the first step.

This test records what each stage really issues (2 and 4 real gloo ranks driving the adapter: setup, train_step,
the epoch's drain, validation; `torch.distributed`'s point-to-point calls wrapped to log and then call through) and
replays the logs under the rule, taken strictly: each rank does one thing at a time in its issue order (a single
send or receive, one `batch_isend_irecv` batch whose operations proceed together, or a collective); an operation
completes only together with its match in the peer's current batch; a batch ends when all of its operations have.
Every collective and, in the `step_syncs` variant, every step's end is a point all ranks must reach together (the
trainer syncs the device after its first step and agrees on a stop every `trainer.stop_check_every` steps): an
exchange still pending there hangs. A replay that stops short names where each rank waits.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

STEPS, BATCH = 5, 8
GPT = ["workload=gpt2_tiny", "workload.seq_len=8", "workload.vocab_size=128", "workload.dropout=0", "optimizer=sgd"]
RESNET = ["workload=resnet50_tiny", "optimizer=sgd"]
CASES = {  # world size: [(name, overrides)]
    2: [
        ("gpt2_pipedream_m1", [*GPT, "adapter.microbatches=1"]),
        ("gpt2_pipedream_m2_flush3", [*GPT, "adapter.microbatches=2", "adapter.flush_every=3"]),
        ("gpt2_2bw_m2", [*GPT, "adapter.schedule=2bw", "adapter.microbatches=2"]),
        ("resnet_pipedream_m1", [*RESNET, "adapter.microbatches=1"]),
    ],
    4: [
        ("gpt2_pipedream_m1_flush3", [*GPT, "adapter.microbatches=1", "adapter.flush_every=3"]),
        ("gpt2_pipedream_m2", [*GPT, "adapter.microbatches=2"]),
    ],
}


def _record(log: list) -> dict:
    """Wrap torch.distributed's point-to-point calls and object collective: log each, then call the real one.
    Returns what to put back. The single calls are wrapped where `batch_isend_irecv` checks and calls them too
    (distributed_c10d); a call made inside a wrapped one is not logged again (a batch is one item)."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    saved = {
        name: getattr(c10d, name)
        for name in ("isend", "send", "irecv", "recv", "batch_isend_irecv", "all_gather_object")
    }
    inside = []  # a wrapped call in progress: what it calls (recv calls irecv, a batch isend/irecv) logs nothing

    def single(kind, real):
        def call(tensor, *args, **kwargs):
            if not inside:
                peer = args[0] if args else kwargs.get("dst", kwargs.get("src"))
                log.append({"p2p": [[kind, peer, kwargs.get("tag", 0), tensor.numel()]]})
            inside.append(kind)
            try:
                return real(tensor, *args, **kwargs)
            finally:
                inside.pop()

        return call

    def batch(ops):
        log.append({"p2p": [["send" if o.op is c10d.isend else "recv", o.peer, o.tag, o.tensor.numel()] for o in ops]})
        inside.append("batch")
        try:
            return saved["batch_isend_irecv"](ops)
        finally:
            inside.pop()

    def gather(*args, **kwargs):
        log.append({"collective": "all_gather_object"})
        return saved["all_gather_object"](*args, **kwargs)

    kinds = {"isend": "send", "send": "send", "irecv": "recv", "recv": "recv"}
    wrapped = {name: single(kind, saved[name]) for name, kind in kinds.items()}
    wrapped.update(batch_isend_irecv=batch, all_gather_object=gather)
    for name, fn in wrapped.items():
        setattr(c10d, name, fn)
        setattr(dist, name, fn)
    return saved


def _inputs(cfg, n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    if cfg.workload.kind == "vision":
        size = cfg.workload.image_size
        return torch.randn(n, 3, size, size, generator=g), torch.randint(0, cfg.workload.num_classes, (n,), generator=g)
    seq, vocab = cfg.workload.seq_len, cfg.workload.vocab_size
    return torch.randint(0, vocab, (n, seq), generator=g), torch.randint(0, vocab, (n, seq), generator=g)


def _rank(rank: int, world: int, port: int, out: str) -> None:
    """One stage: every case in turn on one gloo group, its issue log per case as JSON."""
    import torch.distributed as dist

    from ptbench.adapters.pipedream import PipedreamAdapter
    from ptbench.core.dist import DistContext
    from ptbench.core.timing import PhaseTimer
    from ptbench.runner.compose import compose, typed
    from ptbench.workloads import build_workload

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    for name, overrides in CASES[world]:
        cfg = typed(
            compose(["adapter=pipedream", f"trainer.batch_size={BATCH}", f"launcher.nprocs={world}", *overrides])
        )
        PipedreamAdapter.validate(cfg, world)
        torch.manual_seed(0)
        ad = PipedreamAdapter(cfg, build_workload(cfg.workload, cfg.data), DistContext(rank=rank, world_size=world))
        ad.setup()
        ad.train()
        log: list = []
        saved = _record(log)
        g = torch.Generator().manual_seed(1)
        for step in range(STEPS):
            ad.train_step([_inputs(cfg, BATCH, g)], PhaseTimer(cuda_sync=False))
            log.append({"step_end": step})
        ad.end_epoch()
        ad.eval()
        for n in (BATCH, BATCH // 2):  # the last validation batch may be smaller: shapes sent every time
            x, y = _inputs(cfg, n, g)
            ad.eval_step(x, y, torch.ones(n))
        for k, fn in saved.items():
            setattr(dist, k, fn)
            setattr(dist.distributed_c10d, k, fn)
        with open(f"{out}/{name}.{rank}.json", "w") as f:
            json.dump(log, f)
        dist.barrier()
    dist.destroy_process_group()


def _prepare(logs: list[list[dict]], step_syncs: bool) -> tuple[list[list[dict]], list[list[str]]]:
    """Each rank's items (step ends kept or not) and the step each belongs to; each operation gets its place in its
    direction's order: the n-th send a->b meets the n-th receive at b from a."""
    items, where = [], []
    for log in logs:
        label, kept, at = "step 0", [], []
        for it in log:
            if "step_end" not in it or step_syncs:
                kept.append(json.loads(json.dumps(it)))
                at.append(label)
            if "step_end" in it:
                label = f"step {it['step_end'] + 1}" if it["step_end"] + 1 < STEPS else "drain/validation"
            elif "collective" in it:
                label = f"after {it['collective']}"
        items.append(kept)
        where.append(at)
    for log in items:
        count: dict = {}
        for it in log:
            for op in it.get("p2p", []):
                key = (op[0], op[1])
                op.append(count.get(key, 0))
                count[key] = count.get(key, 0) + 1
    return items, where


def replay(logs: list[list[dict]], step_syncs: bool) -> str | None:
    """Run the ranks' logs under NCCL's rule (module docstring); None when every rank finishes, else where they wait."""
    items, where = _prepare(logs, step_syncs)
    pos, done = [0] * len(items), [set() for _ in items]
    mismatch = []
    while True:
        current = [log[p] if p < len(log) else None for log, p in zip(items, pos)]
        if all(c is None for c in current):
            return "; ".join(mismatch) or None
        progress = False
        if all(c is not None and "p2p" not in c and c == current[0] for c in current):  # all at one sync point
            pos = [p + 1 for p in pos]
            continue
        for r, c in enumerate(current):
            if c is None or "p2p" not in c:
                continue
            for j, (kind, peer, tag, numel, n) in enumerate(c["p2p"]):
                if j in done[r] or current[peer] is None or "p2p" not in current[peer]:
                    continue
                want = "recv" if kind == "send" else "send"
                for k, (kind2, peer2, tag2, numel2, n2) in enumerate(current[peer]["p2p"]):
                    if k not in done[peer] and kind2 == want and peer2 == r and n2 == n:
                        if (tag, numel) != (tag2, numel2):
                            mismatch.append(f"rank {r} {kind} #{n} tag {tag} ({numel}) met tag {tag2} ({numel2})")
                        done[r].add(j)
                        done[peer].add(k)
                        progress = True
        for r, c in enumerate(current):
            if c is not None and "p2p" in c and len(done[r]) == len(c["p2p"]):
                pos[r], done[r], progress = pos[r] + 1, set(), True
        if not progress:
            return " | ".join(_waiting(r, log, p, where[r], done[r]) for r, (log, p) in enumerate(zip(items, pos)))


def _waiting(r: int, log: list, p: int, where: list, done: set) -> str:
    if p >= len(log):
        return f"rank {r}: finished"
    it = log[p]
    if "p2p" not in it:
        return f"rank {r} ({where[p]}): at {it.get('collective') or 'the end of step ' + str(it['step_end'])}"
    ops = [
        f"{k} {'->' if k == 'send' else '<-'}{peer} tag {tag} #{n}"
        for j, (k, peer, tag, _, n) in enumerate(it["p2p"])
        if j not in done
    ]
    return f"rank {r} ({where[p]}): {', '.join(ops)}"


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    import torch.multiprocessing as mp

    from ptbench.core.dist import free_port

    runs = {}
    for world in CASES:
        out = tmp_path_factory.mktemp(f"order{world}")
        mp.start_processes(_rank, args=(world, free_port(), str(out)), nprocs=world, start_method="spawn")
        for name, _ in CASES[world]:
            runs[(world, name)] = [json.loads((out / f"{name}.{r}.json").read_text()) for r in range(world)]
    return runs


@pytest.mark.parametrize("step_syncs", [False, True], ids=["no_syncs", "step_syncs"])
@pytest.mark.parametrize("world, name", [(w, n) for w, cases in CASES.items() for n, _ in cases])
def test_issue_order_cannot_cross_under_nccl(logs, world, name, step_syncs):
    stuck = replay(logs[(world, name)], step_syncs)
    assert stuck is None, f"{world} stages, {name}: the replay under NCCL's rule stops: {stuck}"


def test_the_replay_catches_a_crossing():
    """The rule itself: two ranks that each send before receiving hang; batched together, they do not."""
    cross = [
        [{"p2p": [["send", 1, 1, 4]]}, {"p2p": [["recv", 1, 2, 4]]}],
        [{"p2p": [["send", 0, 2, 4]]}, {"p2p": [["recv", 0, 1, 4]]}],
    ]
    assert "rank 0 (step 0): send ->1 tag 1 #0 | rank 1 (step 0): send ->0 tag 2 #0" == replay(cross, False)
    batched = [[{"p2p": [["send", 1, 1, 4], ["recv", 1, 2, 4]]}], [{"p2p": [["recv", 0, 1, 4], ["send", 0, 2, 4]]}]]
    assert replay(batched, False) is None
    pending = [[{"p2p": [["send", 1, 1, 4]]}, {"step_end": 0}], [{"step_end": 0}, {"p2p": [["recv", 0, 1, 4]]}]]
    assert replay(pending, False) is None and "at the end of step 0" in replay(pending, True)
