"""How long vLLM's engine step waits on the connector, in a real vLLM CPU engine.

Two engines a round (three with ``--compare-server-args``), each in a process of
its own, started afresh every round in an order that rotates round by round and
alive together for the round (``bench.engine_process``), with
bench/ttft_bench.py's model and settings (a random Llama of 8 layers, block 32,
2000-token prompts, the same OpenMP threads for all: ``VLLM_CPU_NUM_OF_RESERVED_CPU=0``):

- ``mpcache``: the connector against a fresh mpcache server (chunk 256), vLLM's
  prefix cache off, loaded as ``bench.timed_connector.TimedMPCacheConnector``: the
  shipped ``MPCacheConnector`` with every worker-side call vLLM makes on its step
  timed (that module lists them and says what a step is);
- ``vllm``: no connector, vLLM's prefix cache on;
- ``mpcache-alt``, with ``--compare-server-args ARGS``: ``mpcache`` again, its
  server given ARGS, so that a server setting's effect on R's decode is compared
  round by round (its per-step records are kept apart: the per-step figures are
  ``mpcache``'s).

Both run the same work, after a warm-up prompt, taking turns (1.5 s idle before
each turn: a vLLM worker polls for 1 s after its last step):

1. **Passes**: ``--requests`` prompts one at a time, then each again (4 tokens a
   pass): a first pass stores its 7 chunks (14.7 MB), a second one loads them.
   Every engine runs its passes, then every engine its first decode phase.
2. **Decode**, in two phases per engine, the second in the reverse order of the
   first (A B B A: a drift of the machine over the round weighs on both engines
   alike, where one engine run after another put minutes between them), each
   phase with a new R and new "new" prompts. The bench steps the engine itself
   (``LLMEngine.step``): request R
   (a ``--r-prompt``-token prompt, ``--r-tokens`` tokens) decodes, and from its 8th
   token on, every 8 of its tokens, one more request arrives (4 tokens each),
   alternately a passes' prompt (cached: in the mpcache engine it loads) and a new
   one (it stores). Stepping the engine, rather than reading request output
   timestamps, ties the arrivals to R's progress, so both engines see the same
   batches; the clock is read as each ``step()`` returns, when R's token exists
   for a caller. R's **time per token** is the wall time from its token when the
   first other arrived to its first token after the last other finished, over
   the tokens between. **Outside prefills** leaves out the steps in which a new
   prompt prefilled (its first token came with R's): that compute is the same in
   both engines and tens of times a decode step on this CPU, so it would bury the
   loads and any copy running beside later steps; a store made inside that step
   is left out with it, and is what the per-step connector time shows. An
   engine's figure in a round is the mean of its two phases'.

   The baseline is the ``vllm`` engine, run the same round: its prefix cache holds
   the cached prompts, so it does the same compute as the mpcache engine (a cached
   prompt computes only its last block, 1984 of 2000 tokens cached either way; a
   new one prefills in full) but neither loads nor stores. An engine without any
   cache would recompute the cached prompts and hide a slow load behind a longer
   prefill. The ratio catches waits wherever they are, the scheduler side included.

The mpcache engine's worker writes one record per step: the time summed over the
step's connector calls. Printed, round by round: R's time per token in each engine
and the ratio (and each phase's), each engine's longest gap between two of R's
tokens, and the round's worst connector time per step. Then the per-step sums
over every step after the warm-up (the passes and both decode phases): median,
p90 (nearest rank) and max over the steps whose plan loads, those whose plan
stores, and all steps, each taken within its round; which calls the time went
to; the greedy outputs compared between the engines (R's own only as far as they
agree: its batches differ by a step once a load holds a request back, and vLLM on
CPU is not batch-invariant); then the ``result:`` lines of ``FIGURES`` (median
(min-max) over the rounds).

Each round line also gives the host's steal during each engine's decode phases
(``/proc/stat``, both CPUs): time this virtual machine's CPUs were held by the hypervisor.
``--host-stalls`` tells the connector's own time from the host's: the mpcache
engines' workers also read their thread's CPU time and context switches around each
call (``bench.timed_connector.host_stall_ms``), and the report adds each step's time
with those stalls taken out, and how many steps past 2 ms are within it then. The
reads cost vLLM's thread about 0.2 ms a step outside the timed calls, so R's ratio
from such a run is not the plain run's.

Targets (issue 22): per step p90 <= 0.5 ms and max <= 2 ms; R's time per token
with the connector <= 1.1x the baseline's.

    .venv/bin/python bench/step_bench.py [--rounds 5] [--host-stalls]
    .venv/bin/python bench/step_bench.py --rounds 1 --quick   # a smoke run

Needs the e2e venv (``.venv-e2e``). A round runs 20 prefills of 2000 tokens and
two engine starts; ``--quick`` runs 8. With ``--keep``, the work folder keeps each
round's results (``rN.json``: R's clock token by token in every phase, by the wall
clock of the worker's step records, ``rN-mpcache-steps.jsonl``).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.engine_process import EngineProcess
from bench.ttft_bench import VOCAB_SIZE, engine_env, engine_kwargs, make_model, prepare_run

ROOT = Path(__file__).resolve().parent.parent
ENGINES = ("mpcache", "vllm")
ALT = "mpcache-alt"
OTHER_TOKENS = 4
ARRIVAL_EVERY = 8  # R's tokens between two arrivals (the first at this many)
RECORDS_ENV = "MPCACHE_STEP_RECORDS"  # bench.timed_connector.RECORDS_ENV (imports vLLM)
CPU_ENV = "MPCACHE_STEP_CPU"  # bench.timed_connector.CPU_ENV
MAX_STEP_MS = 2.0  # issue 22's bound on a step's connector time
PHASES = 2  # R's decode phases per engine and round (A B B A)
GAP_S = 1.5  # idle before each engine's turn: longer than vLLM's 1 s of polling after a step


# ---------------------------------------------------------------- engine side
# (run by the e2e venv's python: ``step_bench.py engine SPEC_FILE``)


def _mark(spec: dict[str, Any], label: str) -> None:
    """A line in the worker's step records: the steps after it are the label's."""
    if spec.get("records"):
        with open(spec["records"], "a") as out:
            out.write(json.dumps({"mark": label}) + "\n")


def _decode(engine: Any, spec: dict[str, Any], params: Any) -> dict[str, Any]:
    """Step the engine: R decodes while the others arrive (module docstring, 2)."""
    engine.add_request("R", {"prompt_token_ids": spec["r_prompt"]}, params(spec["r_tokens"]))
    pending = list(spec["others"])
    tokens: dict[str, list[int]] = {}
    # R's tokens: (clock, R's tokens so far, whether a new prompt prefilled in the
    # step, the wall clock: the worker's step records' ``t``)
    r_times: list[tuple[float, int, bool, float]] = []
    finished: dict[str, float] = {}
    started: tuple[float, int] | None = None
    for _ in range(100_000):  # bounded; ends when every request has finished
        if not engine.has_unfinished_requests():
            break
        outputs = engine.step()
        now, wall = time.perf_counter(), time.time()
        prefilled = False
        for out in outputs:
            name = out.request_id.split("-")[0]
            ids = list(out.outputs[0].token_ids)
            prefilled |= name.startswith("new") and not tokens.get(name)
            if name == "R" and len(ids) > len(tokens.get("R", ())):
                r_times.append((now, len(ids), False, wall))
            tokens[name] = ids
            if out.finished:
                finished[name] = now
        if prefilled and r_times and r_times[-1][0] == now:
            r_times[-1] = (now, r_times[-1][1], True, wall)
        produced = len(tokens.get("R", ()))
        arrived = len(spec["others"]) - len(pending)
        if pending and produced >= ARRIVAL_EVERY * (arrived + 1):
            if started is None:
                started = (now, produced)
            name, prompt = pending.pop(0)
            engine.add_request(name, {"prompt_token_ids": prompt}, params(OTHER_TOKENS))
    assert started is not None and not pending, "R finished before every request arrived"
    others_done = max(finished[name] for name, _ in spec["others"])
    after = [(t, n) for t, n, _, _ in r_times if t >= others_done]
    end = after[0] if after else r_times[-1][:2]
    window = [r for r in r_times if started[0] <= r[0] <= end[0]]
    gaps = [(b[0] - a[0], b[1] - a[1], b[2]) for a, b in itertools.pairwise(window)]
    # Kept in the round's results file (``--keep``): where in the window R slowed,
    # against the worker's step records by their wall clock.
    clock = [(wall, n, prefill) for _, n, prefill, wall in window]
    outside_s = sum(s for s, _, prefill in gaps if not prefill)
    outside_tokens = sum(n for _, n, prefill in gaps if not prefill)
    alone = after[-1][1] - after[0][1] if after else 0
    return {
        "ms_per_token": (end[0] - started[0]) * 1e3 / (end[1] - started[1]),
        "ms_per_token_outside_prefills": outside_s * 1e3 / outside_tokens,
        "tokens": end[1] - started[1],
        "prefill_steps": sum(prefill for _, _, prefill in gaps),
        "max_gap_ms": max(s for s, _, _ in gaps) * 1e3,
        "alone_ms_per_token": (after[-1][0] - after[0][0]) * 1e3 / alone if alone else math.nan,
        "outlived": bool(after),
        "clock": clock,
        "outputs": tokens,
    }


def _engine(spec: dict[str, Any]) -> None:
    """Start the engine and warm it up, answer ``ready``, then run each command read
    from stdin, ``passes`` or ``decode K`` (phase K of R's decode), and answer it
    with its results, a JSON line on the original stdout; vLLM's own output (its
    worker's too) goes to stderr, the bench's log."""
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    from vllm import LLM, SamplingParams

    kind = spec["engine"]
    kwargs = engine_kwargs(spec, prefix_caching=kind == "vllm")
    if kind.startswith("mpcache"):
        kwargs["kv_transfer_config"] = {
            "kv_connector": "TimedMPCacheConnector",
            "kv_connector_module_path": "bench.timed_connector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"mpcache.server_urls": spec["server_url"]},
        }
    llm = LLM(**kwargs)

    def params(max_tokens: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    def generate(prompt: list[int], max_tokens: int = OTHER_TOKENS) -> list[int]:
        (out,) = llm.generate([{"prompt_token_ids": prompt}], params(max_tokens), use_tqdm=False)
        return list(out.outputs[0].token_ids)

    generate(spec["warmup"])
    _mark(spec, "measured")
    print("ready", file=replies)
    for line in sys.stdin:
        command = line.split()
        answer: dict[str, Any]
        if command == ["passes"]:
            answer = {}
            for i, prompt in enumerate(spec["passes"]):
                answer[f"pass {i} first"] = generate(prompt)
            for i, prompt in enumerate(spec["passes"]):
                answer[f"pass {i} second"] = generate(prompt)
        else:
            phase = {**spec["decodes"][int(command[1])], "r_tokens": spec["r_tokens"]}
            answer = _decode(llm.llm_engine, phase, params)
        print(json.dumps(answer), file=replies)
    _mark(spec, "end")
    llm.llm_engine.engine_core.shutdown()


# ---------------------------------------------------------------- bench side


def _prompts(args: argparse.Namespace, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, VOCAB_SIZE) for _ in range(n)]

    passes = [tokens(args.prompt_tokens) for _ in range(args.requests)]

    def phase() -> dict[str, Any]:
        # The cached arrivals are the passes' prompts: held by the server (mpcache)
        # or by vLLM's prefix cache (vllm) since the passes; the new ones are new
        # to every phase, and so is R's prompt.
        others = [
            (f"cached{i // 2}", passes[i // 2]) if i % 2 == 0 else (f"new{i // 2}", tokens(n))
            for i, n in enumerate([args.prompt_tokens] * args.others)
        ]
        return {"others": others, "r_prompt": tokens(args.r_prompt)}

    return {
        "warmup": tokens(args.prompt_tokens),
        "passes": passes,
        "decodes": [phase() for _ in range(PHASES)],
        "r_tokens": args.r_tokens,
    }


def _round(
    python: Path,
    specs: dict[str, dict[str, Any]],
    servers: dict[str, list[str]],
    work: Path,
) -> dict[str, Any]:
    """One round: every engine (each mpcache one with a fresh server) started in
    ``specs``' order and alive together; each engine's passes in that order; then
    the decode phases, first in that order and then in the reverse (A B B A), so
    that a drift of the machine over the round falls on every engine alike."""
    from tests.support import server_process

    log = work / "engines.log"
    order = list(specs)
    results: dict[str, Any] = {name: {"phases": []} for name in order}
    with contextlib.ExitStack() as stack:
        engines: dict[str, EngineProcess] = {}
        for name in order:
            spec, env = specs[name], engine_env()
            if name in servers:
                url, _ = stack.enter_context(server_process(*servers[name]))
                spec = {**spec, "server_url": url}
                env[RECORDS_ENV] = spec["records"]
                if spec["host_stalls"]:
                    env[CPU_ENV] = "1"
            engine = EngineProcess(python, Path(__file__), spec, log, env)
            stack.callback(engine.kill)
            engine.wait_ready()
            engines[name] = engine
        for name in order:
            time.sleep(GAP_S)
            results[name]["outputs"] = engines[name].ask("passes")
        for position, name in enumerate(order + order[::-1]):
            phase = position // len(order)
            time.sleep(GAP_S)
            before = host_steal_ms()
            decode = engines[name].ask(f"decode {phase}")
            after = host_steal_ms()
            if before is not None and after is not None:
                steal = results[name].get("host_steal_ms", 0.0)
                results[name]["host_steal_ms"] = steal + after - before
            outputs = decode.pop("outputs")
            results[name]["outputs"].update({f"decode{phase} {k}": v for k, v in outputs.items()})
            results[name]["phases"].append(decode)
        for engine in engines.values():
            engine.close()
    for name in order:
        results[name]["decode"] = merged(results[name].pop("phases"))
    results["steps"] = _steps(Path(specs["mpcache"]["records"]))
    return results


def merged(phases: list[dict[str, Any]]) -> dict[str, Any]:
    """An engine's decode figures over its phases (``_decode``'s, one per phase): the
    time per token is their mean, so the A B B A order weighs each engine's phases
    around the same middle of the round."""
    alone = [p["alone_ms_per_token"] for p in phases if not math.isnan(p["alone_ms_per_token"])]
    return {
        "ms_per_token": statistics.fmean(p["ms_per_token"] for p in phases),
        "ms_per_token_outside_prefills": statistics.fmean(
            p["ms_per_token_outside_prefills"] for p in phases
        ),
        "tokens": sum(p["tokens"] for p in phases),
        "prefill_steps": sum(p["prefill_steps"] for p in phases),
        "max_gap_ms": max(p["max_gap_ms"] for p in phases),
        "alone_ms_per_token": statistics.fmean(alone) if alone else math.nan,
        "outlived": all(p["outlived"] for p in phases),
        "phases": phases,
    }


def host_steal_ms(stat: Path = Path("/proc/stat")) -> float | None:
    """The host's steal so far, summed over this machine's CPUs, in ms (None: unknown).

    ``/proc/stat``'s first line counts, in clock ticks, the time the hypervisor ran
    something else while one of this guest's virtual CPUs wanted to run (its eighth
    number, "steal"); Linux only.
    """
    try:
        fields = stat.read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return None
    if fields[0] != "cpu" or len(fields) < 9:
        return None
    return int(fields[8]) * 1e3 / os.sysconf("SC_CLK_TCK")


def _steps(path: Path) -> list[dict[str, Any]]:
    """The worker's step records between the ``measured`` and ``end`` marks."""
    steps: list[dict[str, Any]] = []
    inside = False
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if "mark" in record:
            inside = record["mark"] == "measured"
        elif inside:
            steps.append(record)
    return steps


def percentile(values: list[float], fraction: float) -> float:
    """Nearest rank: the smallest value with at least ``fraction`` of them at or below."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(fraction * len(ordered)) - 1)]


KINDS = {
    "steps that load": lambda s: s["loads"] > 0,
    "steps that store": lambda s: s["stores"] > 0,
    "all steps": lambda s: True,
}

FIGURES = (
    "connector ms per step, steps that store, p90",
    "connector ms per step, steps that store, max",
    "connector ms per step, steps that load, p90",
    "connector ms per step, steps that load, max",
    "connector ms per step, all steps, p90",
    "connector ms per step, all steps, max",
    "mpcache R ms per token / vllm R ms per token",
    "mpcache R ms per token outside prefills / vllm R ms per token outside prefills",
    "vllm R ms per token",
    "mpcache R ms per token",
    "mpcache R ms per token / mpcache-alt R ms per token",
    "mpcache-alt R ms per token / vllm R ms per token",
    "connector ms per step less host stalls, all steps, p90",
    "connector ms per step less host stalls, all steps, max",
)
"""What docs/benchmarks.md quotes (bench/common.py ``results``): per-step sums of the
worker's connector calls in ms (each round's p90 or max), R's decode time per token
and its ratio to the baseline's within each round; with ``--host-stalls``, every
step's sum less what the host took (module docstring)."""


def _step_figures(table: Any, steps: list[dict[str, Any]]) -> None:
    for kind, selects in KINDS.items():
        sums = [s["ms"] for s in steps if selects(s)]
        if not sums:
            continue
        table.add(f"connector ms per step, {kind}, median", statistics.median(sums))
        table.add(f"connector ms per step, {kind}, p90", percentile(sums, 0.9))
        table.add(f"connector ms per step, {kind}, max", max(sums))
        table.add(f"connector ms per step, {kind}, steps", len(sums))
    if steps and all("stalled_ms" in s for s in steps):
        own = [s["ms"] - s["stalled_ms"] for s in steps]
        name = "connector ms per step less host stalls, all steps"
        table.add(f"{name}, median", statistics.median(own))
        table.add(f"{name}, p90", percentile(own, 0.9))
        table.add(f"{name}, max", max(own))
        table.add(f"{name}, steps", len(own))


def past_max(steps: list[dict[str, Any]]) -> tuple[int, int]:
    """(steps whose connector time is past ``MAX_STEP_MS``, those of them still past
    it with the host's stalls taken out). A record without ``stalled_ms`` (a run
    without ``--host-stalls``) counts whole: its stalls are not known."""
    over = [s for s in steps if s["ms"] > MAX_STEP_MS]
    return len(over), sum(s["ms"] - s.get("stalled_ms", 0.0) > MAX_STEP_MS for s in over)


def _calls(steps: list[dict[str, Any]], selects: Any) -> str:
    """The calls that took the most of the selected steps' time, with their p90."""
    per_call: dict[str, list[float]] = {}
    for step in steps:
        if selects(step):
            for name, (_, ms) in step["calls"].items():
                per_call.setdefault(name, []).append(ms)
    top = sorted(per_call.items(), key=lambda item: -sum(item[1]))[:3]
    return ", ".join(f"{name} p90 {percentile(ms, 0.9):.3f} max {max(ms):.3f}" for name, ms in top)


def _report(rounds: list[dict[str, Any]]) -> str:
    from bench.common import Rounds, results, summary

    table = Rounds()
    all_steps: list[dict[str, Any]] = []
    for r in rounds:
        _step_figures(table, r["steps"])
        all_steps += r["steps"]
        for engine in (e for e in (*ENGINES, ALT) if e in r):
            decode = r[engine]["decode"]
            table.add(f"{engine} R ms per token", decode["ms_per_token"])
            outside = decode["ms_per_token_outside_prefills"]
            table.add(f"{engine} R ms per token outside prefills", outside)
    lines = [f"{'connector ms per step (worker)':<34}{'median':>22}{'p90':>22}{'max':>22}  steps"]
    stalls = "connector ms per step less host stalls, all steps"
    measured = f"{stalls}, p90" in table.values  # a --host-stalls run
    rows = [(kind, f"connector ms per step, {kind}") for kind in KINDS]
    rows += [("all steps less host stalls", stalls)] if measured else []
    for label, name in rows:
        if f"{name}, p90" not in table.values:
            lines.append(f"{label:<34}  none")
            continue
        cells = [summary(table.values[f"{name}, {q}"], 3) for q in ("median", "p90", "max")]
        steps = summary(table.values[f"{name}, steps"], 0)
        lines.append(f"{label:<34}{cells[0]:>22}{cells[1]:>22}{cells[2]:>22}  {steps}")
    lines.append("(each cell: median (min-max) over the rounds of the round's figure)")
    if measured:
        over, still = past_max(all_steps)
        lines.append(
            f"steps past {MAX_STEP_MS:g} ms (all rounds): {over}; still past it with the "
            f"host's stalls taken out: {still}"
        )
    for kind, selects in KINDS.items():
        lines.append(f"where the time went, {kind} (all rounds' steps, ms): ")
        lines[-1] += _calls(all_steps, selects) or "none"
    mismatched = [
        (i, engine, case)
        for i, r in enumerate(rounds)
        for engine in ("mpcache", ALT)
        if engine in r
        for case, ids in r[engine]["outputs"].items()
        if not case.endswith(" R") and ids != r["vllm"]["outputs"].get(case)
    ]
    lines.append(
        f"outputs differing from the vllm engine's (round, engine, case): {mismatched or 'none'}"
    )
    agree = [
        tuple(
            _agreeing(r["mpcache"]["outputs"][f"decode{k} R"], r["vllm"]["outputs"][f"decode{k} R"])
            for k in range(PHASES)
        )
        for r in rounds
    ]
    lines.append(
        f"R's tokens equal in both engines, from the first, per round and phase: {agree} of "
        f"{len(rounds[0]['vllm']['outputs']['decode0 R'])} (R's batches differ once a load "
        "holds a request back a step; vLLM on CPU is not batch-invariant)"
    )
    lines.append(
        "targets: connector ms per step p90 <= 0.5, max <= 2; R ms per token mpcache / vllm <= 1.1"
    )
    lines.append(results(FIGURES, table))
    return "\n".join(lines)


def _agreeing(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))


def _round_line(index: int, results: dict[str, Any]) -> str:
    mp, base = results["mpcache"]["decode"], results["vllm"]["decode"]

    def pair(key: str) -> str:
        return f"{mp[key]:.1f} / {base[key]:.1f}"

    worst = {
        kind: max((s["ms"] for s in results["steps"] if selects(s)), default=math.nan)
        for kind, selects in KINDS.items()
    }
    steal = " / ".join(
        f"{results[e]['host_steal_ms']:.0f}" if "host_steal_ms" in results[e] else "?"
        for e in ENGINES
    )
    own = ""
    if results["steps"] and all("stalled_ms" in s for s in results["steps"]):
        worst_own = max(s["ms"] - s["stalled_ms"] for s in results["steps"])
        own = f", {worst_own:.1f} less host stalls"
    alt = ""
    if ALT in results:
        ms = results[ALT]["decode"]["ms_per_token"]
        alt = f"; {ALT} {ms:.1f} = {ms / base['ms_per_token']:.3f} of vllm's"
    phases = " / ".join(
        ", ".join(f"{p['ms_per_token']:.1f}" for p in results[e]["decode"]["phases"])
        for e in ENGINES
    )
    return (
        f"round {index + 1}: R ms per token, mpcache / vllm: {pair('ms_per_token')} = "
        f"{mp['ms_per_token'] / base['ms_per_token']:.3f} (phases {phases}); outside prefills "
        f"{pair('ms_per_token_outside_prefills')} = "
        f"{mp['ms_per_token_outside_prefills'] / base['ms_per_token_outside_prefills']:.3f} "
        f"({mp['tokens']} tokens, {mp['prefill_steps']} prefills over its phases; longest gap "
        f"{pair('max_gap_ms')}; R alone after {pair('alone_ms_per_token')}); connector max per "
        f"step: stores {worst['steps that store']:.1f}, loads {worst['steps that load']:.1f}, "
        f"all {worst['all steps']:.1f} ms{own} ({len(results['steps'])} steps); host steal, "
        f"mpcache / vllm: {steal} ms{alt}"
    )


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "make-model":
        make_model(sys.argv[2], json.loads(sys.argv[3]))
        return
    if len(sys.argv) == 3 and sys.argv[1] == "engine":
        _engine(json.loads(Path(sys.argv[2]).read_text()))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="a smoke run: fewer requests")
    parser.add_argument("--requests", type=int, default=3, help="prompts passed twice")
    parser.add_argument("--others", type=int, default=6, help="arrivals during R, half cached")
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--r-prompt", type=int, default=128, help="R's prompt tokens")
    parser.add_argument("--r-tokens", type=int, default=96, help="R's generated tokens")
    parser.add_argument("--chunk-size", type=int, default=256, help="the server's --chunk-size")
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--executor", default="mp", help="vLLM's distributed_executor_backend")
    parser.add_argument("--e2e-venv", type=Path, default=ROOT / ".venv-e2e")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (logs)")
    parser.add_argument(
        "--host-stalls",
        action="store_true",
        help="also take out of each step's time what the host took (module docstring)",
    )
    parser.add_argument(
        "--compare-server-args",
        metavar="ARGS",
        default="",
        help=f"also run the engine {ALT} each round, its server given ARGS",
    )
    args = parser.parse_args()
    if args.quick:
        args.requests, args.others, args.r_tokens = 1, 2, 48
    if args.others * ARRIVAL_EVERY + 16 > args.r_tokens:
        parser.error("--r-tokens too few for R to outlive every arrival")
    if (args.others + 1) // 2 > args.requests:
        parser.error("--others: the cached arrivals are the passes' prompts; too few --requests")
    if args.rounds < 5:
        print(f"note: {args.rounds} rounds; figures want at least 5", file=sys.stderr)

    python, work, shape = prepare_run(args, "mpcache-step-")
    print(
        f"model: random Llama, {args.layers} layers, hidden {args.hidden}, 4 KV heads of 64, "
        f"{args.dtype}, block {args.block_size}; server --chunk-size {args.chunk_size}; "
        f"{args.requests} prompts passed twice, R ({args.r_prompt}-token prompt, "
        f"{args.r_tokens} tokens) with {args.others} arrivals, {args.prompt_tokens} tokens each"
    )
    engines = ENGINES + ((ALT,) if args.compare_server_args else ())
    server_args = ["--chunk-size", str(args.chunk_size), "--pool-size", "1GiB"]
    servers = {"mpcache": server_args, ALT: server_args + args.compare_server_args.split()}
    rounds: list[dict[str, Any]] = []
    for index in range(args.rounds):
        prompts = _prompts(args, seed=index)
        first = index % len(engines)
        specs: dict[str, dict[str, Any]] = {}
        for engine in engines[first:] + engines[:first]:
            records = work / f"r{index}-{engine}-steps.jsonl"  # the mpcache engines' workers'
            specs[engine] = {
                **prompts,
                **shape,
                "engine": engine,
                "model": str(work / "model"),
                "block_size": args.block_size,
                "executor": args.executor,
                "host_stalls": args.host_stalls,
                "records": str(records) if engine in servers else "",
            }
        results = _round(python, specs, servers, work)
        (work / f"r{index}.json").write_text(json.dumps(results))
        rounds.append(results)
        print(_round_line(index, results), flush=True)
    print(_report(rounds))
    if args.keep:
        print(f"work folder: {work}")


if __name__ == "__main__":
    main()
