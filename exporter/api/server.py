"""The API under uvicorn in a background thread (the demo, and tests that need a real server)."""

from __future__ import annotations

import threading
import time


class BackgroundServer:
    def __init__(self, app, host: str = "127.0.0.1", port: int = 0):
        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, name="nucleus-api", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the API server did not start on {host}:{port}")
            time.sleep(0.02)
        bound = self.server.servers[0].sockets[0].getsockname()
        self.url = f"http://{bound[0]}:{bound[1]}"

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
