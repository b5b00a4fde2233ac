"""Data-parallel fasttorch on ``torch.distributed`` (gloo on CPU, NCCL on GPU).

``setup()`` joins the group torchrun describes, ``replicate(state)`` makes every rank
start from rank 0's tensors with its own RNG, and ``sync_on_last(step)`` reduces the
gradients of each accumulation window across ranks, overlapping backward. A state whose
module FSDP2 sharded (``torch.distributed.fsdp.fully_shard``) trains with the same
``sync_on_last``, and so does one parallelized over a 2-D mesh, tensor parallel and
FSDP2 (``parallelize(model, mesh, plan)``). See docs/distributed.md and
docs/tensor_parallel.md.
"""

from fasttorch.distributed.reducer import DistributedStepError
from fasttorch.distributed.setup import backend_for, replicate, setup
from fasttorch.distributed.sync_on_last import sync_on_last
from fasttorch.distributed.tensor_parallel import parallelize

__all__ = [
    "DistributedStepError",
    "backend_for",
    "parallelize",
    "replicate",
    "setup",
    "sync_on_last",
]
