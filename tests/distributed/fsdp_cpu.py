"""FSDP on CPU ranks, for the tests only.

accelerate (1.16) turns FSDP on only for accelerator devices: in ``AcceleratorState.__init__`` the FSDP branch sits
inside the branch for multi-GPU-like device types, so on CPU ranks (``MULTI_CPU``, gloo) the FSDP plugin is dropped
without a word and the run trains as plain data parallel. torch's own FSDP2 (``fully_shard``) runs on CPU over gloo,
and so does accelerate's FSDP2 preparation once the state says FSDP; this patch says it, after accelerate's own
set-up, where the launch asked for FSDP. Nothing in the library depends on it: on GPUs accelerate needs no patch.
"""

from __future__ import annotations


def let_fsdp_run_on_cpu() -> None:
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    original = AcceleratorState.__init__

    def init(self, *args, fsdp_plugin=None, **kwargs):
        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP

    AcceleratorState.__init__ = init
