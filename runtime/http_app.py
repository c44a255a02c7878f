"""Starting an aiohttp app in front of a backend, shared by the OpenAI server and the PD workers."""

from __future__ import annotations

from aiohttp import web


async def start_app(app: web.Application, backend, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Start `backend` (if it is not running) and listen on `host:port` (0: any free port).

    Returns the runner and the bound port. If listening fails (the port is taken, say), nothing
    is left running: the runner is cleaned up and the backend shut down before re-raising.
    """
    if not backend.running:
        backend.start()
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=5.0)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except BaseException:
        await runner.cleanup()
        await backend.shutdown()
        raise
    bound = runner.addresses
    return runner, (bound[0][1] if bound else port)
