#!/usr/bin/env python3
"""The floor of ctxproxy's HTTP stack: the same server and client (aiohttp on uvloop, a pooled client session with
no cookie jar, no access log), relaying a chat request's bytes to the upstream and the answer back, and nothing else.

`compare.sh` runs it beside the proxies (label ``floor``): what ctxproxy costs above it is its own code (the
scope, the pipeline, metrics, accounting); what the floor costs, no code of ctxproxy's can take back short of
another HTTP stack. Not a proxy anyone should run: no limits, no timeouts, no error mapping.

    UPSTREAM_BASE=http://127.0.0.1:18001/v1 .venv/bin/python bench/floor_relay.py --port 14000
"""

from __future__ import annotations

import argparse
import asyncio
import os

import aiohttp
from aiohttp import web


async def serve(port: int, upstream: str) -> None:
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=100), cookie_jar=aiohttp.DummyCookieJar(),
                                    skip_auto_headers=("User-Agent",))
    url = upstream + "/chat/completions"
    headers = {"Content-Type": "application/json", "Authorization": "Bearer sk-fake"}

    async def relay(request: web.Request) -> web.Response:
        body = await request.read()
        async with session.post(url, data=body, headers=headers) as answer:
            return web.Response(body=await answer.read(), status=answer.status, content_type="application/json")

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/chat/completions", relay)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    await asyncio.Event().wait()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    args = ap.parse_args()
    upstream = os.environ.get("UPSTREAM_BASE", "http://127.0.0.1:18001/v1")
    try:
        import uvloop  # as ctxproxy serve runs (it is optional there too)
    except ImportError:  # pragma: no cover
        asyncio.run(serve(args.port, upstream))
    else:
        uvloop.run(serve(args.port, upstream))


if __name__ == "__main__":
    main()
