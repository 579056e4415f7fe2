"""gRPC plumbing shared by every server and client: status mapping, server lifecycle, wire conversion."""
