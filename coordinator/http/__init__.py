"""The coordinator's OpenAI-compatible HTTP API (``--http-port``): routes in ``app``, request parsing in ``schema``,
response shapes in ``responses``, OpenAI error bodies in ``errors``. See ``app`` for how it shares the gRPC
API's request path."""

from coordinator.http.app import HttpApi

__all__ = ["HttpApi"]
