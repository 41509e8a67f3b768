"""The Ray Serve ingress: the application builder, OpenAI HTTP and gRPC APIs, auth and metrics."""
