"""Route a prompt to the vLLM instance whose mpcache server holds its longest prefix.

An example, not a production router: it asks one mpcache server of the deployment
``POST /cluster/lookup`` (which answers for every live member, from Redis, without
calling the others) and picks the vLLM instance paired with the member that holds
the most leading tokens in its pool; with no hit anywhere, the least recently picked
instance (round robin). docs/cluster.md describes the API and the KV events a
long-running router would follow instead.

    python examples/prefix_router.py --mpcache http://node-a:8733 \\
        --pair http://node-a:8733=http://node-a:8000 \\
        --pair http://node-b:8733=http://node-b:8000 \\
        --model meta-llama/Llama-3.1-8B --tokens 128000,791,4062,14198

It prints the chosen vLLM URL and why. ``route`` is the part to reuse.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import httpx

__all__ = ["Choice", "Router", "main"]


@dataclass(frozen=True)
class Choice:
    vllm_url: str
    mpcache_url: str
    hit_tokens: int
    """Leading tokens of the prompt that server's pool holds (0: no hit anywhere)."""


class Router:
    """Picks an instance per prompt. ``pairs`` maps each mpcache server's URL (as it
    publishes it: ``GET /cluster`` lists host and port) to the vLLM instance beside it."""

    def __init__(
        self,
        mpcache_url: str,
        pairs: Mapping[str, str],
        *,
        api_token: str | None = None,
        client: httpx.Client | None = None,
    ) -> None:
        if not pairs:
            raise ValueError("give at least one mpcache=vllm pair")
        self._url = mpcache_url.rstrip("/")
        self._pairs = {k.rstrip("/"): v for k, v in pairs.items()}
        headers = {"Authorization": f"Bearer {api_token}"} if api_token else {}
        self._client = client or httpx.Client(timeout=2.0, headers=headers)
        self._turns: Iterator[str] = itertools.cycle(self._pairs)

    def route(self, model: str, tokens: Sequence[int], cache_salt: str | None = None) -> Choice:
        """The instance for this prompt; on any error, the next one in turn."""
        body = {"model": model, "tokens": list(tokens), "cache_salt": cache_salt}
        try:
            reply = self._client.post(f"{self._url}/cluster/lookup", json=body)
            reply.raise_for_status()
            servers = reply.json()["servers"]
        except (httpx.HTTPError, KeyError, ValueError):
            servers = []
        known = [s for s in servers if (s.get("url") or "").rstrip("/") in self._pairs]
        best = max(known, key=lambda s: int(s["l1_tokens"]), default=None)
        if best is None or int(best["l1_tokens"]) == 0:
            server = next(self._turns)
            return Choice(self._pairs[server], server, 0)
        server = best["url"].rstrip("/")
        return Choice(self._pairs[server], server, int(best["l1_tokens"]))

    def close(self) -> None:
        self._client.close()


def _pair(text: str) -> tuple[str, str]:
    mpcache, sep, vllm = text.partition("=")
    if not sep or not mpcache or not vllm:
        raise argparse.ArgumentTypeError(f"expected MPCACHE_URL=VLLM_URL, got {text!r}")
    return mpcache, vllm


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mpcache", required=True, help="any mpcache server of the deployment")
    parser.add_argument("--pair", type=_pair, action="append", required=True)
    parser.add_argument("--model", required=True, help="vLLM's --model (what the connector sent)")
    parser.add_argument("--tokens", required=True, help="the prompt's token ids, comma-separated")
    parser.add_argument("--cache-salt", default=None)
    parser.add_argument("--api-token", default=None, help="the servers' MPCACHE_API_TOKEN")
    args = parser.parse_args(argv)
    tokens = [int(t) for t in args.tokens.split(",") if t.strip()]
    router = Router(args.mpcache, dict(args.pair), api_token=args.api_token)
    try:
        choice = router.route(args.model, tokens, args.cache_salt)
    finally:
        router.close()
    why = (
        f"{choice.hit_tokens} prefix tokens cached at {choice.mpcache_url}"
        if choice.hit_tokens
        else "no server holds a prefix: next in turn"
    )
    print(f"{choice.vllm_url}\t{why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
