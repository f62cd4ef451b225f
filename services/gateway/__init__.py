"""The Blitzmesh gateway: OpenAI-compatible HTTP and SDK gRPC front end of the mesh."""
