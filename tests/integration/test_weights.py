import pytest
import torch

from trl_async.demo.tiny import build_char_tokenizer, build_tiny_model
from trl_async.weights.shared_memory import SharedMemoryWeights, weights_digest


def test_publish_then_pull_copies_exactly_and_only_when_newer():
    ctx = torch.multiprocessing.get_context("spawn")
    tok = build_char_tokenizer()
    trainer_model, worker_model = build_tiny_model(tok, seed=0), build_tiny_model(tok, seed=1)
    named = dict(trainer_model.named_parameters())
    shared = SharedMemoryWeights({n: (tuple(p.shape), p.dtype) for n, p in named.items()}, ctx)
    params = dict(worker_model.named_parameters())
    assert shared.pull_into(params, have_version=-1) is None  # nothing published yet

    items = list(named.items())
    shared.publish([items[:3], items[3:]], version=0)  # two buckets
    assert shared.pull_into(params, have_version=-1) == 0
    assert weights_digest(worker_model.named_parameters()) == weights_digest(trainer_model.named_parameters())
    assert shared.pull_into(params, have_version=0) is None

    with torch.no_grad():
        for p in trainer_model.parameters():
            p.add_(0.01)
    assert weights_digest(worker_model.named_parameters()) != weights_digest(trainer_model.named_parameters())
    shared.publish([list(trainer_model.named_parameters())], version=1)
    assert shared.pull_into(params, have_version=0) == 1
    for name, p in trainer_model.named_parameters():
        assert torch.equal(params[name], p), name


def test_publish_refuses_an_incomplete_set():
    ctx = torch.multiprocessing.get_context("spawn")
    model = build_tiny_model(build_char_tokenizer())
    shared = SharedMemoryWeights({n: (tuple(p.shape), p.dtype) for n, p in model.named_parameters()}, ctx)
    partial = list(model.named_parameters())[:-1]
    try:
        shared.publish([partial], version=0)
    except RuntimeError as exc:
        assert "missing" in str(exc)
    else:
        raise AssertionError("an incomplete publish must fail")
    assert shared.version == -1  # and the version did not advance


def test_a_pull_overtaken_by_two_publishes_retries_and_never_mixes_versions():
    ctx = torch.multiprocessing.get_context("spawn")
    specs = {"a": ((3,), torch.float32), "b": ((3,), torch.float32)}
    shared = SharedMemoryWeights(specs, ctx)

    def publish(value, version):
        shared.publish([[("a", torch.full((3,), value)), ("b", torch.full((3,), value))]], version)

    publish(1.0, 1)
    target = {"a": torch.zeros(3), "b": torch.zeros(3)}

    class Interrupting(dict):  # the trainer publishes twice while the worker is half-way through its copy
        fired = False

        def __getitem__(self, name):
            if name == "b" and not self.fired:
                self.fired = True
                publish(2.0, 2)
                publish(3.0, 3)  # lands in the buffer being read
            return super().__getitem__(name)

    params = Interrupting(target)
    assert shared.pull_into(params, have_version=0) == 3  # retried after detecting the overwrite
    assert torch.equal(target["a"], torch.full((3,), 3.0)) and torch.equal(target["b"], torch.full((3,), 3.0))
    # the trainer never waited: both publishes completed while the pull was in progress


def test_a_pull_descheduled_between_reading_the_version_and_the_counter_never_mislabels_a_set():
    """The version must be read inside the seqlock window (after the counter): a worker that read version 1, was
    descheduled across two publishes into the same buffer, then read the (even) counter would copy version 3's
    tensors and call them version 1."""
    ctx = torch.multiprocessing.get_context("spawn")
    shared = SharedMemoryWeights({"a": ((3,), torch.float32)}, ctx)

    def publish(value, version):
        shared.publish([[("a", torch.full((3,), value))]], version)

    publish(1.0, 1)  # buffer 1 is the newest

    class Deschedule:  # the versions array, as a worker sees it: two publishes happen right after its first read
        def __init__(self, array):
            self.array, self.fired = array, False

        def __getitem__(self, i):
            value = self.array[i]
            if not self.fired:
                self.fired = True
                publish(2.0, 2)  # buffer 0
                publish(3.0, 3)  # buffer 1 again: the one being read
            return value

        def __setitem__(self, i, value):
            self.array[i] = value

    shared._versions = Deschedule(shared._versions)
    target = {"a": torch.zeros(3)}
    version = shared.pull_into(target, have_version=0)
    assert torch.equal(target["a"], torch.full((3,), float(version)))  # the tensors are the version it reports


def _pull_and_report(shared, out):
    params = {name: torch.zeros_like(t) for name, t in shared.tensors.items()}
    out.send((shared.pull_into(params, have_version=-1), {name: float(t.sum()) for name, t in params.items()}))


def test_a_model_of_many_tensors_reaches_a_forkserver_worker():
    """Workers start from a forkserver, which passes a child at most ~250 file descriptors; a policy has hundreds of
    tensors (SmolLM2-135M: 272, twice over for the double buffer). The weights must cross in a few descriptors."""
    from trl_async.engines.transformers.worker_process import worker_context

    ctx = worker_context()
    specs = {f"t{i}": ((2, 3), torch.float32 if i % 3 else torch.bfloat16) for i in range(300)}
    shared = SharedMemoryWeights(specs, ctx)
    shared.publish([[(name, torch.full(shape, float(i % 50), dtype=dtype)) for i, (name, (shape, dtype)) in
                     enumerate(specs.items())]], version=4)  # fmt: skip
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_pull_and_report, args=(shared, send))
    child.start()
    version, sums = receive.recv()
    child.join(30)
    assert version == 4 and sums == {f"t{i}": 6.0 * (i % 50) for i in range(300)}  # exact in bf16


@pytest.mark.unit
def test_a_zero3_shard_off_the_compute_device_or_swapped_out_is_not_sent_as_it_is():
    """ZeRO-3's fast sync sends each rank's shard (``p.ds_tensor``) as it is; an offloaded shard (on another device
    than the parameter computes on) or one swapped out to NVMe (empty, status NOT_AVAILABLE) must take DeepSpeed's
    own gather instead."""
    import enum

    from trl_async.weights.policy import shard_resident

    Status = enum.Enum("PartitionedParamStatus", ["AVAILABLE", "NOT_AVAILABLE", "INFLIGHT"])

    def param(shard):
        p = torch.nn.Parameter(torch.empty(0))  # as ZeRO-3 leaves it: empty, on the compute device
        if shard is not None:
            p.ds_tensor = shard
        return p

    resident = torch.zeros(4)
    resident.status = Status.AVAILABLE
    swapped = torch.empty(0)
    swapped.status = Status.NOT_AVAILABLE
    in_flight = torch.zeros(4)
    in_flight.status = Status.INFLIGHT
    assert shard_resident(param(resident)) and shard_resident(param(torch.zeros(4)))
    assert not shard_resident(param(torch.zeros(4, device="meta")))  # another device than the parameter's
    assert not shard_resident(param(swapped)) and not shard_resident(param(in_flight))
    assert not shard_resident(param(None))  # not a ZeRO-3 parameter
