"""OpenAI-compatible streaming TTS server for a built artifact (see docs/serving.md)."""

from kokoro_opt.serve.app import create_app
from kokoro_opt.serve.config import ServeConfig
from kokoro_opt.serve.engine import Engine
from kokoro_opt.serve.server import ServerThread, running, serve_forever, wait_ready

__all__ = ["Engine", "ServeConfig", "ServerThread", "create_app", "running", "serve_forever", "wait_ready"]
