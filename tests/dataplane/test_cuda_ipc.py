"""CUDA IPC descriptors (see Note [mpcache CUDA IPC invariants] in contract/cuda_ipc.py).

The round trip needs a GPU and carries the ``cuda`` marker; the rest runs anywhere.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from contract.cuda_ipc import normalise_uuid
from contract.errors import InvalidDescriptor
from contract.schemas import CudaIpcTensor
from dataplane.cuda_ipc import rebuild
from dataplane.descriptors import tensor_geometry
from tests.support import ROOT

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _descriptor(**overrides: object) -> CudaIpcTensor:
    fields: dict[str, object] = {
        "device_uuid": "GPU-00000000-0000-0000-0000-000000000000",
        "handle_b64": "AAAA",
        "storage_size_bytes": 4096,
        "storage_offset_bytes": 0,
        "ref_counter_handle_b64": "AAAA",
        "ref_counter_offset": 0,
        "event_handle_b64": "AAAA",
        "event_sync_required": False,
        "tensor_offset": 0,
        "shape": [4, 16, 8],
        "stride": [128, 8, 1],
        "dtype": "bfloat16",
        "block_dim": 0,
    }
    fields.update(overrides)
    return CudaIpcTensor.model_validate(fields)


def test_uuid_spellings_agree() -> None:
    assert normalise_uuid("GPU-58A4D4B5-aa") == normalise_uuid("58a4d4b5-AA") == "58a4d4b5-aa"


def test_view_past_the_storage_is_refused_before_any_cuda_call() -> None:
    desc = _descriptor(storage_size_bytes=1000)
    with pytest.raises(InvalidDescriptor) as info:
        rebuild(desc, tensor_geometry(desc))
    assert info.value.extras["reason"] == "out-of-bounds"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU refusal")
def test_without_cuda_a_cuda_descriptor_is_refused() -> None:
    desc = _descriptor()
    with pytest.raises(InvalidDescriptor) as info:
        rebuild(desc, tensor_geometry(desc))
    assert info.value.extras["reason"] == "no-cuda"


PRODUCER = textwrap.dedent(
    """
    import sys, time, torch
    from contract.cuda_ipc import describe
    kv = torch.arange(2 * 8 * 16 * 4, dtype=torch.float32, device="cuda").view(2, 8, 16, 4)
    kv = kv.to(torch.bfloat16)
    torch.cuda.synchronize()
    print(describe(kv, block_dim=1).model_dump_json(), flush=True)
    sys.stdin.readline()  # keep the tensor alive until the consumer is done
    torch.cuda.synchronize()
    print(float(kv[1, 5].float().sum()), flush=True)
    """
)


@pytest.mark.cuda
@needs_cuda
def test_rebuild_a_tensor_shared_by_another_process() -> None:
    producer = subprocess.Popen(
        [sys.executable, "-c", PRODUCER],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert producer.stdout is not None and producer.stdin is not None
        desc = CudaIpcTensor.model_validate_json(producer.stdout.readline())
        tensor = rebuild(desc, tensor_geometry(desc))
        assert tensor.shape == (2, 8, 16, 4) and tensor.is_cuda
        expected = torch.arange(2 * 8 * 16 * 4, dtype=torch.float32).view(2, 8, 16, 4)
        assert torch.equal(tensor.float().cpu(), expected.bfloat16().float())
        tensor[1, 5].fill_(1.0)  # the producer sees the write
        torch.cuda.synchronize()
        del tensor
        producer.stdin.write("\n")
        producer.stdin.flush()
        assert float(producer.stdout.readline()) == 16 * 4
    finally:
        producer.kill()
        producer.wait(timeout=30)
