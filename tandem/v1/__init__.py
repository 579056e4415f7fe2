"""Generated gRPC stubs of proto/tandem/v1 (built on first import when missing)."""

from tandem.proto_build import ensure as _ensure

_ensure()
