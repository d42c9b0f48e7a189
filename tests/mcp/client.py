"""The official MCP Python SDK as the client of `cyrene mcp` (tests/mcp.rs).

argv: the cyrene binary, then its arguments. Prints one JSON object: the tools listed, the
answer of ask_cyrene, the resources listed and the first transcript read.
"""
import asyncio
import json
import os
import sys

from mcp import ClientSession, StdioServerParameters, stdio_client


async def main() -> None:
    params = StdioServerParameters(
        command=sys.argv[1], args=sys.argv[2:],
        env={k: v for k, v in os.environ.items() if k.startswith(("NATS_", "CYRENE_", "RUST_"))},
    )
    async with stdio_client(params) as (read, write):
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
