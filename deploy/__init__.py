"""Deployment: Ray Serve application, CLI, model store, benchmarks and local cluster bring-up."""
