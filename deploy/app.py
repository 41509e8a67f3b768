"""The import path `deploy.app:build_app` that `serve run`, `serve deploy` and KubeRay's serveConfigV2 name."""

from deploy.serve.app import APP_NAME, build_app

__all__ = ["APP_NAME", "build_app"]
