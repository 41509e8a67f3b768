"""Cluster and image tooling: the local multi-node Ray cluster, Kubernetes rendering, Dockerfiles."""
