"""Servers on OpenEnv's WebSocket path (``/ws``) that misbehave, for the ``openenv`` env's tests,
written with FastAPI alone (they start in a second, without importing openenv-core's server):
``garbage_app`` answers a step with text that is not JSON (after a good reset), ``error_app`` an
error message, ``silent_app`` nothing at all; ``count_app`` is a well-behaved counting game (the
observation is the number of steps so far; the third step ends it with reward 1), for the test of
a server saorl starts and stops (``env.options.module``)."""

from __future__ import annotations

import asyncio
import json

from fastapi import FastAPI, WebSocket


def _app(answer) -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "healthy"}

    @app.get("/schema")
    def schema() -> dict:
        return {"action": {"properties": {"text": {"type": "string"}}, "required": ["text"]}}

    @app.websocket("/ws")
    async def ws(websocket: WebSocket) -> None:
        await websocket.accept()
        steps = 0
        while True:
            message = json.loads(await websocket.receive_text())
            if message.get("type") == "close":
                await websocket.close()
                return
            steps = 0 if message.get("type") == "reset" else steps + 1
            await answer(websocket, message, steps)

    return app


def _observation(text: str, reward: float = 0.0, done: bool = False) -> str:
    return json.dumps({"type": "observation", "data": {"observation": {"text": text}, "reward": reward,
                                                       "done": done}})


async def _garbage(websocket: WebSocket, message: dict, steps: int) -> None:
    await websocket.send_text(_observation("go") if message.get("type") == "reset"
                              else "<html>502 Bad Gateway</html>")


async def _error(websocket: WebSocket, message: dict, steps: int) -> None:
    await websocket.send_text(json.dumps({"type": "error", "data": {"message": "the game broke",
                                                                    "code": "EXECUTION_ERROR"}}))


async def _silent(websocket: WebSocket, message: dict, steps: int) -> None:
    await asyncio.sleep(3600)


async def _count(websocket: WebSocket, message: dict, steps: int) -> None:
    await websocket.send_text(_observation(f"count {steps}", 1.0 if steps == 3 else 0.0, steps == 3))


garbage_app = _app(_garbage)
error_app = _app(_error)
silent_app = _app(_silent)
count_app = _app(_count)
