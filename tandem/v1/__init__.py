"""Generated gRPC stubs of proto/tandem/v1, made when the package is built (see tandem.proto_build).

Importing this package never runs protoc: it only checks that the stubs are
there (and, in a source checkout, not older than their .proto files), so that
a missing build step fails here with a message instead of deep inside gRPC.
"""

from tandem.proto_build import stale_stubs as _stale_stubs

_stale = _stale_stubs()
if _stale:
    raise ImportError(
        f"Tandem's gRPC stubs are missing or older than proto/ ({', '.join(_stale)} in {__path__[0]}). "
        "They are generated at install time: run `make setup` (or `pip install -e .`) in the checkout, "
        "or `python -m tandem.proto_build` after editing a .proto."
    )
del _stale, _stale_stubs
