"""The official MCP Python SDK as the client of `cyrene mcp` (tests/mcp.rs).

argv: the cyrene binary, then its arguments (stdio); or `--http URL KEY` for a `cyrene mcp
--http` already serving. Prints one JSON object: the tools listed, the answer of ask_cyrene, the
resources listed and the first transcript read.
"""
import asyncio
import json
import os
import sys

from mcp import ClientSession, StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client


def transport():
    if sys.argv[1] == "--http":
        http = create_mcp_http_client(headers={"Authorization": f"Bearer {sys.argv[3]}"})
        return streamable_http_client(sys.argv[2], http_client=http)
    params = StdioServerParameters(
        command=sys.argv[1], args=sys.argv[2:],
        env={k: v for k, v in os.environ.items() if k.startswith(("NATS_", "CYRENE_", "RUST_"))},
    )
    return stdio_client(params)


async def main() -> None:
    async with transport() as streams:
        read, write = streams[0], streams[1]
        async with ClientSession(read, write) as session:
            await session.initialize()
            tools = await session.list_tools()
            answer = await session.call_tool("ask_cyrene", {"question": sys.stdin.readline().strip()})
            wrong = await session.call_tool("ask_cyrene", {"question": 42})
            resources = await session.list_resources()
            transcript = ""
            if resources.resources:
                read_back = await session.read_resource(resources.resources[0].uri)
                transcript = read_back.contents[0].text
            print(json.dumps({
                "tools": [t.name for t in tools.tools],
                "answer": [c.text for c in answer.content if c.type == "text"],
                "answer_is_error": bool(answer.is_error),
                "wrong_is_error": bool(wrong.is_error),
                "resources": [str(r.uri) for r in resources.resources],
                "transcript": transcript,
            }))


asyncio.run(main())
