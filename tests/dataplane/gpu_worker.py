"""A stand-in vLLM worker with its KV cache on a GPU, for the ``cuda`` tests.

Run as ``python -m tests.dataplane.gpu_worker`` by tests/dataplane/test_gpu_path.py:
it prints its layers' ``cuda_ipc`` descriptors as one JSON line, then answers one
line per command on stdin:

- ``write FIRST N SEED``: on its own stream ("vLLM's"), a long GPU sleep and then
  blocks ``FIRST .. FIRST+N-1`` of every layer filled with random values (from
  ``SEED``); nothing waits for them. Answers the event handle to send with the next
  call (``connector.device_order``), ``none`` when there is none;
- ``event``: the handle for a call that writes nothing first;
- ``same A B N``: once every write is done, ``ok`` if blocks ``A ..`` and ``B ..``
  of every layer hold the same bytes, else ``bad``;
- ``check FIRST N VALUE``: ``ok`` if those blocks of every layer hold ``VALUE``
  (the initial 1.0: untouched), else ``bad`` and what they hold.
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import torch

from connector.device_order import DeviceOrder
from contract.cuda_ipc import describe

NUM_BLOCKS = 40
BLOCK_SIZE = 16
LAYERS = ("model.layers.0.attn", "model.layers.1.attn")
SLEEP_CYCLES = 200_000_000
"""A GPU busy-wait before each write, so a copy not ordered after it would read the
old bytes (some 0.1 s at 2 GHz)."""


def main() -> None:
    device = torch.device("cuda", 0)
    kv = {
        name: torch.ones(2, NUM_BLOCKS, BLOCK_SIZE, 2, 32, dtype=torch.bfloat16, device=device)
        for name in LAYERS
    }
    torch.cuda.synchronize()
    layers = [
        {"name": name, "group_id": 0, "tensors": [describe(t, 1).model_dump()]}
        for name, t in kv.items()
    ]
    print(json.dumps(layers), flush=True)
    vllm_stream = torch.cuda.Stream(device)
    order = DeviceOrder(SimpleNamespace(cuda_device=device))
    for line in sys.stdin:
        op, *args = line.split()
        with torch.cuda.stream(vllm_stream):
            if op == "write":
                first, n, seed = int(args[0]), int(args[1]), int(args[2])
                generator = torch.Generator(device).manual_seed(seed)
                torch.cuda._sleep(SLEEP_CYCLES)
                for t in kv.values():
                    fresh = torch.randn(
                        t[:, first : first + n].shape, generator=generator, device=device
                    )
                    t[:, first : first + n].copy_(fresh)
                print(order.handle() or "none", flush=True)
            elif op == "same":
                a, b, n = int(args[0]), int(args[1]), int(args[2])
                torch.cuda.synchronize()
                same = all(
                    torch.equal(
                        t[:, a : a + n].view(torch.int16), t[:, b : b + n].view(torch.int16)
                    )
                    for t in kv.values()
                )
                print("ok" if same else "bad", flush=True)
            elif op == "event":
                print(order.handle() or "none", flush=True)
            elif op == "check":
                first, n, value = int(args[0]), int(args[1]), float(args[2])
                torch.cuda.synchronize()
                held = {float(x) for t in kv.values() for x in t[:, first : first + n].unique()}
                print("ok" if held == {value} else f"bad {sorted(held)}", flush=True)


if __name__ == "__main__":
    main()
