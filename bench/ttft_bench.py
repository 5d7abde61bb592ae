"""Time to first token in a real vLLM CPU engine: an mpcache hit against vLLM's own.

Three engines or more, each in a process of its own, all started afresh every round
(one at a time, in an order that rotates round by round) and then driven in turn, a
prompt at a time:

- ``vllm``: no connector, vLLM's prefix cache on (a hit stays in vLLM's own cache);
- ``mpcache``: ``MPCacheConnector`` against a fresh mpcache server, vLLM's prefix
  cache off (what a fresh engine, or one that evicted the prefix, gets);
- ``none``: no connector, no prefix cache (every pass prefills in full);
- ``mpcache-alt``, with ``--compare-server-args``: ``mpcache`` again, its server given
  those arguments (e.g. ``--copy-threads 1``): a server setting A/B, round by
  round;
- ``mpcache-floor``, with ``--floor``: ``mpcache`` whose loads copy nothing
  (``bench.floor_connector``: the retrieve call is answered at once, all loaded):
  its hit is the floor set by vLLM's asynchronous-load steps and the connector
  before a byte moves, and ``mpcache``'s hit over it is what the copy adds. Its
  outputs are wrong by design and are not compared;
- ``connector-null``, with ``--null``: vLLM given a connector that does nothing
  (``bench.null_connector``), its prefix cache off: its miss over ``none``'s is what
  vLLM's connector path costs with no mpcache in it. ``vllm``'s miss over ``none``'s
  (the same work: nothing is cached yet) says how far two engines doing the same
  work differ in a run.

After each round, each mpcache engine's server's mean store and retrieve call (``/metrics``,
from receipt to reply) is read: what the copies cost beside the engine. Around each
miss, every engine also reads the CPU time mpcache spends during it: every thread of
the round's mpcache servers, and the connector's own threads (``mpcache-...``) in
the engine's processes. ``mpcache``'s figure is what mpcache takes from the cores
its miss computes on; ``none``'s, the same servers idle, is its floor. (The
connector's calls on vLLM's own thread are bench/step_bench.py's figure.)

Every engine runs the same cases with the round's prompts (random token ids),
``--prompts`` times over with distinct prompts: each ``--lengths`` prompt three times
(a miss; a hit at once, which with mpcache waits for the miss's stores to reach the
server; a "later hit" after ``--later-s`` idle, what a request for a prefix stored a
while ago gets, e.g. after vLLM evicted it), and a multi-turn case: turn 1's prompt,
answered with ``--answer-tokens`` tokens, then turn 2 = turn 1's prompt, its answer
and ``--turn2-new`` new tokens. Timed passes ask for one token, so a ``generate``
call's wall time is its time to first token. An engine's TTFT for a case in a round
is the median over its prompts: one pass each varied by more than the differences
measured, so single passes gave run medians that did not come back on a rerun.

Engines take turns prompt by prompt (every engine runs prompt 1's cases, then every
engine prompt 2's, the order rotating), ``--gap-s`` idle before each turn so that
what the last engine left running has settled. That is mostly vLLM's own: after
its last step an engine's worker keeps polling vLLM's shared-memory message queue
for one second (``SpinCondition``'s busy loop in vLLM's ``shm_broadcast``), a whole
core of this 2-core machine, so a gap shorter than that (0.2 s before 2026-12-07)
had the next engine's miss and hit share the cores with it; 1.5 s also lets the
last mpcache server's stores land. The engines
compared in a round are timed within seconds of each other, not minutes apart, so
the machine's drift over a round (other guests of its host) falls on all of them.
Each engine's own passes follow each other as before, so a hit at once still comes
right after its miss. Every engine gets the same CPU threads (``VLLM_CPU_NUM_OF_RESERVED_CPU=0``:
vLLM-CPU otherwise reserves one more core for an engine with a connector).

Printed, per case: each engine's TTFT and the fewest tokens vLLM reports cached
(median (min-max) over the rounds), then the ``result:`` lines of ``FIGURES``: an
mpcache hit against a vLLM hit and a miss with the connector against one without,
each ratio taken within its round. Outputs of every pass are compared with the
``none`` engine's (greedy): any difference is printed.

    .venv/bin/python bench/ttft_bench.py [--rounds 5] [--lengths 2000,2048] [--floor]

Needs the e2e venv (``.venv-e2e``, ``scripts/bootstrap_e2e_venv.sh``). A round takes
about two minutes on a 2-core machine (three engine starts, five prompts of each case);
the engines of a round are alive together (each holds 512 MiB of KV cache, each
mpcache server a 1 GiB pool).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import process_cpu_ns, thread_cpu_ns
from bench.engine_process import EngineProcess

ROOT = Path(__file__).resolve().parent.parent
ENGINES = ("vllm", "mpcache", "none")
VOCAB_SIZE = 1000


# ---------------------------------------------------------------- engine side
# (run by the e2e venv's python: ``ttft_bench.py engine SPEC_FILE``)


def make_model(out_dir: str, spec: dict[str, Any]) -> None:
    """A random Llama, seeded: the engine shape the TTFT issue measured (also
    bench/step_bench.py's)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=spec["hidden"],
        intermediate_size=spec["hidden"] * 2,
        num_hidden_layers=spec["layers"],
        num_attention_heads=spec["hidden"] // 64,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=8192,
        initializer_range=0.2,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype=spec["dtype"],
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(getattr(torch, spec["dtype"]))
    model.save_pretrained(out_dir)


def engine_kwargs(spec: dict[str, Any], *, prefix_caching: bool) -> dict[str, Any]:
    """``vllm.LLM``'s arguments for the bench's engine (also bench/step_bench.py's)."""
    return {
        "model": spec["model"],
        "skip_tokenizer_init": True,
        "enforce_eager": True,
        "enable_prefix_caching": prefix_caching,
        "block_size": spec["block_size"],
        "kv_cache_memory_bytes": 512 << 20,
        "max_model_len": 8192,
        "max_num_seqs": 4,
        "dtype": spec["dtype"],
        "seed": 0,
        "distributed_executor_backend": spec["executor"],
    }


def _engine(spec: dict[str, Any]) -> None:
    """Start the engine, then run one prompt's cases per line read from stdin (its
    index) and answer each with their results, a JSON line on the original stdout;
    vLLM's own output (its worker's too) goes to stderr, the bench's log."""
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    from vllm import LLM, SamplingParams

    kind = spec["engine"]
    kwargs = engine_kwargs(spec, prefix_caching=kind == "vllm")
    if kind == "connector-null":
        kwargs["kv_transfer_config"] = {
            "kv_connector": "NullConnector",
            "kv_connector_module_path": "bench.null_connector",
            "kv_role": "kv_both",
        }
    if kind.startswith("mpcache"):
        floor = kind == "mpcache-floor"
        kwargs["kv_transfer_config"] = {
            "kv_connector": "FloorMPCacheConnector" if floor else "MPCacheConnector",
            "kv_connector_module_path": "bench.floor_connector" if floor else "connector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"mpcache.server_urls": spec["server_url"]},
        }
    llm = LLM(**kwargs)

    def mpcache_cpu_ns() -> int:
        """CPU spent so far by every mpcache server of the round and by the
        connector's threads in this engine's processes (the engine core's here, the
        worker's through vLLM's ``collective_rpc``)."""
        servers = sum(process_cpu_ns(pid) for pid in spec["server_pids"])
        return servers + _mpcache_threads_ns() + sum(llm.collective_rpc(_mpcache_threads_ns))

    def generate(prompt: list[int], max_tokens: int = 1, watch: bool = False) -> dict[str, Any]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        cpu = mpcache_cpu_ns() if watch else 0
        begin = time.perf_counter()
        (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        run = {
            "ms": (time.perf_counter() - begin) * 1e3,
            "cached": out.num_cached_tokens or 0,
            "tokens": list(out.outputs[0].token_ids),
        }
        if watch:
            run["mpcache cpu ms"] = (mpcache_cpu_ns() - cpu) / 1e6
        return run

    generate(spec["warmup"], 4)
    print("ready", file=replies)
    for line in sys.stdin:
        i = int(line)
        results: dict[str, dict[str, Any]] = {}
        for name, prompts in spec["prompts"].items():
            prompt = prompts[i]
            results[f"{name} miss"] = generate(prompt, watch=True)
            results[f"{name} hit"] = generate(prompt)
            time.sleep(spec["later_s"])
            results[f"{name} later hit"] = generate(prompt)
        turn1 = spec["turn1"][i]
        answer = generate(turn1, spec["answer_tokens"])["tokens"]
        results["multi-turn turn 2"] = generate(turn1 + answer + spec["turn2_new"][i])
        results["multi-turn turn 2"]["shared"] = len(turn1) + len(answer)
        print(json.dumps(results), file=replies)
    llm.llm_engine.engine_core.shutdown()


def _mpcache_threads_ns(_worker: object = None) -> int:
    """Nanoseconds the connector's threads in this process (named ``mpcache-...``:
    heartbeat loops, lookups, transfer lanes) have spent on a core. Also run in
    vLLM's worker (``collective_rpc`` hands it the worker, unused)."""
    pid = os.getpid()
    return sum(
        thread_cpu_ns(pid, thread.native_id)
        for thread in threading.enumerate()
        if thread.name.startswith("mpcache") and thread.native_id is not None
    )


# ---------------------------------------------------------------- bench side


def prepare_run(args: argparse.Namespace, prefix: str) -> tuple[Path, Path, dict[str, Any]]:
    """(the e2e venv's python, a fresh work folder holding the random model, the
    model's shape), once the machine's load is printed (also bench/step_bench.py's)."""
    from bench.common import load_line

    python: Path = args.e2e_venv / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"no e2e venv at {args.e2e_venv}: run scripts/bootstrap_e2e_venv.sh")
    work = Path(tempfile.mkdtemp(prefix=prefix))
    shape = {"layers": args.layers, "hidden": args.hidden, "dtype": args.dtype}
    subprocess.run(
        [str(python), __file__, "make-model", str(work / "model"), json.dumps(shape)],
        check=True,
        env=engine_env(),
        capture_output=True,
    )
    print(load_line())
    return python, work, shape


def _prompts(args: argparse.Namespace, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, VOCAB_SIZE) for _ in range(n)]

    repeats = range(args.prompts)
    return {
        # As long as the longest prompt: the first long prefill of an engine pays for
        # allocations and kernel set-up that later ones do not.
        "warmup": tokens(max(args.lengths)),
        "prompts": {f"{n} tokens": [tokens(n) for _ in repeats] for n in args.lengths},
        "turn1": [tokens(args.turn1_tokens) for _ in repeats],
        "turn2_new": [tokens(args.turn2_new) for _ in repeats],
        "answer_tokens": args.answer_tokens,
        "later_s": args.later_s,
    }


def engine_env() -> dict[str, str]:
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "HF_HUB_OFFLINE": "1",
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_HOST_IP": "127.0.0.1",
        # The engine core in the driver's process (the worker is another one with
        # the default executor): one vLLM import less per engine.
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        # The same OpenMP threads for every engine (module docstring).
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    }
    env.pop("VLLM_LOGGING_LEVEL", None)
    return env


def _server_call_ms(url: str) -> dict[str, float]:
    """The server's mean store and retrieve call so far, in ms (``/metrics``)."""
    import httpx

    from app.cli import metric_samples

    samples = metric_samples(httpx.get(f"{url}/metrics", timeout=10).text)
    means = {}
    for op in ("store", "retrieve"):
        count = samples.get(f"mpcache_cache_op_duration_seconds_count{{op={op}}}")
        if count:
            total = samples[f"mpcache_cache_op_duration_seconds_sum{{op={op}}}"]
            means[op] = total / count * 1e3
    return means


class _EngineProcess(EngineProcess):
    """One engine (``_engine``), driven a prompt at a time."""

    def __init__(self, python: Path, spec: dict[str, Any], log: Path) -> None:
        super().__init__(python, Path(__file__), spec, log, engine_env())
        self.runs: dict[str, list[dict[str, Any]]] = {}

    def run(self, prompt_index: int) -> None:
        """Time prompt ``prompt_index``'s cases; keep their results."""
        for case, run in self.ask(str(prompt_index), timeout_s=600).items():
            self.runs.setdefault(case, []).append(run)


def _round(
    python: Path,
    specs: dict[str, dict[str, Any]],
    servers: dict[str, list[str]],
    work: Path,
    index: int,
    gap_s: float,
) -> dict[str, dict[str, Any]]:
    """One round: every engine (and each mpcache engine's fresh server) started, one
    at a time, then each prompt's cases timed in every engine in turn, the order
    rotating prompt by prompt, ``gap_s`` idle before each engine's turn (what the
    last one left running, e.g. its server's stores, settles)."""
    from tests.support import server_process

    log = work / "engines.log"
    names = list(specs)
    with contextlib.ExitStack() as stack:
        urls: dict[str, str] = {}
        pids: list[int] = []
        for name in names:
            if name in servers:
                urls[name], proc = stack.enter_context(server_process(*servers[name]))
                pids.append(proc.pid)
        engines: list[_EngineProcess] = []
        for name in names:
            spec = {**specs[name], "server_pids": pids}
            if name in urls:
                spec["server_url"] = urls[name]
            engine = _EngineProcess(python, spec, log)
            stack.callback(engine.kill)
            engine.wait_ready()
            engines.append(engine)
        prompts = len(specs[names[0]]["turn1"])
        for i in range(prompts):
            turn = i % len(engines)
            for engine in engines[turn:] + engines[:turn]:
                time.sleep(gap_s)
                engine.run(i)
        results: dict[str, dict[str, Any]] = {}
        for engine in engines:
            engine.close()
            (work / f"r{index}-{engine.name}.json").write_text(json.dumps(engine.runs))
            results[engine.name] = {case: _case(runs) for case, runs in engine.runs.items()}
            if engine.name in urls:
                results[engine.name]["server calls"] = _server_call_ms(urls[engine.name])
    return results


def _case(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One engine's figures for one case in one round, from its ``--prompts`` runs:
    the median TTFT, the fewest tokens cached, every run's output."""
    cpu = [run["mpcache cpu ms"] for run in runs if "mpcache cpu ms" in run]
    return {
        "ms": statistics.median(run["ms"] for run in runs),
        "cpu ms": statistics.median(cpu) if cpu else None,
        "cached": min(run["cached"] for run in runs),
        "tokens": [run["tokens"] for run in runs],
        "shared": runs[0].get("shared"),
    }


FIGURES = (
    "mpcache 2000 tokens hit / vllm 2000 tokens hit",
    "mpcache 2000 tokens later hit / vllm 2000 tokens later hit",
    "mpcache 2048 tokens hit / vllm 2048 tokens hit",
    "mpcache multi-turn turn 2 / vllm multi-turn turn 2",
    "mpcache 2000 tokens miss / none 2000 tokens miss",
    "vllm 2000 tokens miss / none 2000 tokens miss",
    "connector-null 2000 tokens miss / none 2000 tokens miss",
    "mpcache 2000 tokens miss / connector-null 2000 tokens miss",
    "mpcache-floor 2000 tokens hit / vllm 2000 tokens hit",
    "mpcache-floor 2000 tokens later hit / vllm 2000 tokens later hit",
    "mpcache 2000 tokens hit / mpcache-floor 2000 tokens hit",
    "mpcache 2000 tokens later hit / mpcache-floor 2000 tokens later hit",
    "mpcache 2000 tokens hit / mpcache-alt 2000 tokens hit",
    "mpcache 2000 tokens later hit / mpcache-alt 2000 tokens later hit",
    "mpcache server store ms / mpcache-alt server store ms",
    "mpcache server retrieve ms / mpcache-alt server retrieve ms",
    "mpcache server store ms",
    "mpcache server retrieve ms",
    "mpcache 2000 tokens miss mpcache CPU ms",
    "none 2000 tokens miss mpcache CPU ms",
    "mpcache 2000 tokens hit cached tokens",
    "mpcache 2048 tokens hit cached tokens",
    "mpcache multi-turn turn 2 cached tokens",
    "vllm 2000 tokens hit",
    "mpcache 2000 tokens hit",
    "vllm 2000 tokens later hit",
    "mpcache 2000 tokens later hit",
    "mpcache-floor 2000 tokens hit",
)
"""What docs/benchmarks.md quotes (bench/common.py ``results``): ratios of TTFT within
each round, cached tokens, and TTFT in ms."""


def _report(
    rounds: list[dict[str, dict[str, Any]]], chunk_size: int, engines: tuple[str, ...]
) -> str:
    from bench.common import Rounds, results, summary

    table = Rounds()
    cases = list(rounds[0]["none"])
    for r in rounds:
        for engine in engines:
            for case in cases:
                table.add(f"{engine} {case}", r[engine][case]["ms"])
                table.add(f"{engine} {case} cached tokens", r[engine][case]["cached"])
                if r[engine][case]["cpu ms"] is not None:
                    table.add(f"{engine} {case} mpcache CPU ms", r[engine][case]["cpu ms"])
            for op, ms in r[engine].get("server calls", {}).items():
                table.add(f"{engine} server {op} ms", ms)
    head = f"{'case':<26}{'engine':<15}{'TTFT ms median (min-max)':>28}{'cached tokens':>24}"
    lines = [head]
    for case in cases:
        for engine in engines:
            ms = summary(table.values[f"{engine} {case}"], 0)
            cached = summary(table.values[f"{engine} {case} cached tokens"], 0)
            lines.append(f"{case:<26}{engine:<15}{ms:>28}{cached:>24}")
    mismatched = [
        (i, engine, case)
        for i, r in enumerate(rounds)
        for engine in engines
        if engine not in ("none", "mpcache-floor")  # the floor's KV is never loaded
        for case in cases
        if r[engine][case]["tokens"] != r["none"][case]["tokens"]
    ]
    shared = rounds[0]["none"]["multi-turn turn 2"]["shared"]
    lines.append(f"outputs differing from recompute (round, engine, case): {mismatched or 'none'}")
    lines.append(f"(chunk size {chunk_size}; multi-turn: turn 2 shares {shared} tokens)")
    lines.append("targets: hit / vllm hit <= 1.5 (2000 tokens); miss / none miss <= 1.03")
    lines.append(results(FIGURES, table))
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "make-model":
        make_model(sys.argv[2], json.loads(sys.argv[3]))
        return
    if len(sys.argv) == 3 and sys.argv[1] == "engine":
        _engine(json.loads(Path(sys.argv[2]).read_text()))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--lengths", default="2000,2048", help="prompt lengths, comma-separated")
    parser.add_argument(
        "--prompts",
        type=int,
        default=5,
        help="distinct prompts of each case an engine times in a round (their median counts)",
    )
    parser.add_argument("--turn1-tokens", type=int, default=1500)
    parser.add_argument("--answer-tokens", type=int, default=40)
    parser.add_argument("--turn2-new", type=int, default=200)
    parser.add_argument(
        "--later-s", type=float, default=0.5, help="idle seconds before the later hit"
    )
    parser.add_argument(
        "--gap-s",
        type=float,
        default=1.5,
        help="idle seconds before each engine's turn (longer than vLLM's 1 s of polling)",
    )
    parser.add_argument("--chunk-size", type=int, default=256, help="the server's --chunk-size")
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--executor", default="mp", help="vLLM's distributed_executor_backend")
    parser.add_argument("--e2e-venv", type=Path, default=ROOT / ".venv-e2e")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (logs)")
    parser.add_argument(
        "--compare-server-args",
        default="",
        metavar="ARGS",
        help="also run the engine mpcache-alt each round, its server given ARGS",
    )
    parser.add_argument(
        "--floor",
        action="store_true",
        help="also run the engine mpcache-floor each round: loads that copy nothing",
    )
    parser.add_argument(
        "--null",
        action="store_true",
        help="also run the engine connector-null each round: a connector that does nothing",
    )
    args = parser.parse_args()
    args.lengths = [int(n) for n in args.lengths.split(",")]
    if args.rounds < 5:
        print(f"note: {args.rounds} rounds; figures want at least 5", file=sys.stderr)

    sys.path.insert(0, str(ROOT))
    python, work, shape = prepare_run(args, "mpcache-ttft-")
    print(
        f"model: random Llama, {args.layers} layers, hidden {args.hidden}, 4 KV heads of 64, "
        f"{args.dtype}, block {args.block_size}; server --chunk-size {args.chunk_size}"
    )
    engines = ENGINES + (("mpcache-alt",) if args.compare_server_args else ())
    engines += ("mpcache-floor",) if args.floor else ()
    engines += ("connector-null",) if args.null else ()
    server_args = ["--chunk-size", str(args.chunk_size), "--pool-size", "1GiB"]
    servers = {name: server_args for name in engines if name.startswith("mpcache")}
    if args.compare_server_args:
        servers["mpcache-alt"] = server_args + args.compare_server_args.split()
    rounds: list[dict[str, dict[str, Any]]] = []
    for index in range(args.rounds):
        prompts = _prompts(args, seed=index)
        turn = index % len(engines)
        order = engines[turn:] + engines[:turn]  # which starts first, and waits longest
        specs = {
            name: {
                **prompts,
                **shape,
                "engine": name,
                "model": str(work / "model"),
                "block_size": args.block_size,
                "executor": args.executor,
            }
            for name in order
        }
        results = _round(python, specs, servers, work, index, args.gap_s)
        rounds.append(results)
        hit = results["mpcache"][f"{args.lengths[0]} tokens hit"]
        later = results["mpcache"][f"{args.lengths[0]} tokens later hit"]
        print(
            f"round {index + 1}: {args.lengths[0]}-token mpcache hit {hit['ms']:.0f} ms "
            f"(later hit {later['ms']:.0f} ms), {hit['cached']} tokens cached",
            flush=True,
        )
    print(_report(rounds, args.chunk_size, engines))
    if args.keep:
        print(f"work folder: {work}")


if __name__ == "__main__":
    main()
